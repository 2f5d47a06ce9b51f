"""Accuracy of the answer after the reasoning: 0.0 without the delimiter, else ``reward.accuracy``.

For reasoning models that think before answering (DeepSeek-AI 2025, "DeepSeek-R1" §2.2.2): only
the text after the last ``delimiter`` (default ``</think>``) is checked against the gold
``solution``, so an answer written while thinking earns nothing, and a completion that never
finishes thinking scores 0.0. A gold solution with no parsable answer scores None. Needs
``pip install 'plait[math]'``.
"""

from __future__ import annotations

import attrs

from plait import hookimpl
from plait.scoring import completion_text

from ._math import accuracy_of, column_of, require_math_verify

NAME = "reasoning_accuracy"


def _non_empty(instance, attribute, value) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name}={value!r} must be a non-empty string, e.g. '</think>'")


@attrs.frozen
class ReasoningAccuracy:
    """Parameters of ``reward.reasoning_accuracy`` and the (picklable) reward function itself."""

    delimiter: str = attrs.field(default="</think>", validator=_non_empty)
    column: str = attrs.field(default="solution", validator=attrs.validators.instance_of(str))

    def __call__(self, completions: list, **kwargs) -> list[float | None]:
        solutions = column_of(kwargs, self.column, NAME)
        scores: list[float | None] = []
        for completion, gold in zip(completions, solutions):
            text = completion_text(completion)
            if self.delimiter not in text:
                scores.append(0.0)
            else:
                scores.append(accuracy_of(gold, text.rsplit(self.delimiter, 1)[1], NAME))
        return scores


def reasoning_accuracy_reward(completions: list, solution: list, **kwargs) -> list[float | None]:
    """The reward with the default ``</think>`` delimiter, as a plain function."""
    return ReasoningAccuracy()(completions, solution=solution)


def make_reasoning_accuracy(params: ReasoningAccuracy) -> ReasoningAccuracy:
    require_math_verify(NAME)
    return params


@hookimpl
def register_rewards(register):
    register("reward.reasoning_accuracy", make_reasoning_accuracy, params=ReasoningAccuracy)
