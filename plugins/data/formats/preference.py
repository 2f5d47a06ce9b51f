"""Preference data with an explicit prompt: ``{"prompt", "chosen", "rejected"}`` (DPO, reward models)."""

from plait import hookimpl
from plait.data import DataFormat

FORMAT = DataFormat(
    name="format.preference",
    kind="preference",
    shapes=(("prompt", "chosen", "rejected"),),
    doc="Preference with explicit prompt: {prompt, chosen, rejected}.",
)


@hookimpl
def register_data_formats(register):
    register(FORMAT.name, FORMAT, doc=FORMAT.doc)


@hookimpl(tryfirst=True)  # more specific than {chosen, rejected} and {prompt}
def detect_data_format(columns):
    return FORMAT.detect(columns)
