"""Per-turn rewards on the tiny model: GRPO with turn-level credit against the same episodes scored at the end.

    .venv/bin/python benchmarks/per_turn_rewards.py [--seeds 0 1 2] [--steps 30]

The environment is ``env.quiz``: three questions asked one model turn at a time, each with a right
letter (A, B, C or D; a different one per turn). The model is the tiny one taught the format by a short
SFT on quiz conversations with random letters (:mod:`plait.testing.quiz_model`: each turn starts right
about a quarter of the time and ends with EOS). GRPO trains it, at equal optimizer steps and equal seeds, with

* ``end``: ``env.quiz`` with ``per_turn=False`` (reward = right turns / 3 at the end) and
  ``advantage.group``: every token of the episode shares one advantage;
* ``per_turn``: ``env.quiz`` with ``per_turn=True`` (1/3 per right turn, given at once) and
  ``advantage.turn_return`` (γ = 1): the tokens of turn k are credited with turns k, k+1, ...;
* ``per_turn_gae``: the same per-turn rewards with ``advantage.turn_gae`` (γ = 1, λ = 0.5).

GRPO: 32 episodes a step (4 prompts × 8), learning rate 5e-4, one thread.

Measured 2026-12-04 on the 2-core build machine (seeds 0-2, 48 steps, 241 s in all; docs/tools-and-environments.md
quotes it): mean return per quarter of the run
           end  0.282 0.286 0.363 0.384   (turn 3's accuracy 0.199 -> 0.256)
      per_turn  0.339 0.413 0.454 0.490   (turn 3's accuracy 0.277 -> 0.431)
  per_turn_gae  0.352 0.428 0.472 0.499
At learning rate 1e-3 (40 steps) one per-turn seed collapsed to a uniform distribution at its third step and
the end arm led on average (last quarter 0.516 against 0.378): the tiny model is fragile there.

Every arm's episodes earn the same return for the same answers (right turns / 3), which is the
curve recorded: the mean return of each rollout's episodes, per optimizer step, averaged over seeds.
Results go to benchmarks/results/per_turn_rewards.json. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import plait  # noqa: E402
from plait.manager import make_plugins  # noqa: E402
from plait.plugins.environments import quiz  # noqa: E402
from plait.testing.quiz_model import ANSWERS, quiz_model_path, quiz_row  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "per_turn_rewards.json"
ARMS = {
    "end": ({"name": "quiz", "per_turn": False}, "group"),
    "per_turn": ({"name": "quiz", "per_turn": True}, "turn_return"),
    "per_turn_gae": ({"name": "quiz", "per_turn": True}, {"name": "turn_gae", "lam": 0.5}),
}


class Judged(quiz.QuizEnvironment):
    """env.quiz that also notes each judged turn (turn, right) in ``LEDGER``: per-turn accuracy for every arm."""

    def step(self, text, calls):
        out = super().step(text, calls)
        LEDGER.append((self.turn, quiz.last_word(text) == self.answers[self.turn]))
        return out


LEDGER: list[tuple[int, bool]] = []


class JudgedPlugin:
    @plait.hookimpl
    def register_environments(self, register):
        register("env.judged_quiz", Judged, params=quiz.QuizParams, doc="env.quiz, noting each judged turn")


PLUGINS = make_plugins(plugins=[JudgedPlugin()])


def run(model: str, seed: int, steps: int, environment: dict, estimator) -> tuple[list[float], list[list[float]]]:
    """GRPO for ``steps`` optimizer steps: the mean episode return of each step's rollout, and each turn's
    accuracy per quarter of the run."""
    row = quiz_row()
    LEDGER.clear()
    with tempfile.TemporaryDirectory() as out:
        args = plait.GRPOConfig(
            output_dir=out, per_device_train_batch_size=32, num_generations=8, max_completion_length=96,
            learning_rate=5e-4, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, seed=seed, environment={**environment, "name": "judged_quiz"},
            advantage_estimator=estimator)
        trainer = plait.GRPOTrainer(model, args=args, train_dataset=[row] * 16, plugins=PLUGINS)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    # the end arm's reward is its return; a per-turn arm's return is logged as rewards/return/mean
    returns = [entry.get("rewards/return/mean", entry["reward"]) for entry in logs]
    size = len(LEDGER) // 4
    quarters = [LEDGER[q * size:(q + 1) * size] for q in range(4)]
    accuracy = [[statistics.fmean([right for t, right in part if t == k] or [math.nan]) for part in quarters]
                for k in range(len(ANSWERS))]
    return returns, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--arms", nargs="+", default=list(ARMS))
    cli = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    model = str(quiz_model_path())
    runs = {name: [run(model, seed, cli.steps, *ARMS[name]) for seed in cli.seeds] for name in cli.arms}
    curves = {name: [returns for returns, _ in arm] for name, arm in runs.items()}
    mean = {name: [statistics.fmean(c[k] for c in arm) for k in range(cli.steps)] for name, arm in curves.items()}
    accuracy = {name: [[statistics.fmean(acc[k][q] for _, acc in arm) for q in range(4)] for k in range(len(ANSWERS))]
                for name, arm in runs.items()}
    quarter = cli.steps // 4
    per_quarter = {name: [statistics.fmean(curve[q * quarter:(q + 1) * quarter]) for q in range(4)]
                   for name, curve in mean.items()}
    print(f"mean episode return (right turns / {len(ANSWERS)}) per optimizer step, seeds {cli.seeds}")
    for name, curve in mean.items():
        print(f"{name:>13}: " + " ".join(f"{r:.2f}" for r in curve))
        print(f"{'':>13}  per quarter: " + "  ".join(f"{r:.3f}" for r in per_quarter[name]))
        for k, turn in enumerate(accuracy[name]):
            print(f"{'':>13}  turn {k + 1} accuracy per quarter: " + "  ".join(f"{a:.3f}" for a in turn))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "what": "mean episode return (right turns / 3) of each GRPO step's rollout on env.quiz, tiny model",
        "seeds": cli.seeds, "steps": cli.steps, "arms": {name: {"environment": ARMS[name][0],
                                                               "advantage_estimator": ARMS[name][1]}
                                                        for name in cli.arms},
        "mean_curve": mean, "per_quarter": per_quarter, "turn_accuracy_per_quarter": accuracy, "curves": curves, "seconds": round(time.perf_counter() - started, 1),
        "date": time.strftime("%Y-%m-%d"), "threads": 1}, indent=1) + "\n")


if __name__ == "__main__":
    main()
