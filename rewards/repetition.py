"""N-gram repetition penalty: (1 − unique / total n-grams) · p, with p = ``max_penalty`` ≤ 0.

Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning in LLMs", §4 (repetition
penalty): long reasoning drifts into loops, which this scores by the share of repeated word
n-grams (lower-cased, split on whitespace). A completion with no repeated n-gram, or shorter
than n words, scores 0; one that repeats a single n-gram throughout approaches p.
"""

from __future__ import annotations

import attrs

from plait import hookimpl
from plait.scoring import completion_text


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

    def score(self, text: str) -> float:
        words = text.lower().split()
        grams = [tuple(words[i : i + self.ngram]) for i in range(len(words) - self.ngram + 1)]
        if not grams:
            return 0.0
        return (1.0 - len(set(grams)) / len(grams)) * self.max_penalty + 0.0  # + 0.0: no -0.0

    def __call__(self, completions: list, **kwargs) -> list[float]:
        return [self.score(completion_text(c)) for c in completions]


def make_repetition(params: Repetition) -> Repetition:
    return params


@hookimpl
def register_rewards(register):
    register("reward.repetition", make_repetition, params=Repetition)
