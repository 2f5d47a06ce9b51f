"""Dynamic sampling on the tiny model: reward against generated tokens, with and without filter.zero_variance.

    .venv/bin/python benchmarks/rollout_filters.py [--task any_low|banded|mixed] [--lr 1e-2] [--group 4]
        [--seeds 0 1 2] [--tokens 3072] [--arms "plain GRPO" zero_variance ...] [--results FILE]

GRPO learns a binary verifiable reward on 4-token completions, so many groups are all 0 (or all 1) and
carry no gradient. ``any_low``: 1 when a completion holds a token with id < LOW (about 11% of random
completions), one skill every prompt shares. ``banded``: 1 when it holds a token in its prompt's own band
of LOW ids (four bands), a skill per prompt. ``mixed``: four prompts always score 1 (solved), four
always 0 (hopeless), the other eight are ``any_low``; the reward reported is the learnable prompts' only,
since the arms sample the three kinds in different shares. Each run spends the same budget of generated completion
tokens, every round counted (a filtered run's dropped groups too), and the reward of every completion it
generated is recorded as it was scored: both runs sample from their current policy, so the mean reward
of a window of generated tokens is the policy's reward there. Printed: the mean reward per eighth of the
token budget, per arm averaged over seeds, the optimizer steps each arm took, and the same reward at
equal optimizer steps (the first steps both took); ``--results`` adds them to a JSON file under their
settings. Not part of the test suite (2-4 minutes per arm and setting on one core).

Measured 2026-12-04 and 2026-12-05 on a 2-core Xeon (benchmarks/results/rollout_filters.json; docs/methods.md
tabulates it): at equal tokens the unfiltered arm is ahead of zero_variance's refills in every setting at
lr 1e-2 (any_low with groups of 4 and 8, banded); at equal steps the filtered one is. The skip without
refills ("skip, no refill": the filter's verdicts only feed skip_dropped_prompts) is ahead of plain GRPO
at equal tokens (its mean reward over the budget) in all five settings of seeds 0-5 (mixed at 1e-2 and 3e-3, groups of 8, any_low, banded).
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
# arm: (rollout_filters, skip_dropped_prompts, max_num_gen_batches; None: --rounds)
ARMS = {"plain GRPO": (None, None, None), "zero_variance": (["zero_variance"], None, None),
        # GRESO's pre-rollout skip with DAPO's refills, and alone (one round: dropped groups stay in the batch)
        "zero_variance + skip": (["zero_variance"], 0.5, None), "skip, no refill": (["zero_variance"], 0.5, 1)}


def any_low(prompt: str, ids: list[int]) -> bool:
    """One skill shared by every prompt: any token id below LOW."""
    return any(t < LOW for t in ids)


def banded(prompt: str, ids: list[int]) -> bool:
    """A skill per prompt: a token in the prompt's own band of LOW ids (four bands, four prompts each), so what
    one prompt's group teaches does not carry over to prompts of another band."""
    band = WORDS.index(prompt) % 4
    return any(band * LOW <= t < (band + 1) * LOW for t in ids)


def mixed(prompt: str, ids: list[int]) -> bool:
    """Solved, hopeless and learnable prompts: what GRESO's skip predicts from a prompt's history."""
    kind = WORDS.index(prompt) // 4
    return True if kind == 0 else False if kind == 1 else any_low(prompt, ids)


def counted(task, prompt: str) -> bool:
    """Does this prompt's reward go into the curves? (``mixed``: only the learnable prompts')"""
    return task is not mixed or WORDS.index(prompt) >= 8


TASKS = {"any_low": any_low, "banded": banded, "mixed": mixed}


class Ledger:
    """Every counted completion's (tokens generated so far, optimizer step, reward), in the order generated
    (every completion's tokens count)."""

    def __init__(self, task=any_low) -> None:
        self.tokens, self.points, self.task = 0, [], task

    def reward(self, prompts, completion_ids, trainer_state=None, **kwargs):
        scores = [float(self.task(prompt, ids)) for prompt, ids in zip(prompts, completion_ids)]
        for prompt, ids, score in zip(prompts, completion_ids, scores):
            self.tokens += len(ids)
            if counted(self.task, prompt):
                self.points.append((self.tokens, trainer_state.global_step, score))
        return scores


class StopAtBudget(TrainerCallback):
    def __init__(self, ledger: Ledger, budget: int) -> None:
        self.ledger, self.budget = ledger, budget

    def on_step_end(self, args, state, control, **kwargs):
        if self.ledger.tokens >= self.budget:
            control.should_training_stop = True


def run(seed: int, budget: int, arm: tuple, task=any_low, lr: float = 1e-2, group: int = 4,
        rounds: int = 4) -> tuple[list[float], int, Ledger]:
    filters, skip, arm_rounds = arm
    ledger = Ledger(task)
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as out:
        args = plait.GRPOConfig(
            output_dir=out, per_device_train_batch_size=16, num_generations=group, max_completion_length=4,
            learning_rate=lr, max_steps=10_000, logging_steps=1000, save_strategy="no", report_to="none",
            disable_tqdm=True, seed=seed, rollout_filters=filters,
            max_num_gen_batches=arm_rounds or rounds, skip_dropped_prompts=skip)
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
    parser.add_argument("--arms", nargs="+", default=["plain GRPO", "zero_variance"], choices=sorted(ARMS))
    parser.add_argument("--results", type=pathlib.Path, help="a JSON file to add each arm's curves to")
    cli = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    arms = {name: ARMS[name] for name in cli.arms}
    results = {}
    for name, arm in arms.items():
        curves, steps, ledgers = zip(*(run(seed, cli.tokens, arm, TASKS[cli.task], cli.lr, cli.group, cli.rounds)
                                       for seed in cli.seeds))
        results[name] = ([statistics.fmean(c[k] for c in curves) for k in range(WINDOWS)], steps, ledgers)
    print(f"mean reward of the completions generated in each eighth of {cli.tokens} tokens "
          f"(seeds {cli.seeds}; chance: {1 - (1 - LOW / 1000) ** 4:.3f} per completion if ids are uniform over 1000)")
    for name, (curve, steps, _) in results.items():
        print(f"{name:>20}: " + "  ".join(f"{r:.3f}" for r in curve) + f"   optimizer steps {list(steps)}")
    common = min(min(steps) for _, steps, _ in results.values())
    print(f"mean reward of the completions sampled in each quarter of the first {common} optimizer steps")
    for name, (_, _, ledgers) in results.items():
        print(f"{name:>20}: " + "  ".join(f"{r:.3f}" for r in by_step(list(ledgers), common)))
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
