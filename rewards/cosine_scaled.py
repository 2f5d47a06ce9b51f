"""Cosine length-scaled accuracy: short correct answers earn most, short wrong answers lose most.

Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning in LLMs", §4.1 (cosine reward).
With t = min(|y|, L) / L (|y| the completion's token count, L = ``max_len``) and
c = cos(π·t), a correct answer scores

    r = min_value_correct + ½·(max_value_correct − min_value_correct)·(1 + c)

(max_value_correct at length 0, falling to min_value_correct at L), and a wrong one

    r = max_value_wrong + ½·(min_value_wrong − max_value_wrong)·(1 + c)

(min_value_wrong at length 0, rising to max_value_wrong at L: thinking longer before a wrong
answer is punished less). Correctness is math-verify's, as in ``reward.accuracy``; a gold
solution with no parsable answer scores None. Needs ``pip install 'plait[math]'``.

``get_cosine_scaled_reward(max_len, ...)`` is TRL 1.16's factory: the same reward with TRL's
answer rule (``latex_only=True``), also registered under that name.
"""

from __future__ import annotations

import math

import attrs

from plait import hookimpl
from plait.online.scoring import completion_text
from plait.params import finite

from ._math import accuracy_of, column_of, require_math_verify

NAME = "cosine_scaled"


def _positive_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name}={value!r} must be a whole number of tokens > 0")


@attrs.frozen
class CosineScaled:
    """Parameters of ``reward.cosine_scaled`` and the (picklable) reward function itself."""

    max_len: int = attrs.field(default=1000, validator=_positive_int)
    min_value_wrong: float = attrs.field(default=-1.0, validator=finite)
    max_value_wrong: float = attrs.field(default=-0.5, validator=finite)
    min_value_correct: float = attrs.field(default=0.5, validator=finite)
    max_value_correct: float = attrs.field(default=1.0, validator=finite)
    column: str = attrs.field(default="solution", validator=attrs.validators.instance_of(str))
    # TRL 1.16's rule: only a boxed or anchored LaTeX answer counts ("the answer is 7" does not)
    latex_only: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    __name__ = "cosine_scaled_reward"  # what TRL 1.16 logs a callable instance under

    def __attrs_post_init__(self) -> None:
        for kind in ("wrong", "correct"):
            low, high = getattr(self, f"min_value_{kind}"), getattr(self, f"max_value_{kind}")
            if low > high:
                raise ValueError(f"min_value_{kind}={low!r} must be <= max_value_{kind}={high!r}")

    def score(self, correct: bool, length: int) -> float:
        c = math.cos(math.pi * min(length, self.max_len) / self.max_len)
        if correct:
            return self.min_value_correct + 0.5 * (self.max_value_correct - self.min_value_correct) * (1 + c)
        return self.max_value_wrong + 0.5 * (self.min_value_wrong - self.max_value_wrong) * (1 + c)

    # TRL's order: ``reward(completions, solution, completion_ids)``
    def __call__(self, completions: list, solution: list | None = None, completion_ids: list | None = None,
                 **kwargs) -> list[float | None]:
        solutions = column_of({"solution": solution, **kwargs} if solution is not None else kwargs, self.column, NAME)
        scores: list[float | None] = []
        for completion, ids, gold in zip(completions, completion_ids, solutions):
            accuracy = accuracy_of(gold, completion_text(completion), NAME, self.latex_only)
            scores.append(None if accuracy is None else self.score(accuracy == 1.0, len(ids)))
        return scores


def make_cosine_scaled(params: CosineScaled) -> CosineScaled:
    require_math_verify(NAME)
    return params


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0) -> CosineScaled:
    """TRL 1.16's factory: the reward of ``(completions, solution, completion_ids)``."""
    return CosineScaled(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct, latex_only=True)


def make_trl_cosine_scaled(params: CosineScaled) -> CosineScaled:
    return make_cosine_scaled(attrs.evolve(params, latex_only=True))


@hookimpl
def register_rewards(register):
    register("reward.cosine_scaled", make_cosine_scaled, params=CosineScaled)
    register("reward.get_cosine_scaled_reward", make_trl_cosine_scaled, params=CosineScaled,
             doc="TRL 1.16's get_cosine_scaled_reward(max_len, ...): reward.cosine_scaled with latex_only=True.")
