"""What a method plugin registers: its Config class, its Trainer class, and the loss family it composes."""

from __future__ import annotations

import attrs


@attrs.frozen
class Method:
    """A training method, registered under ``register_methods`` by name (``dpo``, ``grpo``).

    ``config`` is made with :func:`plait.engine.config.method_config` (TrainingArguments + the method's
    attrs parameters); ``trainer`` subclasses :class:`plait.engine.trainer.PlaitTrainer`. The CLI
    subcommand ``plait <name>`` and the top-level names ``plait.<Config>``/``plait.<Trainer>``
    are derived from this record, so third-party methods get them too. ``exports`` adds other
    top-level names (``{"DistillationConfig": DistillConfig}``: TRL's names where they differ).
    """

    config: type
    trainer: type
    loss_family: str | None = None
    summary: str = ""
    exports: dict[str, type] = attrs.field(factory=dict, eq=False)
