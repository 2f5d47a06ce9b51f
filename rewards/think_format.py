"""Format reward: 1.0 iff the completion is one ``<think>…</think>`` block followed by an answer.

The format reward of DeepSeek-AI 2025, "DeepSeek-R1" §2.2.2: the model is paid for putting its
reasoning between think tags. ``reward.think_format`` allows leading whitespace; a second
``<think>`` or ``</think>``, a missing tag, text before ``<think>`` or nothing but whitespace
after ``</think>`` scores 0.0.

``think_format_reward`` (also registered under that name) is TRL 1.16's rule on the same
checker: ``<think>`` must be the very first characters, later ``</think>`` tags are allowed and
the answer may be empty.
"""

from __future__ import annotations

import attrs

from plait import hookimpl
from plait.online.scoring import completion_text

OPEN, CLOSE = "<think>", "</think>"


@attrs.frozen
class ThinkFormat:
    """The format check; each flag is one way plait's rule is stricter or looser than TRL's."""

    leading_whitespace: bool = True  # may whitespace come before <think>?
    one_close: bool = True  # exactly one </think> (TRL: at least one)
    answer_required: bool = True  # must text other than whitespace follow </think>?

    def well_formed(self, text: str) -> bool:
        if self.leading_whitespace:
            text = text.lstrip()
        if not text.startswith(OPEN) or text.count(OPEN) != 1 or CLOSE not in text:
            return False
        if self.one_close and text.count(CLOSE) != 1:
            return False
        return not self.answer_required or bool(text.rsplit(CLOSE, 1)[1].strip())

    def __call__(self, completions: list, **kwargs) -> list[float]:
        return [1.0 if self.well_formed(completion_text(c)) else 0.0 for c in completions]


think_format = ThinkFormat()
TRL_RULE = ThinkFormat(leading_whitespace=False, one_close=False, answer_required=False)


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """TRL 1.16's ``think_format_reward``."""
    return TRL_RULE(completions)


@hookimpl
def register_rewards(register):
    register("reward.think_format", think_format, doc="1.0 iff the completion is one <think>…</think> block followed by an answer.")
    register("reward.think_format_reward", think_format_reward, doc="TRL 1.16's think_format_reward: <think> first, answer optional.")
