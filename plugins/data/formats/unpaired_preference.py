"""Unpaired preference data: ``{"prompt", "completion", "label"}`` with a boolean label (KTO)."""

from plait import hookimpl
from plait.data import DataFormat

FORMAT = DataFormat(
    name="format.unpaired_preference",
    kind="unpaired_preference",
    shapes=(("prompt", "completion", "label"),),
    doc="Unpaired preference: {prompt, completion, label} with label True = desirable.",
)


@hookimpl
def register_data_formats(register):
    register(FORMAT.name, FORMAT, doc=FORMAT.doc)


@hookimpl(tryfirst=True)  # more specific than {prompt, completion}
def detect_data_format(columns):
    return FORMAT.detect(columns)
