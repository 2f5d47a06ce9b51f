"""Shared by the benchmarks: time a plait Trainer's optimizer steps on one fixed collated batch."""

from __future__ import annotations

import time


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
