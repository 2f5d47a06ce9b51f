"""``template.deepseek_r1_distill``: the DeepSeek-R1-Distill template, which cuts every assistant content at
``</think>``, made to keep the reasoning and given generation markers for assistant-only loss."""

from __future__ import annotations

from pathlib import Path

from plait import hookimpl

# The R1-Distill template ({{bos_token}} unspaced, tool calls only when content is none), not DeepSeek-V3's.
RECOGNISES = ("<｜Assistant｜>", "content.split('</think>')[-1]", "{{bos_token}}{{ns.system_prompt}}")
UNLESS = ("{% generation %}", "{%- generation %}")


@hookimpl
def register_chat_templates(register):
    template = (Path(__file__).parent / "deepseek_r1_distill.jinja").read_text(encoding="utf-8")
    register("template.deepseek_r1_distill", template, recognises=RECOGNISES, unless=UNLESS,
             doc="DeepSeek-R1-Distill: assistant contents keep their reasoning; generation markers")
