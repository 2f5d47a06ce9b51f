"""The plugin manager factory: entry-point discovery, blocking, tracing, registries.

``make_plugins()`` builds a fresh, independent :class:`Plugins` every call (tests use one per
test); ``default_plugins()`` caches one per process for the public API. Nothing in plait keeps
a module-level manager that anyone mutates.

Environment switches (each also a field of the run config's ``plugins:`` section):

* ``PLAIT_DISABLE_PLUGINS=name,other``: skip these entry points (or whole distributions). A name
  that no installed plugin has is warned about (did you mean ...?); looking up a component of a
  disabled plugin says which plugin it is and what disabled it.
* ``PLAIT_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points at all; register plugins by hand.
* ``PLAIT_ON_PLUGIN_ERROR=skip``: warn about a plugin that fails to import instead of failing
  (any exception counts, SystemExit included; only KeyboardInterrupt goes through).
* ``PLAIT_TRACE_HOOKS=1``: print every hook call and the plugin that answered, to stderr.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import inspect
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
KINDS = hookspecs.kinds()  # registration hook suffix ("losses") -> its Kind, from the hookspecs


@attrs.frozen
class PluginInfo:
    name: str
    distribution: str
    version: str
    module: str


@attrs.frozen
class Disabled:
    """An entry point left unloaded, and what the user should change to load it."""

    entry_point: importlib.metadata.EntryPoint
    by: str  # the switch that disabled it, as the user wrote it
    fix: str


def _env_list(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


class Plugins:
    """A pluggy manager plus the registries its plugins filled."""

    def __init__(self, pm: pluggy.PluginManager, infos: dict[str, PluginInfo], trace: bool,
                 disabled: dict[str, Disabled] | None = None, autoload_off_by: str | None = None):
        self.pm = pm
        self.hook = pm.hook
        self.infos = infos
        self.trace = trace
        self.disabled = disabled or {}  # entry-point name -> why it was not loaded
        self.autoload_off_by = autoload_off_by  # the switch that turned entry-point loading off, if one did
        self._registries: dict[str, Registry] | None = None
        self._disabled_names: dict[tuple[str, str], set[str]] = {}

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
        note = (f"plugin autoload is off ({self.autoload_off_by}), so no installed plugin was loaded"
                if self.autoload_off_by else "")
        registries = {name: Registry(kind.singular, functools.partial(self.why_disabled, name), note)
                      for name, kind in KINDS.items()}
        for kind in KINDS:
            hook = getattr(self.pm.hook, f"register_{kind}")
            for impl in hook.get_hookimpls():  # registration order (pluggy calls them in reverse)
                info = self.info(impl.plugin_name)
                if self.trace:
                    print(f"[plait trace] register_{kind} -> {impl.plugin_name}", file=sys.stderr)
                register = register_callback(registries[kind], impl.plugin_name, info.distribution, info.version,
                                             info.module)
                impl.function(*[{"register": register}[arg] for arg in impl.argnames])
        return registries

    def why_disabled(self, kind: str, names: list[str]) -> str | None:
        """When a disabled plugin registers one of ``names``: which one, and what disabled it."""
        for ep_name, disabled in self.disabled.items():
            found = [name for name in names if name in self._registered_by(disabled.entry_point, kind)]
            if found:
                ep = disabled.entry_point
                dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
                return (f"{KINDS[kind].singular} {found[0]!r} comes from plugin {ep_name!r} ({dist}), which is disabled by "
                        f"{disabled.by}; {disabled.fix}")
        return None

    def _registered_by(self, ep: importlib.metadata.EntryPoint, kind: str) -> set[str]:
        """Names a disabled plugin would register (imported only now, to explain a failed lookup)."""
        key = (ep.name, kind)
        if key not in self._disabled_names:
            names: set[str] = set()
            try:
                hook = getattr(ep.load(), f"register_{kind}", None)
                if hook is not None and hasattr(hook, f"{hookspecs.PROJECT}_impl"):
                    collect = lambda name, obj=None, **options: names.add(name)  # noqa: E731
                    hook(**{arg: collect for arg in inspect.signature(hook).parameters if arg == "register"})
            except KeyboardInterrupt:
                raise
            except BaseException:  # noqa: BLE001 - a plugin broken on import cannot explain anything
                pass
            self._disabled_names[key] = names
        return self._disabled_names[key]

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
    environment switches documented in this module's docstring. ``on_import_error="warn"`` (the listing
    commands': ``plait --help``, ``plait plugins``, ``plait list``, ``plait env``) prints the failure to stderr
    and goes on, whatever ``PLAIT_ON_PLUGIN_ERROR`` says: a listing is how a user finds the broken plugin.
    """
    autoload_by = "make_plugins(autoload=False) or a recipe's plugins: {autoload: false}"
    if autoload is None:
        autoload = not _env_flag("PLAIT_DISABLE_PLUGIN_AUTOLOAD")
        autoload_by = f"PLAIT_DISABLE_PLUGIN_AUTOLOAD={os.environ.get('PLAIT_DISABLE_PLUGIN_AUTOLOAD', '')}"
    warn = on_import_error == "warn"
    on_import_error = "skip" if warn else import_error_policy(on_import_error)
    trace = _env_flag("PLAIT_TRACE_HOOKS") if trace is None else trace

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if trace:
        pm.trace.root.setwriter(lambda line: print(f"[plait trace] {line}", end="", file=sys.stderr))
        pm.enable_tracing()

    infos: dict[str, PluginInfo] = {}
    chosen, disabled = select_entry_points(disable) if autoload else ([], {})
    for ep in chosen:
        dist, version = _provenance(ep)
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # noqa: BLE001 - SystemExit on import is a broken plugin like any other
            message = (
                f"plait plugin {ep.name!r} (entry point {ep.value!r}, distribution {dist} {version}) "
                f"failed to load: {type(err).__name__}: {err}; fix or uninstall it, block it with "
                f"PLAIT_DISABLE_PLUGINS={ep.name}, or set PLAIT_ON_PLUGIN_ERROR=skip"
            )
            if on_import_error == "fail":
                raise PluginLoadError(message) from err
            if warn:
                print(f"plait: warning: {message}; carrying on without it", file=sys.stderr)
            else:
                logger.warning(message)
            continue
        infos[ep.name] = PluginInfo(ep.name, dist, version, ep.value)
    for plugin in plugins:
        pm.register(plugin)
    pm.check_pending()  # a misspelt hook name fails here, naming the plugin and the hook
    return Plugins(pm, infos, trace, disabled, None if autoload else autoload_by)


def import_error_policy(on_import_error: str | None = None) -> str:
    """``fail`` or ``skip``: the argument, else ``PLAIT_ON_PLUGIN_ERROR``, else ``fail``."""
    on_import_error = on_import_error or os.environ.get("PLAIT_ON_PLUGIN_ERROR", "fail")
    if on_import_error not in ("fail", "skip"):
        raise PluginLoadError(
            f"plugins.on_import_error={on_import_error!r} is not valid; use 'fail' or 'skip'"
        )
    return on_import_error


def _provenance(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    return (ep.dist.name, ep.dist.version) if ep.dist else ("(unknown distribution)", "?")


def select_entry_points(disable: Iterable[str] = ()) -> tuple[list[importlib.metadata.EntryPoint], dict[str, Disabled]]:
    """The entry points of the ``plait`` group to load, in order, and those disabled (with why).

    Shared by :func:`make_plugins` and :mod:`plait.catalog`, so a listing and a run see the same plugins.
    """
    by_env = _env_list("PLAIT_DISABLE_PLUGINS")
    blocked = set(disable) | set(by_env)
    entry_points = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    _warn_unknown(by_env, set(disable), entry_points)
    chosen: dict[str, importlib.metadata.EntryPoint] = {}
    disabled: dict[str, Disabled] = {}
    for ep in entry_points:
        dist, _ = _provenance(ep)
        if ep.name in blocked or dist in blocked:
            token = ep.name if ep.name in blocked else dist
            if token in by_env:
                by = f"PLAIT_DISABLE_PLUGINS={os.environ.get('PLAIT_DISABLE_PLUGINS', '')}"
                fix = f"remove {token} from PLAIT_DISABLE_PLUGINS"
            else:
                by, fix = "the recipe's plugins.disable (or make_plugins(disable=...))", f"remove {token} from it"
            disabled.setdefault(ep.name, Disabled(ep, by, fix))
            continue
        seen = chosen.get(ep.name)
        if seen is not None and seen.value != ep.value:
            raise PluginLoadError(
                f"two plugins are named {ep.name!r}: {seen.value!r} ({_provenance(seen)[0]}) "
                f"and {ep.value!r} ({dist}); uninstall one or block it with PLAIT_DISABLE_PLUGINS"
            )
        chosen.setdefault(ep.name, ep)  # the same distribution seen twice on sys.path counts once
    return list(chosen.values()), disabled


def _warn_unknown(by_env: list[str], by_argument: set[str], entry_points) -> None:
    """A name in a disable list that no installed plugin or distribution has is likely a typo."""
    known = {ep.name for ep in entry_points} | {ep.dist.name for ep in entry_points if ep.dist}
    for source, names in (("PLAIT_DISABLE_PLUGINS", by_env), ("plugins.disable", sorted(by_argument))):
        for name in names:
            if name in known:
                continue
            match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {match[0]!r}?" if match else "'plait plugins' lists the installed ones"
            _warn_once(f"plait: {source} names {name!r}, which is no installed plugin or distribution, so it "
                       f"disables nothing; {hint}")


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    """Each plugin manager a process builds would repeat the same warning."""
    logger.warning(message)


@functools.lru_cache(maxsize=1)
def default_plugins() -> Plugins:
    """The process-wide plugins used when an API call is not given ``plugins=``."""
    return make_plugins()
