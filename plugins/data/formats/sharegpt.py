"""ShareGPT data: ``{"conversations": [{"from", "value"}, ...]}``, converted to messages."""

from plait.data.prepare import DataFormat
from plait.errors import PlaitError

from ._hooks import format_hooks

ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "function_call": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool",
}


def to_messages(row: dict) -> dict:
    turns = row["conversations"]
    if not isinstance(turns, list):
        raise PlaitError(f"column 'conversations' holds {type(turns).__name__}; it must be a list of {{'from', 'value'}} turns")
    messages = []
    for position, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in ROLES:
            raise PlaitError(
                f"column 'conversations' turn {position} has from={speaker!r}; accepted: {sorted(ROLES)}"
            )
        messages.append({"role": ROLES[speaker], "content": turn.get("value")})
    return {"text": messages}


FORMAT = DataFormat(
    name="format.sharegpt",
    kind="language_modeling",
    shapes=(("conversations",),),
    convert=to_messages,
    doc="ShareGPT: {conversations: [{from, value}]}, converted to role/content messages.",
)


register_data_formats, detect_data_format = format_hooks(FORMAT)
