"""Shared by the benchmarks: time a plait Trainer's optimizer steps on one fixed collated batch; time variants
of one piece of work against each other."""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

Variant = TypeVar("Variant")


def alternated_seconds(variants: dict[str, Variant], step: Callable[[Variant], float], repeats: int) -> dict[str, list[float]]:
    """Each variant's ``step(variant)`` seconds: one warm-up call each, then ``repeats`` rounds taking the variants in
    turn, so load that comes and goes on a shared machine hits them alike. Each round starts one variant further on
    (a, b, c; b, c, a; c, a, b; ...), so none always follows the same one: in a fixed order a DPO step's baseline,
    always run after its own twin, measured 3.4% slower than that twin (2026-12-06)."""
    for variant in variants.values():
        step(variant)
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            times[name].append(step(variants[name]))
    return times


def seconds_per_step(trainer, fixed_batch: dict, batch_size: int, steps: int) -> float:
    """Train ``steps + 1`` optimizer steps on ``fixed_batch`` every time (no data loading or collation
    in the timing); the first step is warm-up, the mean of the rest is returned."""
    from datasets import Dataset
    from transformers import TrainerCallback

    trainer.train_dataset = Dataset.from_list([{"row": i} for i in range(batch_size * (steps + 1))])
    trainer.data_collator = lambda _rows: fixed_batch
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.train()
    return (times[-1] - times[0]) / (len(times) - 1)


def round_ratios(times: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Each variant's median, over rounds, of its seconds over ``baseline``'s in the same round. Give the
    baseline a twin among the variants (the same work under another name): its ratio is the noise floor of the
    run, which a variant's ratio must clear to mean anything (on a shared 2-core machine, 2026-12-06, ten rounds
    of two identical variants came out 0.979)."""
    return {name: statistics.median(mine / theirs for mine, theirs in zip(seconds, times[baseline]))
            for name, seconds in times.items() if name != baseline}
