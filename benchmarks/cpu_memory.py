"""plait's CPU memory switches (plait.engine.memory), per method: peak RSS and s/step on SmolLM2, off and on.

    python benchmarks/cpu_memory.py [--methods sft,dpo,dpo_lora,kto,reward_model,grpo]
        [--lengths 512] [--settings checkpointed] [--steps 2] [--rounds 1]
        [--switch THP_MEM_ALLOC_ENABLE|PLAIT_KEEP_FREED_HEAP]

plait asks torch for page-aligned large buffers when it is imported (``THP_MEM_ALLOC_ENABLE=1``,
plait.engine.memory); this measures what that does. Each method trains SmolLM2-135M-Instruct with the
rows, batch and hyperparameters of ``trl_side_by_side.py`` (its worker, plait only, so it runs in
the main venv), once with ``THP_MEM_ALLOC_ENABLE=0`` (torch's 64-byte alignment: glibc's heap
fragments) and once with ``=1``, each run a fresh process (peak RSS is the process's own),
interleaved for ``--rounds`` rounds so machine load hits both alike. ``--settings``:
``checkpointed`` (fp32 with gradient checkpointing: plait's defaults on a CPU without bf16 units),
``equal`` (fp32 without it) or ``defaults``. ``--switch PLAIT_KEEP_FREED_HEAP`` measures the other
switch the same way: glibc keeping freed heap memory for the next step (``1``, plait's default on a CPU
run) against glibc's own trimming (``0``). Writes benchmarks/results/cpu_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from trl_side_by_side import METHODS, model_folder, run  # noqa: E402

# plait.engine.memory.TORCH_SWITCH and KEEP_FREED_HEAP (not imported: importing plait sets the first here)
SWITCHES = ("THP_MEM_ALLOC_ENABLE", "PLAIT_KEEP_FREED_HEAP")

RESULTS = HERE / "results" / "cpu_memory.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--lengths", default="512")
    parser.add_argument("--settings", default="checkpointed")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct via examples/smollm2.py)")
    parser.add_argument("--switch", choices=SWITCHES, default=SWITCHES[0])
    options = parser.parse_args()
    model = model_folder(options.model)
    runs = []
    for _ in range(options.rounds):
        for method in options.methods.split(","):
            for length in map(int, options.lengths.split(",")):
                for setting in options.settings.split(","):
                    for value in ("0", "1"):
                        spec = {"library": "plait", "method": method, "length": length, "setting": setting,
                                "env": {options.switch: value}, "steps": options.steps, "model": model,
                                "output_dir": "/tmp/plait-bench-cpu-memory"}
                        runs.append(run(spec))
                        print(json.dumps(runs[-1]), flush=True)
    earlier = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    ran = {identity(r) for r in runs}  # earlier runs of other methods, lengths or settings stay; these replace their own
    runs = [r for r in earlier.get("runs", []) if identity(r) not in ran] + runs
    table = summary(runs)
    for key, row in table.items():
        print(key, json.dumps(row))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"model": model, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                                   "commands": earlier.get("commands", []) + [" ".join(sys.argv[1:])],
                                   "summary": table, "runs": runs}, indent=1))


def summary(runs: list[dict]) -> dict:
    """Per switch, method, length and setting, averaged over rounds: peak RSS and s/step with the switch
    on over off (memory_ratio < 1: less memory; slowdown > 1: slower)."""
    table = {}
    keys = sorted({identity(r)[:4] for r in runs}, key=lambda k: (k[0], METHODS.index(k[1]), k[2], k[3]))
    for switch, method, length, setting in keys:
        mean = {}
        for value in ("0", "1"):
            mine = [r for r in runs if identity(r) == (switch, method, length, setting, value) and "error" not in r]
            if mine:
                mean[value] = {field: sum(r[field] for r in mine) / len(mine) for field in ("s_per_step", "peak_rss_mib")}
                mean[value]["load_1min"] = [round(r["load_1min"], 1) for r in mine]
        if len(mean) < 2:
            continue
        off, on = mean["0"], mean["1"]
        name = f"{method}@{length}/{setting}" if switch == SWITCHES[0] else f"{method}@{length}/{setting}/{switch}"
        table[name] = {
            "peak_rss_mib_off": off["peak_rss_mib"], "peak_rss_mib_on": on["peak_rss_mib"],
            "memory_ratio": on["peak_rss_mib"] / off["peak_rss_mib"],
            "s_per_step_off": off["s_per_step"], "s_per_step_on": on["s_per_step"],
            "slowdown": on["s_per_step"] / off["s_per_step"], "load_1min": [off["load_1min"], on["load_1min"]]}
    return table


def identity(run_: dict) -> tuple:
    ((switch, value),) = run_["env"].items()
    return switch, run_["method"], run_["length"], run_["setting"], value


if __name__ == "__main__":
    main()
