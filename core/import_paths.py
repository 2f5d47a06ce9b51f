"""Objects named by import path (``pkg.module:attr`` or ``pkg.module.attr``), as recipes, command
lines and configs name a user's functions: tools, rewards, a rollout function, a ``context_fn``.
One reading of the path, one error per failure naming the field, the path and what went wrong."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .errors import PlaitError


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or an empty name
        return False


def import_path(path: str, field: str, *, missing_ok: bool = False) -> Any:
    """The object at ``path``. With ``missing_ok``, None when a dotted path (no ``:``) names no
    module (the string may mean something else to the caller, e.g. a registered name)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        if missing_ok and not sep:
            return None
        raise PlaitError(f"{field} {path!r} is not an import path; write 'pkg.module:func'")
    if not _module_exists(module_name):
        if missing_ok and not sep:
            return None
        raise PlaitError(f"{field} {path!r}: no module {module_name!r} can be imported; check the path 'pkg.module:func'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - the user's module failed; say which
        raise PlaitError(f"{field} {path!r}: importing {module_name!r} failed ({type(err).__name__}: {err})") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlaitError(f"{field} {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def import_object(spec: Any, field: str) -> Any:
    """``spec`` itself, or the object an import path names."""
    return import_path(spec, field) if isinstance(spec, str) else spec
