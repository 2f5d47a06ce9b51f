"""GRPO step time on CPU, split into generation / reward / rollout log-probs / loss forward / backward.

Trains GRPOTrainer for a few optimizer steps and times each part by wrapping the trainer's own
pieces (the generation backend, the reward functions, the rollout log-prob pass, compute_loss
and the backward call); "other" is the rest of the step (optimizer, data loading, bookkeeping).
Rollout tokens/s = completion tokens sampled / generation seconds. Two settings: on-policy
(beta = 0, one pass: no extra log-prob pass) and beta = 0.04 with num_iterations = 2 (the
sampling policy's and the reference's log-probs are computed at each rollout).

    .venv/bin/python benchmarks/grpo.py                 # the tiny model
    PLAIT_BENCH_MODEL=/path/to/SmolLM2 .venv/bin/python benchmarks/grpo.py   # a real small model as well
    PLAIT_BENCH_THREADS=1 .venv/bin/python benchmarks/grpo.py   # on a shared 2-core machine, 1 thread is
                                                                 # up to 10x faster than 2 contended ones

Writes results/grpo.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import attrs  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import plait  # noqa: E402
from plait.testing.tiny_model import tiny_model_path  # noqa: E402

STEPS, WARMUP = 8, 2
PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is",
                                   "The weather today", "Numbers such as", "The children", "Nobody could")]


def low_tokens(completion_ids, **kwargs):
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]


class Timer:
    def __init__(self):
        self.seconds, self.tokens, self.steps = defaultdict(float), 0, []

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed


class StepClock(TrainerCallback):
    def __init__(self, timer: Timer):
        self.timer, self.start, self.parts = timer, 0.0, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.start, self.parts = time.perf_counter(), dict(self.timer.seconds)

    def on_step_end(self, args, state, control, **kwargs):
        total = time.perf_counter() - self.start
        parts = {k: v - self.parts.get(k, 0.0) for k, v in self.timer.seconds.items()}
        self.timer.steps.append({"total": total, **parts})


def run(model: str, label: str, completion_length: int, **overrides) -> dict:
    args = plait.GRPOConfig(
        output_dir="/tmp/plait-bench-grpo", per_device_train_batch_size=16, num_generations=8,
        max_completion_length=completion_length, learning_rate=1e-5, max_steps=STEPS, logging_steps=STEPS,
        report_to=[], save_strategy="no", disable_tqdm=True, seed=0, **overrides,
    )
    trainer = plait.GRPOTrainer(model, reward_funcs=low_tokens, args=args, train_dataset=PROMPTS * 8)
    timer = Timer()
    generate = trainer.backend.generate

    def counted_generate(prompts, sampling):
        out = generate(prompts, sampling)
        timer.tokens += sum(len(ids) for ids in out.completion_ids)
        return out

    trainer.backend.generate = timer.wrap("generation", counted_generate)
    trainer.reward_funcs = [attrs.evolve(f, fn=timer.wrap("reward", f.fn)) for f in trainer.reward_funcs]
    trainer.logps_of = timer.wrap("rollout_logprobs", trainer.logps_of)
    trainer.compute_loss = timer.wrap("loss_forward", trainer.compute_loss)
    trainer.accelerator.backward = timer.wrap("backward", trainer.accelerator.backward)
    trainer.add_callback(StepClock(timer))
    trainer.train()
    measured = timer.steps[WARMUP:]
    mean = {k: sum(s.get(k, 0.0) for s in measured) / len(measured) for k in measured[0]}
    mean["other"] = mean["total"] - sum(v for k, v in mean.items() if k != "total")
    gen_seconds = sum(s.get("generation", 0.0) for s in timer.steps)
    result = {"model": label, "settings": overrides, "completions_per_step": 16, "max_completion_length": completion_length,
              "step_seconds": {k: round(v, 4) for k, v in mean.items()},
              "rollout_tokens_per_second": round(timer.tokens / gen_seconds, 1)}
    print(f"{label:>8} {json.dumps(overrides):<42} step {mean['total']:.3f}s  "
          + "  ".join(f"{k} {v:.3f}" for k, v in mean.items() if k != "total")
          + f"  | {result['rollout_tokens_per_second']} tok/s")
    return result


def main() -> None:
    torch.manual_seed(0)
    if os.environ.get("PLAIT_BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["PLAIT_BENCH_THREADS"]))
    models = [(str(tiny_model_path()), "tiny", 32)]
    if os.environ.get("PLAIT_BENCH_MODEL"):
        models.append((os.environ["PLAIT_BENCH_MODEL"], pathlib.Path(os.environ["PLAIT_BENCH_MODEL"]).name, 16))
    results = []
    for path, label, length in models:
        results.append(run(path, label, length))
        results.append(run(path, label, length, beta=0.04, num_iterations=2))
    out = pathlib.Path(__file__).parent / "results" / "grpo.json"
    out.write_text(json.dumps({"torch_threads": torch.get_num_threads(), "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
