"""Unpaired preference data: ``{"prompt", "completion", "label"}`` with a boolean label (KTO)."""

from plait.data.prepare import DataFormat

from ._hooks import format_hooks

FORMAT = DataFormat(
    name="format.unpaired_preference",
    kind="unpaired_preference",
    shapes=(("prompt", "completion", "label"),),
    doc="Unpaired preference: {prompt, completion, label} with label True = desirable.",
)


# detection: more specific than {prompt, completion}
register_data_formats, detect_data_format = format_hooks(FORMAT, tryfirst=True)
