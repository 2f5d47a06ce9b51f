"""Math accuracy: 1.0 when the completion's answer equals the gold ``solution`` in value, else 0.0.

A verifiable (rule-based) accuracy reward as in DeepSeek-AI 2025, "DeepSeek-R1" §2.2.2. Both
sides are parsed with math-verify, so "$\\frac{63}{400}$" and "The answer is $\\boxed{0.1575}$"
agree; a ``\\boxed{}`` answer in the completion is taken before anything else. A gold solution in
which math-verify finds no answer scores None (the example is left out of the reward) rather
than a 0 that would punish the model for a broken label. Needs ``pip install 'plait[math]'``.
"""

from __future__ import annotations

import attrs

from plait import hookimpl
from plait.scoring import completion_text

from ._math import accuracy_of, column_of, require_math_verify

NAME = "accuracy"


@attrs.frozen
class Accuracy:
    """Parameters of ``reward.accuracy`` and the (picklable) reward function itself."""

    column: str = attrs.field(default="solution", validator=attrs.validators.instance_of(str))

    def __call__(self, completions: list, **kwargs) -> list[float | None]:
        solutions = column_of(kwargs, self.column, NAME)
        return [accuracy_of(gold, completion_text(c), NAME) for c, gold in zip(completions, solutions)]


def accuracy_reward(completions: list, solution: list, **kwargs) -> list[float | None]:
    """The reward as a plain function of ``completions`` and the ``solution`` column."""
    return Accuracy()(completions, solution=solution)


def make_accuracy(params: Accuracy) -> Accuracy:
    require_math_verify(NAME)  # fail when the run is configured, not at the first reward call
    return params


@hookimpl
def register_rewards(register):
    register("reward.accuracy", make_accuracy, params=Accuracy)
