"""What a method plugin registers: its Config class, its Trainer class, and the loss family it composes."""

from __future__ import annotations

import attrs


@attrs.frozen
class Method:
    """A training method, registered under ``register_methods`` by name (``dpo``, ``grpo``).

    ``config`` is made with :func:`plait.config.method_config` (TrainingArguments + the method's
    attrs parameters); ``trainer`` subclasses :class:`plait.trainer.PlaitTrainer`. The CLI
    subcommand ``plait <name>`` and the top-level names ``plait.<Config>``/``plait.<Trainer>``
    are derived from this record, so third-party methods get them too.
    """

    config: type
    trainer: type
    loss_family: str | None = None
    summary: str = ""
