"""``env.parser.hermes``: tool calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(the format of Qwen 2.5/3 and Hermes chat templates); the default when a tokenizer has no parser of its own."""

from __future__ import annotations

from plait import hookimpl
from plait.online.tools import parse_hermes


@hookimpl
def register_environments(register):
    register("env.parser.hermes", parse_hermes, doc="Tool calls as <tool_call>{json}</tool_call> (Qwen, Hermes)")
