"""Prompt-only data: ``{"prompt": ...}`` plus any columns reward functions need (online RL)."""

from plait import hookimpl
from plait.data import DataFormat

FORMAT = DataFormat(
    name="format.prompt_only",
    kind="prompt_only",
    shapes=(("prompt",),),
    doc="Prompt only: {prompt}; other columns are kept for reward functions.",
)


@hookimpl
def register_data_formats(register):
    register(FORMAT.name, FORMAT, doc=FORMAT.doc)


@hookimpl(trylast=True)  # every prompt-bearing shape contains {prompt}: answer only when none did
def detect_data_format(columns):
    return FORMAT.detect(columns)
