"""``template.qwen3``: Qwen3's thinking template, which drops the reasoning of assistant turns before the last
user query, made prefix-preserving with generation markers for assistant-only loss (``qwen3.jinja``)."""

from __future__ import annotations

from pathlib import Path

from plait import hookimpl

# Qwen3's template, and not Qwen3.5's and later ones (which share these lines but render images and videos through
# a render_content macro) nor Qwen3-Instruct-2507's (no last_query_index: it never rewrites earlier turns).
RECOGNISES = ("<|im_start|>", "ns.last_query_index", "reasoning_content", "content.split('</think>')[-1]")
UNLESS = ("render_content", "{% generation %}", "{%- generation %}")


@hookimpl
def register_chat_templates(register):
    register("template.qwen3", (Path(__file__).parent / "qwen3.jinja").read_text(encoding="utf-8"),
             recognises=RECOGNISES, unless=UNLESS,
             doc="Qwen3 (thinking): every assistant turn keeps its <think> block; generation markers")
