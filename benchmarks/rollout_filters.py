"""Dynamic sampling on the tiny model: reward against generated tokens, with and without filter.zero_variance.

    .venv/bin/python benchmarks/rollout_filters.py [--seeds 0 1 2] [--tokens 3072]

GRPO learns a binary verifiable reward (1 when a completion holds a token with id < LOW, about 11% of
random 4-token completions), so many groups of 4 are all 0 (or all 1) and carry no gradient. Each run
spends the same budget of generated completion tokens, every round counted (a filtered run's dropped
groups too), and the reward of every completion it generated is recorded as it was scored: both runs
sample from their current policy, so the mean reward of a window of generated tokens is the policy's reward
there. Printed: the mean reward per eighth of the token budget, per arm averaged over seeds, the
optimizer steps each arm took, and the same reward at equal optimizer steps (the first steps both
took). Not part of the test suite (about 6 minutes on 2 CPU cores).

Measured 2026-12-04 on the 2-core build machine (seeds 0-2, 3072 tokens; docs/methods.md quotes it):
  equal tokens, per eighth: plain         0.090 0.226 0.601 0.840 0.962 0.972 0.993 1.000 (48 steps)
                            zero_variance 0.087 0.104 0.184 0.267 0.521 0.833 0.986 1.000 (19 steps)
  equal steps, per quarter of the first 19: plain 0.075 0.183 0.433 0.698; zero_variance 0.110 0.254 0.612 0.990
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import plait  # noqa: E402
from plait.testing.tiny_model import tiny_model_path  # noqa: E402

LOW = 30
WORDS = ["The river", "A good answer", "What is 7 plus 5?", "Python is", "The weather today", "Numbers such as",
         "The children", "Nobody could", "Once upon", "In the end", "She said", "Tomorrow we", "Red and",
         "Counting to", "The cat", "Why is"]
WINDOWS = 8


class Ledger:
    """Every scored completion's (tokens generated so far, optimizer step, reward), in the order generated."""

    def __init__(self) -> None:
        self.tokens, self.points = 0, []

    def reward(self, completion_ids, trainer_state=None, **kwargs):
        scores = [float(any(t < LOW for t in ids)) for ids in completion_ids]
        for ids, score in zip(completion_ids, scores):
            self.tokens += len(ids)
            self.points.append((self.tokens, trainer_state.global_step, score))
        return scores


class StopAtBudget(TrainerCallback):
    def __init__(self, ledger: Ledger, budget: int) -> None:
        self.ledger, self.budget = ledger, budget

    def on_step_end(self, args, state, control, **kwargs):
        if self.ledger.tokens >= self.budget:
            control.should_training_stop = True


def run(seed: int, budget: int, filters: list | None) -> tuple[list[float], int, Ledger]:
    ledger = Ledger()
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as out:
        args = plait.GRPOConfig(
            output_dir=out, per_device_train_batch_size=16, num_generations=4, max_completion_length=4,
            learning_rate=1e-2, max_steps=10_000, logging_steps=1000, save_strategy="no", report_to="none",
            disable_tqdm=True, seed=seed, rollout_filters=filters, max_num_gen_batches=4)
        trainer = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=ledger.reward, args=args,
                                    train_dataset=Dataset.from_list([{"prompt": w} for w in WORDS]))
        trainer.add_callback(StopAtBudget(ledger, budget))
        trainer.train()
        steps = trainer.state.global_step
    width = budget / WINDOWS
    windows = [[r for t, _, r in ledger.points if k * width < t <= (k + 1) * width] for k in range(WINDOWS)]
    return [statistics.fmean(w) if w else float("nan") for w in windows], steps, ledger


def by_step(ledgers: list[Ledger], steps: int, windows: int = 4) -> list[float]:
    """Mean reward of the completions sampled in each of ``windows`` equal spans of the first ``steps``
    optimizer steps (every seed's): the same comparison at equal steps instead of equal tokens."""
    width = steps / windows
    return [statistics.fmean(r for ledger in ledgers for _, s, r in ledger.points if k * width <= s < (k + 1) * width)
            for k in range(windows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tokens", type=int, default=3072, help="generated completion tokens per run")
    cli = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    arms = {"plain GRPO": None, "zero_variance": [{"name": "zero_variance"}]}
    results = {}
    for name, filters in arms.items():
        curves, steps, ledgers = zip(*(run(seed, cli.tokens, filters) for seed in cli.seeds))
        results[name] = ([statistics.fmean(c[k] for c in curves) for k in range(WINDOWS)], steps, ledgers)
    print(f"mean reward of the completions generated in each eighth of {cli.tokens} tokens "
          f"(seeds {cli.seeds}; chance: {1 - (1 - LOW / 1000) ** 4:.3f} per completion if ids are uniform over 1000)")
    for name, (curve, steps, _) in results.items():
        print(f"{name:>14}: " + "  ".join(f"{r:.3f}" for r in curve) + f"   optimizer steps {list(steps)}")
    common = min(min(steps) for _, steps, _ in results.values())
    print(f"mean reward of the completions sampled in each quarter of the first {common} optimizer steps")
    for name, (_, _, ledgers) in results.items():
        print(f"{name:>14}: " + "  ".join(f"{r:.3f}" for r in by_step(list(ledgers), common)))


if __name__ == "__main__":
    main()
