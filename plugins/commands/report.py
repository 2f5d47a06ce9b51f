"""``plait report OUTPUT_DIR``: a run's curves at a glance. Reads the ``metrics.jsonl`` every run
writes (:mod:`plait.plugins.callbacks.metrics_log`), prints a short summary (steps; the training loss
first, last and lowest; the last value of each key metric the method logs) and draws the loss and those
metrics against the step into ``report.png`` in the same folder, with matplotlib when it is installed."""

from __future__ import annotations

import argparse
import math
import os

from plait import hookimpl
from plait.cli import Command
from plait.errors import PlaitError
from plait.plugins.callbacks.metrics_log import METRICS_FILE, read_metrics

# what a method's progress shows in, beside the loss, drawn when the run logged it: the preference margin
# and accuracy (DPO family, reward models), the mean reward (GRPO family, online DPO), the KL to the
# reference (online methods; PPO's objective/kl), and the learning-rate schedule
KEY_METRICS = ("rewards/margins", "rewards/accuracies", "reward", "objective/rlhf_reward", "kl", "objective/kl",
               "learning_rate")
REPORT_FILE = "report.png"


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` among training logs (evaluation logs carry eval_*)."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    return [step for step, _ in points], [float(value) for _, value in points]


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def loss_key(records: list[dict]) -> str:
    """``loss`` as logged every ``logging_steps``; a run shorter than that logged only its ``train_loss``."""
    return "loss" if series(records, "loss")[0] else "train_loss"


def summary(records: list[dict], keys: list[str]) -> list[str]:
    steps, losses = series(records, loss_key(records))
    last_step = max((r.get("step", 0) for r in records), default=0)
    lines = [f"steps: {last_step} ({len(records)} logs)"]
    if losses:
        low = min(range(len(losses)), key=losses.__getitem__)
        lines.append(f"{loss_key(records)}: first {_number(losses[0])} (step {steps[0]}), last {_number(losses[-1])} "
                     f"(step {steps[-1]}), min {_number(losses[low])} (step {steps[low]})")
    for key in keys:
        key_steps, values = series(records, key)
        lines.append(f"{key}: last {_number(values[-1])} (step {key_steps[-1]})")
    return lines


def draw(records: list[dict], keys: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    panels = [loss_key(records), *keys]
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, squeeze=False)
    for axis, key in zip(axes[:, 0], panels):
        steps, values = series(records, key)
        axis.plot(steps, values, marker="." if len(steps) < 50 else None)
        evaluated = series(records, f"eval_{key}")
        if evaluated[0]:
            axis.plot(*evaluated, marker="o", linestyle="--", label=f"eval_{key}")
            axis.legend()
        axis.set_ylabel(key)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(os.path.basename(os.path.dirname(path)) or path)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run(args: argparse.Namespace, plugins) -> int:
    folder = args.output_dir
    if not os.path.isdir(folder):
        raise PlaitError(f"plait report {folder!r}: no such folder; pass a run's output_dir")
    records = list(read_metrics(folder))
    if not records:
        raise PlaitError(f"plait report {folder!r}: no {METRICS_FILE} there (every run writes one into its "
                         "output_dir); pass the output_dir of a run")
    keys = [key for key in KEY_METRICS if series(records, key)[0]]
    print("\n".join(summary(records, keys)))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"plait: no plot drawn: matplotlib is not installed; pip install matplotlib (or pip install "
              f"'plait[demo]') and run plait report {folder} again")
        return 0
    path = os.path.join(folder, REPORT_FILE)
    draw(records, keys, path)
    print(f"plot: {path}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="a run's output_dir (it holds metrics.jsonl)")


@hookimpl
def register_commands(register):
    register("command.report", Command(run=run, add_arguments=add_arguments,
                                       help="summarise a run and draw its loss and key metrics (OUTPUT_DIR/report.png)"))
