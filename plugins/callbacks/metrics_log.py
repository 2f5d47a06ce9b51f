"""Every run's metrics as JSON lines: ``metrics.jsonl`` in the output folder, one object per log
(``step``, ``epoch`` and the logged values), for ``plait report`` and for any reader of a run that is
still going or that crashed.

Only the main process writes. Each log is one ``write`` of one whole line to a file opened for
appending, so a crash leaves the lines written so far and at most a cut last line (the reader skips
it). A run resumed from a checkpoint keeps the lines up to the checkpoint's step and drops those
logged after it, which the resumed run logs again; a fresh run starts the file anew.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator

from transformers import TrainerCallback

from plait import hookimpl
from plait.paths import write_atomically

METRICS_FILE = "metrics.jsonl"


def read_metrics(output_dir: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The records of ``output_dir``'s metrics file, in order; a line cut by a crash is skipped."""
    try:
        with open(os.path.join(output_dir, METRICS_FILE), encoding="utf-8") as handle:
            lines = handle.readlines()
    except FileNotFoundError:
        return
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


def _value(value: Any) -> Any:
    """A logged value as JSON holds it: numbers (a non-finite one as its name, which JSON has no literal for)
    and text; anything else by ``str``."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else str(value)
    item = getattr(value, "item", None)  # a 0-d tensor or numpy number
    return _value(item()) if callable(item) else str(value)


class MetricsLog(TrainerCallback):
    """Appends each ``on_log`` to ``<output_dir>/metrics.jsonl`` (see the module docstring)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not args.output_dir:
            return
        # resumed at step N: the lines up to N are this run's history; fresh (N = 0): none are
        kept = [record for record in read_metrics(args.output_dir) if record.get("step", 0) <= state.global_step] \
            if state.global_step > 0 else []
        os.makedirs(args.output_dir, exist_ok=True)
        write_atomically(os.path.join(args.output_dir, METRICS_FILE),
                         "".join(json.dumps(record) + "\n" for record in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or not args.output_dir:
            return
        record = {"step": state.global_step, "epoch": state.epoch, **{k: _value(v) for k, v in logs.items()}}
        line = (json.dumps(record) + "\n").encode("utf-8")
        os.makedirs(args.output_dir, exist_ok=True)
        descriptor = os.open(os.path.join(args.output_dir, METRICS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(descriptor, line)  # one write of one line: whole, or cut at the end by a crash
        finally:
            os.close(descriptor)


@hookimpl
def trainer_callbacks(method, args):
    """Every method's runs write ``metrics.jsonl``."""
    return [MetricsLog()]
