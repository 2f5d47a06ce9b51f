"""The plugin manager factory: entry-point discovery, blocking, tracing, registries.

``make_plugins()`` builds a fresh, independent :class:`Plugins` every call (tests use one per
test); ``default_plugins()`` caches one per process for the public API. Nothing in plait keeps
a module-level manager that anyone mutates.

Environment switches (each also a field of the run config's ``plugins:`` section):

* ``PLAIT_DISABLE_PLUGINS=name,other``: skip these entry points (or whole distributions).
* ``PLAIT_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points at all; register plugins by hand.
* ``PLAIT_ON_PLUGIN_ERROR=skip``: warn about a plugin that fails to import instead of failing.
* ``PLAIT_TRACE_HOOKS=1``: print every hook call and the plugin that answered, to stderr.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
from typing import Any, Iterable

import attrs
import pluggy

from . import hookspecs
from .errors import PluginLoadError
from .registry import Registry, register_callback

logger = logging.getLogger("plait")

ENTRY_POINT_GROUP = hookspecs.PROJECT
# registration hook suffix -> what one entry is called in messages
KINDS = {
    "methods": "method", "losses": "loss", "rewards": "reward",
    "advantage_estimators": "advantage estimator", "generation_backends": "generation backend",
    "data_formats": "data format", "collators": "collator", "packing_strategies": "packing strategy", "judges": "judge", "commands": "command",
}


@attrs.frozen
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str


def _env_list(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


class Plugins:
    """A pluggy manager plus the registries its plugins filled."""

    def __init__(self, pm: pluggy.PluginManager, infos: dict[str, PluginInfo], trace: bool):
        self.pm = pm
        self.hook = pm.hook
        self.infos = infos
        self.trace = trace
        self._registries: dict[str, Registry] | None = None

    # -- registries ---------------------------------------------------------------------------
    @property
    def registries(self) -> dict[str, Registry]:
        if self._registries is None:
            self._registries = self._collect()
        return self._registries

    def __getattr__(self, kind: str) -> Registry:
        # plugins.losses, plugins.methods, ... (only called for names not found normally)
        if kind in KINDS:
            return self.registries[kind]
        raise AttributeError(kind)

    def _collect(self) -> dict[str, Registry]:
        registries = {kind: Registry(singular) for kind, singular in KINDS.items()}
        for kind in KINDS:
            hook = getattr(self.pm.hook, f"register_{kind}")
            for impl in hook.get_hookimpls():  # registration order (pluggy calls them in reverse)
                info = self.info(impl.plugin_name)
                if self.trace:
                    print(f"[plait trace] register_{kind} -> {impl.plugin_name}", file=sys.stderr)
                register = register_callback(registries[kind], impl.plugin_name, info.distribution, info.version)
                impl.function(*[{"register": register}[arg] for arg in impl.argnames])
        return registries

    def info(self, plugin_name: str) -> PluginInfo:
        return self.infos.get(plugin_name) or PluginInfo(plugin_name, "(not installed)", "-", plugin_name)

    # -- registering by hand (tests, notebooks) -----------------------------------------------
    def register(self, plugin: Any, name: str | None = None) -> None:
        self.pm.register(plugin, name=name)
        self.pm.check_pending()
        self._registries = None

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._registries = None

    def hooks_of(self, plugin_name: str) -> list[str]:
        plugin = self.pm.get_plugin(plugin_name)
        return sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or [])

    def distributions(self) -> list[PluginInfo]:
        return [self.info(name) for name, _ in self.pm.list_name_plugin()]


def make_plugins(
    *,
    disable: Iterable[str] = (),
    autoload: bool | None = None,
    on_import_error: str | None = None,
    plugins: Iterable[Any] = (),
    trace: bool | None = None,
) -> Plugins:
    """Build a fresh plugin manager: load entry points, register ``plugins``, validate hooks.

    ``disable``, ``autoload`` and ``on_import_error`` ("fail" or "skip") add to / override the
    environment switches documented in this module's docstring.
    """
    blocked = set(disable) | set(_env_list("PLAIT_DISABLE_PLUGINS"))
    if autoload is None:
        autoload = not _env_flag("PLAIT_DISABLE_PLUGIN_AUTOLOAD")
    on_import_error = on_import_error or os.environ.get("PLAIT_ON_PLUGIN_ERROR", "fail")
    if on_import_error not in ("fail", "skip"):
        raise PluginLoadError(
            f"plugins.on_import_error={on_import_error!r} is not valid; use 'fail' or 'skip'"
        )
    trace = _env_flag("PLAIT_TRACE_HOOKS") if trace is None else trace

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if trace:
        pm.trace.root.setwriter(lambda line: print(f"[plait trace] {line}", end="", file=sys.stderr))
        pm.enable_tracing()

    infos: dict[str, PluginInfo] = {}
    if autoload:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist else "(unknown distribution)"
            version = ep.dist.version if ep.dist else "?"
            if ep.name in blocked or dist in blocked:
                continue
            if ep.name in infos and infos[ep.name].module != ep.value:
                raise PluginLoadError(
                    f"two plugins are named {ep.name!r}: {infos[ep.name].module!r} ({infos[ep.name].distribution}) "
                    f"and {ep.value!r} ({dist}); uninstall one or block it with PLAIT_DISABLE_PLUGINS"
                )
            if ep.name in infos:  # the same distribution seen twice on sys.path
                continue
            try:
                module = ep.load()
                pm.register(module, name=ep.name)
            except Exception as err:  # noqa: BLE001 - any import failure is reported the same way
                message = (
                    f"plait plugin {ep.name!r} (entry point {ep.value!r}, distribution {dist} {version}) "
                    f"failed to load: {type(err).__name__}: {err}; fix or uninstall it, block it with "
                    f"PLAIT_DISABLE_PLUGINS={ep.name}, or set PLAIT_ON_PLUGIN_ERROR=skip"
                )
                if on_import_error == "fail":
                    raise PluginLoadError(message) from err
                logger.warning(message)
                continue
            infos[ep.name] = PluginInfo(ep.name, dist, version, ep.value)
    for plugin in plugins:
        pm.register(plugin)
    pm.check_pending()  # a misspelt hook name fails here, naming the plugin and the hook
    return Plugins(pm, infos, trace)


@functools.lru_cache(maxsize=1)
def default_plugins() -> Plugins:
    """The process-wide plugins used when an API call is not given ``plugins=``."""
    return make_plugins()
