"""Dynamic sampling on the tiny model: reward against generated tokens, with and without filter.zero_variance.

    .venv/bin/python benchmarks/rollout_filters.py [--task any_low|banded] [--lr 1e-2] [--group 4]
        [--seeds 0 1 2] [--tokens 3072] [--arms "plain GRPO" zero_variance] [--results FILE]

GRPO learns a binary verifiable reward on 4-token completions, so many groups are all 0 (or all 1) and
carry no gradient. ``any_low``: 1 when a completion holds a token with id < LOW (about 11% of random
completions), one skill every prompt shares. ``banded``: 1 when it holds a token in its prompt's own band
of LOW ids (four bands), a skill per prompt. Each run spends the same budget of generated completion
tokens, every round counted (a filtered run's dropped groups too), and the reward of every completion it
generated is recorded as it was scored: both runs sample from their current policy, so the mean reward
of a window of generated tokens is the policy's reward there. Printed: the mean reward per eighth of the
token budget, per arm averaged over seeds, the optimizer steps each arm took, and the same reward at
equal optimizer steps (the first steps both took); ``--results`` adds them to a JSON file under their
settings. Not part of the test suite (2-4 minutes per arm and setting on one core).

Measured 2026-12-04 on a 2-core Xeon (benchmarks/results/rollout_filters.json; docs/methods.md tabulates
it): at equal tokens the unfiltered arm is ahead in every setting at lr 1e-2 (any_low with groups of 4
and 8, banded); at equal steps the filtered one is.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

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
ARMS = {"plain GRPO": None, "zero_variance": [{"name": "zero_variance"}]}


def any_low(prompt: str, ids: list[int]) -> bool:
    """One skill shared by every prompt: any token id below LOW."""
    return any(t < LOW for t in ids)


def banded(prompt: str, ids: list[int]) -> bool:
    """A skill per prompt: a token in the prompt's own band of LOW ids (four bands, four prompts each), so what
    one prompt's group teaches does not carry over to prompts of another band."""
    band = WORDS.index(prompt) % 4
    return any(band * LOW <= t < (band + 1) * LOW for t in ids)


TASKS = {"any_low": any_low, "banded": banded}


class Ledger:
    """Every scored completion's (tokens generated so far, optimizer step, reward), in the order generated."""

    def __init__(self, task=any_low) -> None:
        self.tokens, self.points, self.task = 0, [], task

    def reward(self, prompts, completion_ids, trainer_state=None, **kwargs):
        scores = [float(self.task(prompt, ids)) for prompt, ids in zip(prompts, completion_ids)]
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


def run(seed: int, budget: int, filters: list | None, task=any_low, lr: float = 1e-2, group: int = 4,
        rounds: int = 4) -> tuple[list[float], int, Ledger]:
    ledger = Ledger(task)
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as out:
        args = plait.GRPOConfig(
            output_dir=out, per_device_train_batch_size=16, num_generations=group, max_completion_length=4,
            learning_rate=lr, max_steps=10_000, logging_steps=1000, save_strategy="no", report_to="none",
            disable_tqdm=True, seed=seed, rollout_filters=filters, max_num_gen_batches=rounds)
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
    parser.add_argument("--task", choices=sorted(TASKS), default="any_low")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--group", type=int, default=4, help="num_generations")
    parser.add_argument("--rounds", type=int, default=4, help="max_num_gen_batches of the filtered arm")
    parser.add_argument("--arms", nargs="+", default=["plain GRPO", "zero_variance"])
    parser.add_argument("--results", type=pathlib.Path, help="a JSON file to add each arm's curves to")
    cli = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    arms = {name: ARMS[name] for name in cli.arms}
    results = {}
    for name, filters in arms.items():
        curves, steps, ledgers = zip(*(run(seed, cli.tokens, filters, TASKS[cli.task], cli.lr, cli.group, cli.rounds)
                                       for seed in cli.seeds))
        results[name] = ([statistics.fmean(c[k] for c in curves) for k in range(WINDOWS)], steps, ledgers)
    print(f"mean reward of the completions generated in each eighth of {cli.tokens} tokens "
          f"(seeds {cli.seeds}; chance: {1 - (1 - LOW / 1000) ** 4:.3f} per completion if ids are uniform over 1000)")
    for name, (curve, steps, _) in results.items():
        print(f"{name:>14}: " + "  ".join(f"{r:.3f}" for r in curve) + f"   optimizer steps {list(steps)}")
    common = min(min(steps) for _, steps, _ in results.values())
    print(f"mean reward of the completions sampled in each quarter of the first {common} optimizer steps")
    for name, (_, _, ledgers) in results.items():
        print(f"{name:>14}: " + "  ".join(f"{r:.3f}" for r in by_step(list(ledgers), common)))
    if cli.results:
        record(cli, results)


def record(cli: argparse.Namespace, results: dict) -> None:
    """Add each arm's curve to ``cli.results`` under its settings (one file gathers every setting's arms)."""
    table = json.loads(cli.results.read_text()) if cli.results.exists() else {"runs": []}
    settings = {"task": cli.task, "lr": cli.lr, "num_generations": cli.group, "tokens": cli.tokens, "seeds": cli.seeds,
                "max_num_gen_batches": cli.rounds}
    for name, (curve, steps, ledgers) in results.items():
        table["runs"] = [r for r in table["runs"] if (r["settings"], r["arm"]) != (settings, name)]
        table["runs"].append({"settings": settings, "arm": name, "date": time.strftime("%Y-%m-%d"),
                              "reward_per_eighth_of_tokens": [round(r, 3) for r in curve], "optimizer_steps": list(steps),
                              "reward_per_quarter_of_steps": [round(r, 3) for r in by_step(list(ledgers), min(steps))]})
    cli.results.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
