"""Objects named by import path (``pkg.module:attr`` or ``pkg.module.attr``), as recipes, command
lines and configs name a user's functions: tools, rewards, a rollout function, a ``context_fn``.
One reading of the path, one error per failure naming the field, the path and what went wrong.

A user names a module of the working directory (``--reward_funcs my_rewards.fn`` beside ``my_rewards.py``)
as TRL users do, but the ``plait`` console script and ``PYTHONSAFEPATH`` keep the working directory off
``sys.path``. So a path is resolved with the working directory searched first, for that lookup only: plugins
and relaunched workers import with the safe path, and only a module the user named comes from the working
directory."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from typing import Any, Iterator

from .errors import PlaitError


@contextlib.contextmanager
def working_directory_first() -> Iterator[None]:
    """``sys.path`` with the working directory at its front while a user-named module is found and imported."""
    cwd = os.getcwd()
    if sys.path[:1] in ([cwd], [""]):  # `python -m`, `python -c`: already searched first
        yield
        return
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


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
    with working_directory_first():
        if not _module_exists(module_name):
            if missing_ok and not sep:
                return None
            raise PlaitError(f"{field} {path!r}: no module {module_name!r} can be imported from the working directory "
                             f"({os.getcwd()}) or the installed packages; check the path 'pkg.module:func'")
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
