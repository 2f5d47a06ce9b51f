"""Prompt-completion data: ``{"prompt", "completion"}``, strings or conversations."""

from plait import hookimpl
from plait.data import DataFormat

FORMAT = DataFormat(
    name="format.prompt_completion",
    kind="prompt_completion",
    shapes=(("prompt", "completion"),),
    doc="Prompt-completion: {prompt, completion}.",
)


@hookimpl
def register_data_formats(register):
    register(FORMAT.name, FORMAT, doc=FORMAT.doc)


@hookimpl
def detect_data_format(columns):
    return FORMAT.detect(columns)
