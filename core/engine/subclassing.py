"""A module's class swapped for a subclass with plait's forward: how the engine's CPU kernels reach a model's
norms and MLPs. A subclass rather than an instance's forward: transformers' ``train()`` (through the ``kernels``
package) drops every instance forward of a module it may swap for a hub kernel; a subclass keeps its forward,
and a hub kernel the user maps still takes over."""

from __future__ import annotations

import sys
from typing import Callable

_SUBCLASSES: dict[tuple[type, str], type] = {}


def subclass_with_forward(base: type, prefix: str, forward: Callable, marker: str, home: str) -> type:
    """``base`` with ``forward``, named ``prefix + base.__name__`` in the module ``home`` (by that name, so a
    pickled model finds it) and marked by a true class attribute ``marker``; made once per base and prefix."""
    key = (base, prefix)
    if key not in _SUBCLASSES:
        namespace = vars(sys.modules[home])
        name = f"{prefix}{base.__name__}"
        while name in namespace:  # another module's class of the same name
            name += "_"
        subclass = type(name, (base,), {"forward": forward, marker: True, "__module__": home, "__qualname__": name})
        _SUBCLASSES[key] = namespace[name] = subclass
    return _SUBCLASSES[key]
