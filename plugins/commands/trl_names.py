"""TRL's command names for plait's methods: ``plait reward`` is ``plait reward_model`` and
``plait distillation`` is ``plait distill``, with the same flags, recipes and help, so a TRL
user's ``trl reward ...`` runs as ``plait reward ...``."""

from plait import hookimpl
from plait.cli import Command

ALIASES = {"reward": "reward_model", "distillation": "distill"}


@hookimpl
def register_commands(register):
    for name, method in ALIASES.items():
        register(f"command.{name}", Command(run=None, method=method,
                                            help=f"TRL's name for 'plait {method}': train with the {method!r} method"))
