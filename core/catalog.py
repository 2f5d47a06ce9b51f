"""The catalog: what the installed plugins register, answered without importing them.

Asking the registry (``plait --help``, ``plait list <kind>``, ``plait plugins``) must be instant,
but a method plugin's module imports transformers' Trainer, peft and accelerate, and a loss
imports torch: seconds and hundreds of MB before a single name is printed. So the first time
plait sees a plugin, or after it changed, it imports the plugin as a run would and records
what it registered: each component's kind, name and summary, the plugin's hooks, distribution
and version. Later listings read the record and import nothing. Running anything still loads the
plugins themselves (:func:`plait.make_plugins`); the catalog only ever answers questions.

A record is keyed by the plugin's *signature*: its entry point, the distribution's name and
version, plait's version, Python's version, and the size and modification time of every Python
file in the folder of the entry point's module and in plait's core. Editing, adding or upgrading
a plugin changes its signature, and it is recorded afresh. What a listing cannot see: a plugin
whose registrations depend on files outside its own folder, or on the environment; such a plugin
should decide what it registers in its own folder. Built-ins and third-party plugins are recorded
the same way; nothing else is asked of a plugin's author.

The records live in one JSON file, ``catalog.json`` in plait's cache folder
(:func:`plait.paths.cache_dir`), written atomically; an unreadable or unwritable cache only
means the next listing imports the plugins again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Any, Iterable

import attrs

from .manager import (
    KINDS,
    Disabled,
    PluginInfo,
    Plugins,
    _env_flag,
    import_error_policy,
    make_plugins,
    select_entry_points,
)
from .paths import cache_dir, write_atomically
from .registry import Component, Registry

FORMAT = 1  # bump when a record's layout changes


def cache_file() -> Path:
    return cache_dir("catalog.json")


def signature(ep: importlib.metadata.EntryPoint) -> str | None:
    """What a plugin's registrations depend on, hashed; None when its files cannot be found."""
    try:
        spec = importlib.util.find_spec(ep.module)
    except Exception:  # noqa: BLE001 - a parent package that fails to import: the full load will say why
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    from . import __version__

    dist = (ep.dist.name, ep.dist.version) if ep.dist else None
    key = [FORMAT, __version__, platform.python_version(), ep.name, ep.value, dist,
           _python_files(os.path.dirname(spec.origin)), _python_files(os.path.dirname(__file__))]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _python_files(folder: str) -> list:
    """Name, size and mtime of every .py file in ``folder`` (plait's own core counts for every plugin:
    how a registration is recorded can change with it in a development checkout)."""
    return sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                  for entry in os.scandir(folder) if entry.name.endswith(".py") and entry.is_file())


def record_of(plugins: Plugins, plugin_name: str) -> dict[str, Any]:
    """What one loaded plugin registered, as JSON."""
    return {
        "info": attrs.asdict(plugins.info(plugin_name)),
        "hooks": plugins.hooks_of(plugin_name),
        "components": {kind: [[c.name, c.summary] for c in plugins.registries[kind] if c.plugin == plugin_name]
                       for kind in KINDS},
    }


class Catalog:
    """The listing side of :class:`plait.manager.Plugins`, rebuilt from records.

    It has the same ``registries``, ``distributions()`` and ``hooks_of()`` the introspection
    commands use; its components carry summaries, not objects.
    """

    def __init__(self, records: Iterable[dict[str, Any]], disabled: dict[str, Disabled]):
        self.infos: dict[str, PluginInfo] = {}
        self._hooks: dict[str, list[str]] = {}
        self.disabled = disabled
        self.registries = {name: Registry(kind.singular) for name, kind in KINDS.items()}
        for record in records:
            info = PluginInfo(**record["info"])
            self.infos[info.name] = info
            self._hooks[info.name] = record["hooks"]
            for kind, entries in record["components"].items():
                for name, summary in entries:
                    self.registries[kind].add(Component(kind=kind, name=name, obj=None, doc=summary, plugin=info.name,
                                                        distribution=info.distribution, version=info.version))

    def __getattr__(self, kind: str) -> Registry:
        if kind in KINDS:
            return self.registries[kind]
        raise AttributeError(kind)

    def distributions(self) -> list[PluginInfo]:
        return list(self.infos.values())

    def hooks_of(self, plugin_name: str) -> list[str]:
        return self._hooks.get(plugin_name, [])


def load_catalog(*, disable: Iterable[str] = (), on_import_error: str | None = None) -> Catalog | Plugins:
    """The registry for listing: from the records when every plugin has a current one, else from a
    full :func:`make_plugins` load, whose plugins are then recorded for the next time. ``on_import_error``:
    as :func:`make_plugins`'s (the listing commands pass "warn": one broken plugin must not hide the others)."""
    import_error_policy()  # a bad switch is an error whether or not anything gets imported
    if _env_flag("PLAIT_DISABLE_PLUGIN_AUTOLOAD") or _env_flag("PLAIT_TRACE_HOOKS"):
        # nothing to record, or the user wants to watch the hooks run
        return make_plugins(disable=disable, on_import_error=on_import_error)
    chosen, disabled = select_entry_points(disable)
    signatures = {ep.name: signature(ep) for ep in chosen}
    stored = _read()
    records = [stored.get(sig) for sig in signatures.values() if sig]
    if len(records) == len(chosen) and all(records):
        return Catalog(records, disabled)
    plugins = make_plugins(disable=disable, on_import_error=on_import_error)  # a broken plugin gets no record
    fresh = {signatures[name]: record_of(plugins, name) for name in plugins.infos if signatures.get(name)}
    current = set(signatures.values())  # records of replaced versions go
    _write({sig: record for sig, record in {**stored, **fresh}.items() if sig in current})
    return plugins


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_file().read_text())
        return data["records"] if data.get("format") == FORMAT else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write(records: dict[str, Any]) -> None:
    """Atomically: a listing racing another never reads half a file."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"format": FORMAT, "records": records}))
    except OSError:
        pass  # a read-only home only costs the next listing its speed
