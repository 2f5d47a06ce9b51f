"""Language modelling data: ``{"text": str}`` or ``{"messages": [...]}`` (SFT on whole sequences)."""

from plait.data.prepare import DataFormat

from ._hooks import format_hooks

FORMAT = DataFormat(
    name="format.language_modeling",
    kind="language_modeling",
    shapes=(("text",), ("messages",)),
    convert=lambda row: {"text": row["text"] if "text" in row else row["messages"]},
    doc="Language modelling: {text} (strings) or {messages} (conversations).",
)


register_data_formats, detect_data_format = format_hooks(FORMAT)
