"""N-gram repetition penalty: (1 − unique / total n-grams) · p, with p = ``max_penalty`` ≤ 0.

Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning in LLMs", §4 (repetition
penalty): long reasoning drifts into loops, which this scores by the share of repeated word
n-grams (lower-cased, split on whitespace). A completion with no repeated n-gram, or shorter
than n words, scores 0; one that repeats a single n-gram throughout approaches p. With
``tokens=True`` the n-grams are of completion token ids instead, as in TRL 1.16, whose factory
``get_repetition_penalty_reward(ngram_size, max_penalty)`` is also registered under that name.
"""

from __future__ import annotations

import attrs

from plait import hookimpl
from plait.online.scoring import completion_text


def _ngram(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name}={value!r} must be a whole number >= 1")


def _penalty(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value <= 0:
        raise ValueError(f"{attribute.name}={value!r} must be a number <= 0 (it is a penalty); use e.g. -1.0")


@attrs.frozen
class Repetition:
    """Parameters of ``reward.repetition`` and the (picklable) reward function itself."""

    ngram: int = attrs.field(default=3, validator=_ngram)
    max_penalty: float = attrs.field(default=-1.0, validator=_penalty)
    tokens: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    __name__ = "repetition_penalty_reward"  # what TRL 1.16 logs a callable instance under

    def score(self, units: list) -> float:
        grams = [tuple(units[i : i + self.ngram]) for i in range(len(units) - self.ngram + 1)]
        if not grams:
            return 0.0
        return (1.0 - len(set(grams)) / len(grams)) * self.max_penalty + 0.0  # + 0.0: no -0.0

    # completion_ids first: TRL's reward is called as ``reward(completion_ids)``
    def __call__(self, completion_ids: list | None = None, completions: list | None = None, **kwargs) -> list[float]:
        if self.tokens:
            return [self.score(list(ids)) for ids in completion_ids]
        return [self.score(completion_text(c).lower().split()) for c in completions]


def make_repetition(params: Repetition) -> Repetition:
    return params


@attrs.frozen
class RepetitionPenalty:
    """TRL 1.16's names for the parameters of ``reward.get_repetition_penalty_reward``."""

    ngram_size: int = attrs.field(default=3, validator=_ngram)
    max_penalty: float = attrs.field(default=-1.0, validator=_penalty)


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> Repetition:
    """TRL 1.16's factory: the penalty over n-grams of completion token ids."""
    return Repetition(ngram=ngram_size, max_penalty=max_penalty, tokens=True)


def make_trl_repetition(params: RepetitionPenalty) -> Repetition:
    return get_repetition_penalty_reward(params.ngram_size, params.max_penalty)


@hookimpl
def register_rewards(register):
    register("reward.repetition", make_repetition, params=Repetition)
    register("reward.get_repetition_penalty_reward", make_trl_repetition, params=RepetitionPenalty,
             doc="TRL 1.16's get_repetition_penalty_reward(ngram_size, max_penalty): reward.repetition over token ids.")
