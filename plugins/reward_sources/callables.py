"""Reward functions given as Python callables or as import paths (``pkg.module:func``).

Answers ``resolve_reward`` for two kinds of ``reward_funcs`` entries that are not registered
names: any callable (a function, an ``async def``, an object with ``__call__``; torch modules
are left to the reward-model source) and a string naming one, as ``pkg.module:attr`` or
``pkg.module.attr``. A dotted string whose module cannot be found is not claimed, so a
misspelt registered name still gets a did-you-mean answer.
"""

from __future__ import annotations

from typing import Any

from plait import hookimpl
from plait.errors import PlaitError
from plait.import_paths import import_path


def import_reward(path: str) -> Any:
    """The callable at ``pkg.module:attr`` / ``pkg.module.attr``; None when a dotted path names no module."""
    obj = import_path(path, "reward", missing_ok=True)
    if obj is not None and (isinstance(obj, type) or not callable(obj)):
        raise PlaitError(
            f"reward {path!r} is {type(obj).__name__} {obj!r:.60}, not a reward function; point it at a "
            "function or a callable object"
        )
    return obj


@hookimpl
def resolve_reward(spec, processing_class):
    if isinstance(spec, str):
        return import_reward(spec) if ("." in spec or ":" in spec) and "/" not in spec else None
    import torch

    if callable(spec) and not isinstance(spec, (type, torch.nn.Module)):
        return spec
    return None
