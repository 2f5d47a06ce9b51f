"""Format reward: 1.0 iff the completion is one ``<think>…</think>`` block followed by an answer.

The format reward of DeepSeek-AI 2025, "DeepSeek-R1" §2.2.2: the model is paid for putting its
reasoning between think tags. Leading whitespace is allowed; a second ``<think>`` or
``</think>``, a missing tag, text before ``<think>`` or nothing but whitespace after
``</think>`` scores 0.0.
"""

from __future__ import annotations

from plait import hookimpl
from plait.scoring import completion_text

OPEN, CLOSE = "<think>", "</think>"


def well_formed(text: str) -> bool:
    text = text.lstrip()
    if not text.startswith(OPEN) or text.count(OPEN) != 1 or text.count(CLOSE) != 1:
        return False
    return bool(text.split(CLOSE, 1)[1].strip())


def think_format_reward(completions: list, **kwargs) -> list[float]:
    return [1.0 if well_formed(completion_text(c)) else 0.0 for c in completions]


@hookimpl
def register_rewards(register):
    register("reward.think_format", think_format_reward)
