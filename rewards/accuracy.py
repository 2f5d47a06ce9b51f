"""Math accuracy: 1.0 when the completion's answer equals the gold ``solution`` in value, else 0.0.

A verifiable (rule-based) accuracy reward as in DeepSeek-AI 2025, "DeepSeek-R1" §2.2.2. Both
sides are parsed with math-verify, so "$\\frac{63}{400}$" and "The answer is $\\boxed{0.1575}$"
agree; a ``\\boxed{}`` answer in the completion is taken before anything else. A gold solution in
which math-verify finds no answer scores None (the example is left out of the reward) rather
than a 0 that would punish the model for a broken label. Needs ``pip install 'plait[math]'``.

``accuracy_reward`` (also registered under that name) is TRL 1.16's function: the same plugin
with ``latex_only=True``, TRL's rule for what counts as an answer.
"""

from __future__ import annotations

import attrs

from plait import hookimpl
from plait.online.scoring import completion_text

from ._math import NoParameters, checked_when_resolved, column_of, judge, log_judgements, require_math_verify

NAME = "accuracy"


@attrs.frozen
class Accuracy:
    """Parameters of ``reward.accuracy`` and the (picklable) reward function itself."""

    column: str = attrs.field(default="solution", validator=attrs.validators.instance_of(str))
    # TRL 1.16's rule: only a boxed or anchored LaTeX answer counts ("the answer is 7" does not)
    latex_only: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def judgements(self, completions: list, solutions: list) -> list[tuple[float | None, str, str]]:
        """(score, gold as parsed, answer as parsed) per completion."""
        return [judge(gold, completion_text(c), NAME, self.latex_only) for c, gold in zip(completions, solutions)]

    def __call__(self, completions: list, **kwargs) -> list[float | None]:
        return [score for score, _, _ in self.judgements(completions, column_of(kwargs, self.column, NAME))]


TRL_RULE = Accuracy(latex_only=True)


def accuracy_reward(completions: list, solution: list, log_extra=None, **kwargs) -> list[float | None]:
    """TRL 1.16's ``accuracy_reward``: ``reward.accuracy`` with TRL's answer rule; ``log_extra``
    (given by a trainer) receives the solutions and the parsed gold and answers."""
    require_math_verify("accuracy_reward")
    judgements = TRL_RULE.judgements(completions, solution)
    log_judgements(log_extra, solution, judgements)
    return [score for score, _, _ in judgements]


def make_accuracy(params: Accuracy) -> Accuracy:
    require_math_verify(NAME)  # fail when the run is configured, not at the first reward call
    return params


@hookimpl
def register_rewards(register):
    register("reward.accuracy", make_accuracy, params=Accuracy)
    register("reward.accuracy_reward", checked_when_resolved(accuracy_reward, "accuracy_reward"), params=NoParameters, doc="TRL 1.16's accuracy_reward: reward.accuracy with latex_only=True.")
