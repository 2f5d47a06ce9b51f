"""Reward functions given as Python callables or as import paths (``pkg.module:func``).

Answers ``resolve_reward`` for two kinds of ``reward_funcs`` entries that are not registered
names: any callable (a function, an ``async def``, an object with ``__call__``; torch modules
are left to the reward-model source) and a string naming one, as ``pkg.module:attr`` or
``pkg.module.attr``. A dotted string whose module cannot be found is not claimed, so a
misspelt registered name still gets a did-you-mean answer.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from plait import hookimpl
from plait.errors import PlaitError


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or an empty name
        return False


def import_reward(path: str) -> Any:
    """The callable at ``pkg.module:attr`` / ``pkg.module.attr``; None when the module is not found."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr or not _module_exists(module_name):
        if sep:
            raise PlaitError(f"reward {path!r}: no module {module_name!r} can be imported; check the path 'pkg.module:func'")
        return None
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - the user's module failed; say which
        raise PlaitError(f"reward {path!r}: importing {module_name!r} failed ({type(err).__name__}: {err})") from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlaitError(f"reward {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type) or not callable(obj):
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
