"""The run's folder: what a run records there, which checkpoints in it are complete, and whether a
new run may write into it. Checked from every method Config's ``__post_init__`` and the trainer,
each failure one :class:`~plait.errors.PlaitError` line naming the field, the value and the fix."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from plait.data.preflight import CHECKPOINT, WEIGHT_PATTERNS, checkpoint_step
from plait.errors import PlaitError

from .redact import is_secret_name, masked

RUN_METADATA = "plait_run.json"  # written by PlaitTrainer next to every saved model and checkpoint


TRAINER_STATE = "trainer_state.json"  # transformers writes it last into a checkpoint


# Fields that may differ when the same run is resumed or rerun (also from a moved folder).
RESTART_FIELDS = ("resume_from_checkpoint", "overwrite_output_dir", "output_dir")


# True while `plait <method>` runs: a setting is then named as its flag (--overwrite_output_dir), which the
# command line and a recipe both accept, rather than as a recipe key
_ON_COMMAND_LINE = contextvars.ContextVar("plait_on_command_line", default=False)


@contextlib.contextmanager
def on_command_line():
    """Within it the run folder's errors name settings as command-line flags."""
    token = _ON_COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _ON_COMMAND_LINE.reset(token)


def setting(name: str, value: str) -> str:
    """How the user sets ``name`` to ``value``: ``--name value`` on the command line, ``name: value`` in YAML."""
    if _ON_COMMAND_LINE.get():
        return f"--{name}" if value == "true" else f"--{name} {value}"
    return f"{name}: {value}"


def _number(args, name: str, description: str, ok) -> None:
    value = getattr(args, name, None)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise PlaitError(f"{name}={value!r} must be {description}; fix the value")


def training_numbers(args) -> None:
    """TrainingArguments numbers transformers accepts but that train nothing, or train wrongly."""
    _number(args, "per_device_train_batch_size", "an integer >= 1", lambda v: v >= 1 and v == int(v))
    _number(args, "per_device_eval_batch_size", "an integer >= 1", lambda v: v >= 1 and v == int(v))
    _number(args, "gradient_accumulation_steps", "an integer >= 1", lambda v: v >= 1 and v == int(v))
    _number(args, "learning_rate", "a finite number > 0 (e.g. 1e-5)", lambda v: v > 0)
    _number(args, "num_train_epochs", "a finite number >= 0", lambda v: v >= 0)
    _number(args, "max_steps", "a positive number of optimizer steps, or -1 to train num_train_epochs",
            lambda v: v > 0 or v == -1)
    if getattr(args, "max_steps", -1) == -1:
        _number(args, "num_train_epochs", "> 0 when max_steps is -1 (else nothing trains); or set max_steps",
                lambda v: v > 0)
    _number(args, "weight_decay", "a finite number >= 0", lambda v: v >= 0)
    _number(args, "max_grad_norm", "a finite number >= 0 (0 turns clipping off)", lambda v: v >= 0)
    _number(args, "adam_beta1", "in [0, 1)", lambda v: 0 <= v < 1)
    _number(args, "adam_beta2", "in [0, 1)", lambda v: 0 <= v < 1)
    _number(args, "adam_epsilon", "a finite number > 0", lambda v: v > 0)
    _number(args, "save_steps", "> 0 (a step count, or a fraction of the run below 1)", lambda v: v > 0)
    _number(args, "eval_steps", "> 0 (a step count, or a fraction of the run below 1)", lambda v: v > 0)
    _number(args, "dataloader_num_workers", "an integer >= 0", lambda v: v >= 0 and v == int(v))


def is_complete_checkpoint(folder: str | os.PathLike) -> bool:
    """A checkpoint whose save finished: transformers' trainer state and plait's run metadata
    (written last, before the staging folder is renamed into place) are both there and readable."""
    folder = Path(folder)
    try:
        json.loads((folder / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return False
    return (folder / RUN_METADATA).is_file()


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """``checkpoint-N`` folders directly in ``output_dir``, oldest first (``.staging`` is not one)."""
    if not os.path.isdir(output_dir):
        return []
    found = [p for p in Path(output_dir).iterdir() if p.is_dir() and CHECKPOINT.match(p.name)]
    return sorted(found, key=lambda p: checkpoint_step(p.name))


def latest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete checkpoint in ``output_dir`` (half-written ones are skipped)."""
    complete = [p for p in checkpoints(output_dir) if is_complete_checkpoint(p)]
    return str(complete[-1]) if complete else None


def resume_checkpoint(value: Any, output_dir: str | None) -> str | None:
    """``resume_from_checkpoint`` as a checkpoint folder: True or 'latest' pick the newest complete
    checkpoint in ``output_dir``; a path must be a complete checkpoint; None/False: no resume."""
    if value is None or value is False or value == "":
        return None
    if value is True or (isinstance(value, str) and value.lower() == "latest"):
        found = latest_checkpoint(output_dir) if output_dir else None
        if found is None:
            partial = [p.name for p in checkpoints(output_dir)] if output_dir else []
            seen = f"only incomplete ones: {', '.join(partial)}" if partial else "none"
            raise PlaitError(f"resume_from_checkpoint={value!r}: output_dir {output_dir!r} holds no complete "
                             f"checkpoint ({seen}); drop resume_from_checkpoint to start fresh, or pass a checkpoint folder")
        return found
    if not isinstance(value, str):
        raise PlaitError(f"resume_from_checkpoint={value!r} must be a checkpoint folder, true or 'latest'")
    if not os.path.isdir(value):
        raise PlaitError(f"resume_from_checkpoint={value!r}: no such folder; pass a checkpoint-N folder, or "
                         "'latest' for the newest one in output_dir")
    if not is_complete_checkpoint(value):
        raise PlaitError(f"resume_from_checkpoint={value!r} is not a complete checkpoint (no readable "
                         f"{TRAINER_STATE} and {RUN_METADATA}; its save was interrupted); pass an older checkpoint, "
                         "or 'latest' for the newest complete one")
    return value


def output_dir(args, method: str) -> None:
    """``output_dir`` is a folder that is new, empty of models, or holds this same run; another
    run's model or checkpoints are refused unless the run resumes or ``overwrite_output_dir`` is set."""
    out = getattr(args, "output_dir", None)
    if not out:
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise PlaitError(f"output_dir={out!r} is a file; pass a folder (it is created if missing)")
    resume = getattr(args, "resume_from_checkpoint", None)
    if resume:
        theirs = _metadata(Path(resume) / RUN_METADATA)
        if theirs is not None and theirs.get("method") != method:
            raise PlaitError(f"resume_from_checkpoint={resume!r} is a checkpoint of a {theirs.get('method')} run, "
                             f"not {method}; resume it with 'plait {theirs.get('method')}', or start fresh")
        return
    if not os.path.isdir(out) or getattr(args, "overwrite_output_dir", False):
        return
    verb, other = ("pass", "--output_dir") if _ON_COMMAND_LINE.get() else ("set", "output_dir")
    remedy = f"{verb} {setting('overwrite_output_dir', 'true')} to train over it, or pick another {other}"
    found = checkpoints(out)
    if found:
        names = ", ".join(p.name for p in found[-3:])
        raise PlaitError(f"output_dir={out!r} holds checkpoints of an earlier run ({names}); resume it with "
                         f"{setting('resume_from_checkpoint', 'latest')}, {remedy}")
    metadata_path = Path(out) / RUN_METADATA
    if metadata_path.exists():
        theirs = _metadata(metadata_path) or {}
        if theirs.get("method") != method:
            raise PlaitError(f"output_dir={out!r} holds the model of a {theirs.get('method', 'different')} run; {remedy}")
        # masked on both sides (a file older than the masking holds clear values), so the message shows
        # no secret; a credential added, rotated or dropped between the two runs leaves them the same run
        mine = masked({k: json_value(getattr(args, k)) for k in config_fields(type(args))})
        stored = masked(theirs.get("config") or {})
        changed = [k for k in mine if k not in RESTART_FIELDS and not is_secret_name(k) and k in stored
                   and stored[k] != mine[k]]
        if changed:
            k = changed[0]
            raise PlaitError(f"output_dir={out!r} holds the model of another {method} run ({k}={stored[k]!r} there, "
                             f"{mine[k]!r} here); {remedy}")
        return
    models = sorted(p.name for p in Path(out).iterdir() if p.name in ("config.json", "adapter_config.json")
                    or any(p.match(pattern) for pattern in WEIGHT_PATTERNS))
    if models:
        raise PlaitError(f"output_dir={out!r} holds a model that no plait run wrote ({', '.join(models[:3])}); "
                         f"training would overwrite it; {remedy}")


def _metadata(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def serialisable(value: Any) -> Any:
    """A config value as the logs, model cards and JSON see it: functions and classes given in Python
    (GRPO's tools, a reward function) by their import path ``module:name``, as a recipe names them."""
    if isinstance(value, (list, tuple)):
        return [serialisable(v) for v in value]
    if isinstance(value, dict):
        return {k: serialisable(v) for k, v in value.items()}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}:{value.__qualname__}"
    return value


def json_value(value: Any) -> Any:
    """A config value as ``plait_run.json`` records it and a rerun compares it: callables by import path
    (:func:`_serialisable`), anything else JSON cannot hold by ``str``."""
    return json.loads(json.dumps(serialisable(value), default=str))


def config_fields(config_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(config_cls) if f.init}
