"""Language modelling data: ``{"text": str}`` or ``{"messages": [...]}`` (SFT on whole sequences)."""

from plait import hookimpl
from plait.data import DataFormat

FORMAT = DataFormat(
    name="format.language_modeling",
    kind="language_modeling",
    shapes=(("text",), ("messages",)),
    convert=lambda row: {"text": row["text"] if "text" in row else row["messages"]},
    doc="Language modelling: {text} (strings) or {messages} (conversations).",
)


@hookimpl
def register_data_formats(register):
    register(FORMAT.name, FORMAT, doc=FORMAT.doc)


@hookimpl
def detect_data_format(columns):
    return FORMAT.detect(columns)
