"""Accuracy of the answer after the reasoning: 0.0 without the delimiter, else ``reward.accuracy``.

For reasoning models that think before answering (DeepSeek-AI 2025, "DeepSeek-R1" §2.2.2): only
the text after the last ``delimiter`` (default ``</think>``) is checked against the gold
``solution``, so an answer written while thinking earns nothing, and a completion that never
finishes thinking scores 0.0. A gold solution with no parsable answer scores None. Needs
``pip install 'plait[math]'``. ``delimiter`` may be a list: the first one found in the completion
splits it.

``reasoning_accuracy_reward`` (also registered under that name) is TRL 1.16's function: the same
plugin with ``latex_only=True``, TRL's rule for what counts as an answer.
"""

from __future__ import annotations

import attrs

from plait import hookimpl
from plait.online.scoring import completion_text

from ._math import NoParameters, checked_when_resolved, column_of, judge, log_judgements, require_math_verify

NAME = "reasoning_accuracy"


def _as_text_or_tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _non_empty(instance, attribute, value) -> None:
    for one in value if isinstance(value, tuple) and value else [value]:
        if not isinstance(one, str) or not one:
            raise ValueError(f"{attribute.name}={value!r} must be a non-empty string (or a list of them), e.g. '</think>'")


INCOMPLETE = (0.0, "[incomplete reasoning]", "[incomplete reasoning]")


@attrs.frozen
class ReasoningAccuracy:
    """Parameters of ``reward.reasoning_accuracy`` and the (picklable) reward function itself."""

    delimiter: str | tuple[str, ...] = attrs.field(default="</think>", converter=_as_text_or_tuple, validator=_non_empty)
    column: str = attrs.field(default="solution", validator=attrs.validators.instance_of(str))
    # TRL 1.16's rule: only a boxed or anchored LaTeX answer counts ("the answer is 7" does not)
    latex_only: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def answer(self, text: str) -> str | None:
        """The text after the last occurrence of the first delimiter found; None when there is none."""
        delimiters = (self.delimiter,) if isinstance(self.delimiter, str) else self.delimiter
        found = next((d for d in delimiters if d in text), None)
        return None if found is None else text.rsplit(found, 1)[1]

    def judgements(self, completions: list, solutions: list) -> list[tuple[float | None, str, str]]:
        """(score, gold as parsed, answer as parsed) per completion; 0.0 for unfinished reasoning."""
        out = []
        for completion, gold in zip(completions, solutions):
            answer = self.answer(completion_text(completion))
            out.append(INCOMPLETE if answer is None else judge(gold, answer, NAME, self.latex_only))
        return out

    def __call__(self, completions: list, **kwargs) -> list[float | None]:
        return [score for score, _, _ in self.judgements(completions, column_of(kwargs, self.column, NAME))]


def reasoning_accuracy_reward(completions: list, solution: list, reasoning_delimiters: list[str] | None = None,
                              log_extra=None, **kwargs) -> list[float | None]:
    """TRL 1.16's ``reasoning_accuracy_reward``: ``reward.reasoning_accuracy`` with TRL's answer rule;
    ``reasoning_delimiters`` defaults to ``["</think>"]``."""
    require_math_verify("reasoning_accuracy_reward")
    rule = ReasoningAccuracy(delimiter=reasoning_delimiters or "</think>", latex_only=True)
    judgements = rule.judgements(completions, solution)
    log_judgements(log_extra, solution, judgements)
    return [score for score, _, _ in judgements]


def make_reasoning_accuracy(params: ReasoningAccuracy) -> ReasoningAccuracy:
    require_math_verify(NAME)
    return params


@hookimpl
def register_rewards(register):
    register("reward.reasoning_accuracy", make_reasoning_accuracy, params=ReasoningAccuracy)
    register("reward.reasoning_accuracy_reward", checked_when_resolved(reasoning_accuracy_reward, "reasoning_accuracy_reward"), params=NoParameters,
             doc="TRL 1.16's reasoning_accuracy_reward: reward.reasoning_accuracy with latex_only=True.")
