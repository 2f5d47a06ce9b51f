"""Registries: one per kind of component, filled by the registration hooks.

A name is dotted, ``<family>.<variant>`` (``dpo.sigmoid``, ``reward.think_format``). Each entry
remembers the plugin, distribution and version that registered it, so a run's metadata can
say exactly which code produced it.
"""

from __future__ import annotations

import difflib
import re
import sys
from typing import Any, Callable, Iterator

import attrs

from .errors import PlaitError
from .hookspecs import Options, kinds

NAME_PATTERN = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_\-]+)+$")


class DuplicateComponentError(PlaitError):
    pass


class UnknownComponentError(PlaitError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class DisabledComponentError(PlaitError, KeyError):
    """The name exists, in a plugin the user disabled: installing it again would not help."""

    def __str__(self) -> str:
        return self.args[0]


@attrs.frozen
class Component:
    """One registered component: the object plus where it came from."""

    kind: str
    name: str
    obj: Any
    params: type | None = None
    doc: str = ""
    plugin: str = "?"
    distribution: str = "?"
    version: str = "?"
    # the kind's typed options (plait.hookspecs); a Component made by hand gets its kind's defaults
    options: Options = attrs.field(default=attrs.Factory(lambda self: _options_of(self.kind)(), takes_self=True))

    @property
    def summary(self) -> str:
        own = getattr(self.obj, "summary", None)
        if isinstance(own, str):  # a record (Method, Command) has its own; its class docstring says what a Method is
            text = self.doc or own
        else:
            module = sys.modules.get(getattr(self.obj, "__module__", ""), None)
            text = self.doc or getattr(self.obj, "__doc__", None) or getattr(module, "__doc__", None) or ""
        return text.strip().splitlines()[0] if text.strip() else ""

    def make_params(self, **values: Any):
        """Build and validate this component's parameters, naming the component on error."""
        if self.params is None:
            if values:
                raise PlaitError(
                    f"{self.kind} {self.name!r} takes no parameters, got {sorted(values)}; remove them"
                )
            return None
        known = {a.name for a in attrs.fields(self.params)}
        unknown = sorted(set(values) - known)
        if unknown:
            hint = _close(unknown[0], known)
            raise PlaitError(
                f"{self.kind} {self.name!r}: unknown parameter {unknown[0]!r}{hint}; "
                f"accepted: {sorted(known)}"
            )
        try:
            return self.params(**values)
        except (TypeError, ValueError) as err:
            raise PlaitError(f"{self.kind} {self.name!r}: {err}") from err


def _options_of(kind: str) -> type[Options]:
    """The Options class of the kind whose entries are called ``kind`` ("loss"); Options for any other."""
    return next((k.options for k in kinds().values() if k.singular == kind), Options)


def kinds_name(kind: str) -> str:
    """How ``plait list`` names the kind whose entries are called ``kind`` ("loss" -> "losses")."""
    return next((k.listed_as for k in kinds().values() if k.singular == kind), kind + "s")


def _close(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


class Registry:
    """Name -> :class:`Component` for one kind, with helpful errors."""

    def __init__(self, kind: str, why_missing: Callable[[list[str]], str | None] | None = None, note: str = ""):
        self.kind = kind
        self.options = _options_of(kind)  # what register(..., **options) accepts for this kind
        self._entries: dict[str, Component] = {}
        self._why_missing = why_missing  # names -> "comes from plugin X, disabled by Y; fix" (or None)
        self._note = note  # appended to every "unknown" error (e.g. that plugin autoload is off)

    def add(self, component: Component) -> None:
        if not NAME_PATTERN.match(component.name):
            raise PlaitError(
                f"{self.kind} name {component.name!r} from plugin {component.plugin!r} is not dotted "
                "lower-case like 'dpo.sigmoid'; rename it"
            )
        existing = self._entries.get(component.name)
        if existing is not None:
            raise DuplicateComponentError(
                f"{self.kind} {component.name!r} is registered twice: by {existing.plugin} "
                f"({existing.distribution} {existing.version}) and by {component.plugin} "
                f"({component.distribution} {component.version}); uninstall or block one "
                "with PLAIT_DISABLE_PLUGINS"
            )
        self._entries[component.name] = component

    def get(self, name: str, family: str | None = None) -> Component:
        """Look up ``name``; with ``family`` a bare ``sigmoid`` also finds ``dpo.sigmoid``."""
        if name in self._entries:
            return self._entries[name]
        if family and f"{family}.{name}" in self._entries:
            return self._entries[f"{family}.{name}"]
        disabled = self._why_missing and self._why_missing([name, *([f"{family}.{name}"] if family else [])])
        if disabled:
            raise DisabledComponentError(disabled)
        # a bare variant ("sigmod") is matched against bare variants but suggested by full name
        kin = [c.name for c in self.family(family)] if family else []
        candidates = {n: n for n in (kin or self._entries)}  # within a family, only its own names are suggested
        candidates.update({n.split(".", 1)[1]: n for n in kin})
        match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
        hint = f" (did you mean {candidates[match[0]]!r}?)" if match else ""
        if kin:  # a name within a family (a dpo loss): its family is the list to read, not every kind's entry
            listed = kinds_name(self.kind)
            available = f"{', '.join(kin)} (the {family} {listed}; 'plait list {listed}' lists all {len(self)})"
        else:
            available = ", ".join(sorted(self._entries)) or "none are installed"
        note = f"; {self._note}" if self._note else ""
        raise UnknownComponentError(f"unknown {self.kind} {name!r}{hint}; available: {available}{note}")

    def default(self, role: str, what: str) -> Component:
        """The one component whose object declares itself the default for ``role`` (its attribute
        ``default_for = role``; ``what`` says what the role does, for the error). Core asks for a
        role, so it names no built-in and works, role unused, when the plugin filling it is disabled."""
        found = [c for c in self if getattr(c.obj, "default_for", None) == role]
        if len(found) > 1:
            raise PlaitError(f"{len(found)} {self.kind}s are registered as the default for {role!r} "
                             f"({', '.join(c.name for c in found)}); disable all but one with PLAIT_DISABLE_PLUGINS")
        if not found:
            note = f"; {self._note}" if self._note else ""
            raise PlaitError(f"no {self.kind} is registered as the default for {role!r} ({what}); install or enable a "
                             f"plugin registering one whose default_for = {role!r} (is it in PLAIT_DISABLE_PLUGINS?){note}")
        return found[0]

    def family(self, prefix: str) -> list[Component]:
        return [c for n, c in sorted(self._entries.items()) if n.startswith(prefix + ".")]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Component]:
        return iter(sorted(self._entries.values(), key=lambda c: c.name))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)


def register_callback(registry: Registry, plugin: str, distribution: str, version: str,
                      module: str = "") -> Callable[..., None]:
    """The ``register`` function handed to one plugin's registration hook (``module``: where the plugin
    lives, named in errors when it differs from the plugin's name)."""
    installed = distribution.strip("()") if version in ("-", "?") else f"{distribution} {version}"  # "(not installed)"
    where = ", ".join(part for part in (module if module != plugin else "", installed) if part)

    def register(name: str, obj: Any, *, params: type | None = None, doc: str = "", **options: Any) -> None:
        who = f"{registry.kind} {name!r} from plugin {plugin!r} ({where})"
        if params is not None and not attrs.has(params):
            raise PlaitError(f"{who}: params must be an attrs class, got {params!r}")
        registry.add(
            Component(
                kind=registry.kind, name=name, obj=obj, params=params, doc=doc,
                plugin=plugin, distribution=distribution, version=version,
                options=typed_options(registry.options, options, registry.kind, who),
            )
        )

    return register


def typed_options(spec: type[Options], options: dict[str, Any], kind: str, who: str) -> Options:
    """``options`` as the kind's ``spec``; a misspelt or mistyped option is one line naming ``who``."""
    accepted = [field.name for field in attrs.fields(spec)]
    accepts = f"a {kind} accepts {', '.join(accepted) if accepted else 'no options'} (besides params= and doc=)"
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise PlaitError(f"{who}: unknown option {unknown[0]!r}{_close(unknown[0], accepted)}; {accepts}")
    try:
        return spec(**options)
    except (TypeError, ValueError) as err:
        # attrs' validators raise (message, attribute, expected, value): the message is the line
        raise PlaitError(f"{who}: option {err.args[0]}; {accepts}") from err
