"""Soft overlong punishment: a length penalty that ramps from 0 to −1 over the last C tokens.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", §3.4
(overlong reward shaping). With |y| the completion's token count, L = ``max_len`` and
C = ``cache``:

    r = 0                    if |y| ≤ L − C
    r = (L − C − |y|) / C    if L − C < |y| ≤ L
    r = −1                   if |y| > L

so a completion is nudged to finish before the hard limit instead of being cut off there.
Typically L is the generation limit (max_completion_length) and C a fifth of it.

``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`` is TRL 1.16's factory
for the same reward, also registered under that name with TRL's parameter names.
"""

from __future__ import annotations

import attrs

from plait import hookimpl


def _positive_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name}={value!r} must be a whole number of tokens > 0")


def _cache_within(limit: str):
    """Validator: a whole number of tokens in [0, the value of field ``limit``]."""

    def check(instance, attribute, value) -> None:
        top = getattr(instance, limit)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise ValueError(f"{attribute.name}={value!r} must be a whole number of tokens in [0, {limit}={top}]")

    return check


@attrs.frozen
class SoftOverlong:
    """Parameters of ``reward.soft_overlong`` and the (picklable) reward function itself."""

    max_len: int = attrs.field(validator=_positive_int)
    cache: int = attrs.field(validator=_cache_within("max_len"))
    __name__ = "soft_overlong_punishment_reward"  # what TRL 1.16 logs a callable instance under

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


@attrs.frozen
class SoftOverlongPunishment:
    """TRL 1.16's names for the parameters of ``reward.get_soft_overlong_punishment``; the defaults
    are the values TRL's ``trl grpo --reward_funcs get_soft_overlong_punishment`` uses."""

    max_completion_len: int = attrs.field(default=1280, validator=_positive_int)
    soft_punish_cache: int = attrs.field(default=256, validator=_cache_within("max_completion_len"))


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlong:
    """TRL 1.16's factory: the reward function of ``completion_ids`` for L = ``max_completion_len``,
    C = ``soft_punish_cache``."""
    return SoftOverlong(max_len=max_completion_len, cache=soft_punish_cache)


def make_trl_soft_overlong(params: SoftOverlongPunishment) -> SoftOverlong:
    return get_soft_overlong_punishment(params.max_completion_len, params.soft_punish_cache)


@hookimpl
def register_rewards(register):
    register("reward.soft_overlong", make_soft_overlong, params=SoftOverlong)
    register("reward.get_soft_overlong_punishment", make_trl_soft_overlong, params=SoftOverlongPunishment,
             doc="TRL 1.16's get_soft_overlong_punishment(max_completion_len, soft_punish_cache): reward.soft_overlong.")
