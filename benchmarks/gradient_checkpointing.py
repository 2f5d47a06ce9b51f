"""Gradient checkpointing on and off, per method: seconds per step and peak memory on SmolLM2.

    python benchmarks/gradient_checkpointing.py [--methods sft,dpo,dpo_lora,kto,reward_model,grpo]
        [--lengths 128,512] [--steps 2] [--rounds 1]

plait's default of ``gradient_checkpointing`` (on, for every method, as in TRL) comes from this measurement. Each
method trains SmolLM2-135M-Instruct in fp32 with the rows, batch and hyperparameters of
``trl_side_by_side.py`` (its worker, plait only, so it runs in the main venv), once with
checkpointing off and once on, each run a fresh process (peak RSS is the process's own),
interleaved for ``--rounds`` rounds so machine load hits both alike. Checkpointing keeps only each
decoder layer's input and recomputes the layer in backward: one more forward of the layers for not
holding their activations. Writes benchmarks/results/gradient_checkpointing.json.
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

RESULTS = HERE / "results" / "gradient_checkpointing.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct via examples/smollm2.py)")
    options = parser.parse_args()
    model = model_folder(options.model)
    runs = []
    for _ in range(options.rounds):
        for method in options.methods.split(","):
            for length in map(int, options.lengths.split(",")):
                for on in (False, True):
                    spec = {"library": "plait", "method": method, "length": length, "setting": "equal",
                            "gradient_checkpointing": on, "steps": options.steps, "model": model,
                            "output_dir": "/tmp/plait-bench-checkpointing"}
                    runs.append(run(spec))
                    print(json.dumps(runs[-1]), flush=True)
    # earlier runs of other methods or lengths stay in the file; these replace their own
    earlier = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    ran = {identity(r) for r in runs}
    runs = [r for r in earlier.get("runs", []) if identity(r) not in ran] + runs
    commands = earlier.get("commands", []) + [" ".join(sys.argv[1:])]
    table = summary(runs)
    for key, row in table.items():
        print(key, json.dumps(row))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"model": model, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                                   "commands": commands, "summary": table, "runs": runs}, indent=1))


def summary(runs: list[dict]) -> dict:
    """Per method and length: the fastest run off and on, on's slowdown and its peak RSS over off's."""
    table = {}
    for method, length in sorted({(r["method"], r["length"]) for r in runs}, key=lambda k: (METHODS.index(k[0]), k[1])):
        mine = [r for r in runs if r["method"] == method and r["length"] == length and "error" not in r]
        best = {on: min((r for r in mine if r["gradient_checkpointing"] == on), key=lambda r: r["s_per_step"],
                        default=None) for on in (False, True)}
        if None in best.values():
            continue
        off, on = best[False], best[True]
        table[f"{method}@{length}"] = {
            "s_per_step_off": off["s_per_step"], "s_per_step_on": on["s_per_step"],
            "slowdown_on": on["s_per_step"] / off["s_per_step"],
            "peak_rss_mib_off": off["peak_rss_mib"], "peak_rss_mib_on": on["peak_rss_mib"],
            "memory_ratio_on": on["peak_rss_mib"] / off["peak_rss_mib"],
            "load_1min": [round(r["load_1min"], 1) for r in (off, on)]}
    return table


def identity(run_: dict) -> tuple:
    return run_["method"], run_["length"], run_["gradient_checkpointing"]


if __name__ == "__main__":
    main()
