"""Preference data with an explicit prompt: ``{"prompt", "chosen", "rejected"}`` (DPO, reward models)."""

from plait.data.prepare import DataFormat

from ._hooks import format_hooks

FORMAT = DataFormat(
    name="format.preference",
    kind="preference",
    shapes=(("prompt", "chosen", "rejected"),),
    doc="Preference with explicit prompt: {prompt, chosen, rejected}.",
)


# detection: more specific than {chosen, rejected} and {prompt}
register_data_formats, detect_data_format = format_hooks(FORMAT, tryfirst=True)
