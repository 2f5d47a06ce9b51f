"""Wall time per optimizer step: synchronous GRPO vs asynchronous GRPO at equal steps, on CPU.

Each run is a fresh process (the async worker's start, a spawned interpreter, is reported apart):
GRPOTrainer, then AsyncGRPOTrainer with max_staleness=1 (one step off-policy) and weight pushes
after every step, same model, data, reward, seed and settings, rounds interleaved. Reported per run:
``step_seconds`` (median gap between optimizer steps after the first two: the steady state),
``first_two_seconds`` (the start: the worker's spawn and model build for async), ``wall_seconds``
(the whole train()) and the reward curve (mean per 5 steps). The trainer runs PLAIT_BENCH_THREADS
torch threads (1 by default: on a shared 2-core machine contended threads slow everything), the
async worker max(1, half of them): async uses one core more than sync, which is its point.

    .venv/bin/python benchmarks/async_grpo.py                          # the tiny model
    PLAIT_BENCH_MODEL=~/.cache/plait/SmolLM2-135M-Instruct .venv/bin/python benchmarks/async_grpo.py

Writes results/async_grpo.json (results/async_grpo_<model>.json for PLAIT_BENCH_MODEL).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

RUN = r'''
import json, os, sys, time
import torch
import plait
from transformers import TrainerCallback
from plait.testing.tiny_model import tiny_model_path

kind, model, steps, length, lora = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
torch.set_num_threads(int(os.environ.get("PLAIT_BENCH_THREADS", "1")))  # the async worker takes max(1, half)
PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is",
                                   "The weather today", "Numbers such as", "The children", "Nobody could")]
def low_tokens(completion_ids, **kwargs):
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]
common = dict(output_dir="/tmp/plait-bench-async-grpo", per_device_train_batch_size=16, num_generations=8,
              max_completion_length=length, learning_rate=1e-2 if not lora else 1e-3, max_steps=steps, logging_steps=5,
              report_to=[], save_strategy="no", disable_tqdm=True, seed=0, beta=0.0)
peft = None
if lora:
    from peft import LoraConfig
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    common.update(per_device_train_batch_size=8, num_generations=4)
model = model if model != "tiny" else str(tiny_model_path())
if kind == "sync":
    t = plait.GRPOTrainer(model, reward_funcs=low_tokens, args=plait.GRPOConfig(**common), train_dataset=PROMPTS * 8,
                          peft_config=peft)
else:
    t = plait.AsyncGRPOTrainer(model, reward_funcs=low_tokens, args=plait.AsyncGRPOConfig(**common, max_staleness=1),
                               train_dataset=PROMPTS * 8, peft_config=peft)
ends = []
class Clock(TrainerCallback):
    def on_step_end(self, *a, **k):
        ends.append(time.perf_counter())
t.add_callback(Clock())
torch.manual_seed(0)
start = time.perf_counter()
t.train()
wall = time.perf_counter() - start
gaps = sorted(b - a for a, b in zip(ends[1:], ends[2:]))
out = {"kind": kind, "step_seconds": round(gaps[len(gaps) // 2], 4), "mean_step_seconds": round(sum(gaps) / len(gaps), 4),
       "first_two_seconds": round(ends[1] - start, 2), "wall_seconds": round(wall, 2),
       "reward": [round(h["reward"], 3) for h in t.state.log_history if "reward" in h]}
if kind == "async":
    out["staleness"] = [b["step"] - b["version"] for b in t.consumed]
    out["dropped_batches"] = t.dropped_batches
print("RESULT " + json.dumps(out))
'''


def main() -> None:
    model = os.path.expanduser(os.environ.get("PLAIT_BENCH_MODEL", "tiny"))
    tiny = model == "tiny"
    steps, length, rounds = (16, 8, 2) if tiny else (6, 32, 1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    runs = []
    for _ in range(rounds):
        for kind in ("sync", "async"):
            done = subprocess.run([sys.executable, "-c", RUN, kind, model, str(steps), str(length), "0" if tiny else "1"],
                                  capture_output=True, text=True, env=env, timeout=3000)
            line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if done.returncode or not line:
                raise SystemExit(done.stderr[-3000:])
            runs.append(json.loads(line[-1][len("RESULT "):]))
            print(runs[-1], flush=True)
    name = "async_grpo.json" if tiny else f"async_grpo_{pathlib.Path(model).name}.json"
    load = os.getloadavg()
    result = {"model": "tiny" if tiny else pathlib.Path(model).name, "threads": os.environ.get("PLAIT_BENCH_THREADS", "1"), "steps": steps, "max_completion_length": length,
              "cpu_count": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in load], "runs": runs}
    path = pathlib.Path(__file__).parent / "results" / name
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
