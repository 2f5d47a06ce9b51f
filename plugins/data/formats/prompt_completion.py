"""Prompt-completion data: ``{"prompt", "completion"}``, strings or conversations."""

from plait.data.prepare import DataFormat

from ._hooks import format_hooks

FORMAT = DataFormat(
    name="format.prompt_completion",
    kind="prompt_completion",
    shapes=(("prompt", "completion"),),
    doc="Prompt-completion: {prompt, completion}.",
)


register_data_formats, detect_data_format = format_hooks(FORMAT)
