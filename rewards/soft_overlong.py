"""Soft overlong punishment: a length penalty that ramps from 0 to −1 over the last C tokens.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", §3.4
(overlong reward shaping). With |y| the completion's token count, L = ``max_len`` and
C = ``cache``:

    r = 0                    if |y| ≤ L − C
    r = (L − C − |y|) / C    if L − C < |y| ≤ L
    r = −1                   if |y| > L

so a completion is nudged to finish before the hard limit instead of being cut off there.
Typically L is the generation limit (max_completion_length) and C a fifth of it.
"""

from __future__ import annotations

import attrs

from plait import hookimpl


def _positive_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name}={value!r} must be a whole number of tokens > 0")


def _cache(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= instance.max_len:
        raise ValueError(f"{attribute.name}={value!r} must be a whole number of tokens in [0, max_len={instance.max_len}]")


@attrs.frozen
class SoftOverlong:
    """Parameters of ``reward.soft_overlong`` and the (picklable) reward function itself."""

    max_len: int = attrs.field(validator=_positive_int)
    cache: int = attrs.field(validator=_cache)

    def score(self, length: int) -> float:
        if length <= self.max_len - self.cache:
            return 0.0
        if length <= self.max_len:
            return (self.max_len - self.cache - length) / self.cache
        return -1.0

    def __call__(self, completion_ids: list, **kwargs) -> list[float]:
        return [self.score(len(ids)) for ids in completion_ids]


def make_soft_overlong(params: SoftOverlong) -> SoftOverlong:
    return params


@hookimpl
def register_rewards(register):
    register("reward.soft_overlong", make_soft_overlong, params=SoftOverlong)
