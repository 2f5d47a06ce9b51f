"""Prompt-only data: ``{"prompt": ...}`` plus any columns reward functions need (online RL)."""

from plait.data.prepare import DataFormat

from ._hooks import format_hooks

FORMAT = DataFormat(
    name="format.prompt_only",
    kind="prompt_only",
    shapes=(("prompt",),),
    doc="Prompt only: {prompt}; other columns are kept for reward functions.",
)


# detection: every prompt-bearing shape contains {prompt}: answer only when none did
register_data_formats, detect_data_format = format_hooks(FORMAT, trylast=True)
