"""filter.accuracy_band: keep groups whose pass rate lies in [low, high] (curriculum by difficulty).

A prompt every completion solves, or none does, teaches a group-relative method nothing; curriculum
recipes (e.g. Polaris, Skywork-OR1's online filtering) keep prompts of medium difficulty. A
completion passes when its total reward is at least ``success``; completions no reward scored count
as failures. The pass rate is the share of the group's completions that passed.
"""

import attrs

from plait import PlaitError, hookimpl
from plait.online.filtering import RolloutGroup
from plait.params import finite, in_range


@attrs.frozen
class AccuracyBandParams:
    low: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    high: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    success: float = attrs.field(default=1.0, validator=finite)

    def __attrs_post_init__(self) -> None:
        if self.low > self.high:
            raise PlaitError(f"filter.accuracy_band: low={self.low} is above high={self.high}; give low <= high")


def accuracy_band(group: RolloutGroup, p: AccuracyBandParams) -> bool:
    passed = (group.rewards >= p.success).float()  # NaN compares False: unscored completions fail
    return p.low <= float(passed.mean()) <= p.high


@hookimpl
def register_rollout_filters(register):
    register("filter.accuracy_band", accuracy_band, params=AccuracyBandParams,
             doc="keep groups whose pass rate lies in [low, high]")
