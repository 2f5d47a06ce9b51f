"""Where a GRPO step's time goes at long prompts, plait beside TRL 1.16 (equal settings: fp32, no
gradient checkpointing, beta 0, one iteration).

    .venv-trl/bin/python benchmarks/grpo_long_prompt.py [--prompt_length 992] [--steps 1] [--model FOLDER]

Runs in the parity venv, never in the main one. Each library trains in a fresh process, built by
the same code with only the import changed, on prompts of exactly ``--prompt_length`` tokens with
4 completions of 32 new tokens (one group per step). The model's own ``generate``, ``forward`` and
the accelerator's ``backward`` are timed in place (forwards inside ``generate`` count as
generation), so the split means the same for both: generation, forwards outside generation (the
loss forward, and any log-prob pass of the rollout), backward, and the rest of the step. Each
forward outside generation is listed with its [batch, length] and whether it kept autograd state.
Writes results/grpo_long_prompt.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from trl_side_by_side import GENERATIONS, NEW_TOKENS, length_reward, rows  # noqa: E402

RESULTS = HERE / "results" / "grpo_long_prompt.json"


def worker(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    torch.manual_seed(0)
    library = importlib.import_module(spec["library"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    steps = spec["steps"] + 1  # the first is warm-up
    args = library.GRPOConfig(
        output_dir=spec["output_dir"], max_steps=steps, per_device_train_batch_size=GENERATIONS,
        num_generations=GENERATIONS, generation_batch_size=GENERATIONS, max_completion_length=NEW_TOKENS,
        bf16=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none",
        learning_rate=1e-6, seed=0, **({"use_cpu": True} if spec["library"] == "trl" else {}))
    data = Dataset.from_list(rows("grpo", spec["prompt_length"], tokenizer, steps))
    trainer = library.GRPOTrainer(model=spec["model"], reward_funcs=length_reward, args=args, train_dataset=data,
                                  processing_class=tokenizer)
    model = trainer.model
    clock = {"generate": 0.0, "forward": 0.0, "backward": 0.0}
    forwards: list[dict] = []
    state = {"in_generate": False, "measuring": False}

    def timed(name, fn, record=None):
        def wrapper(*a, **kw):
            outer = name == "generate" or not state["in_generate"]
            if name == "generate":
                state["in_generate"] = True
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                seconds = time.perf_counter() - start
                if name == "generate":
                    state["in_generate"] = False
                if outer and state["measuring"]:
                    clock[name] += seconds
                    if record:
                        forwards.append(record(a, kw, seconds))
        return wrapper

    def forward_record(a, kw, seconds):
        ids = kw.get("input_ids", a[0] if a else None)
        return {"shape": list(ids.shape) if ids is not None else None, "grad": torch.is_grad_enabled(),
                "seconds": round(seconds, 2)}

    model.generate = timed("generate", model.generate)
    model.forward = timed("forward", model.forward, forward_record)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state_, control, **kw):
            stamps.append(time.perf_counter())
            state["measuring"] = True  # from the second step on

    trainer.add_callback(Clock())
    trainer.train()
    step = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    per_step = {k: v / (len(stamps) - 1) for k, v in clock.items()}
    return {"s_per_step": step, **{f"{k}_s": v for k, v in per_step.items()},
            "other_s": step - sum(per_step.values()), "forwards_per_step": forwards[:len(forwards) // (len(stamps) - 1)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--prompt_length", type=int, default=992)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--libraries", default="plait,trl")
    parser.add_argument("--model")
    parser.add_argument("--output_dir", default="/tmp/plait-grpo-long-prompt")
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(json.loads(options.worker))))
        return
    model = options.model
    if model is None:
        sys.path.insert(0, str(HERE.parent / "examples"))
        from smollm2 import smollm2_path

        model = str(smollm2_path())
    runs = []
    for library in options.libraries.split(","):
        spec = {"library": library, "prompt_length": options.prompt_length, "steps": options.steps, "model": model,
                "output_dir": options.output_dir}
        load = os.getloadavg()[0]
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        result = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {
            "error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
        runs.append({**spec, **result, "load_1min": round(load, 2)})
        print(json.dumps(runs[-1]), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"model": model, "cores": os.cpu_count(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
