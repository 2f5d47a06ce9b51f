"""filter.zero_variance: DAPO's dynamic sampling (Yu et al. 2025, "DAPO", §3.2, Eq. 11).

A group whose completions all got the same total reward has zero group-relative advantage
(A = (R − mean) / std is 0 for every completion), so it carries no policy gradient. The filter keeps
a group only when the rewards of its scored completions (NaN: none scored) differ by more than
``tolerance``; a group with fewer than two scored completions is dropped as well.
"""

import attrs
import torch

from plait import hookimpl
from plait.online.filtering import RolloutGroup
from plait.params import non_negative


@attrs.frozen
class ZeroVarianceParams:
    tolerance: float = attrs.field(default=0.0, validator=non_negative)  # max − min at most this counts as equal


def zero_variance(group: RolloutGroup, p: ZeroVarianceParams) -> bool:
    scored = group.rewards[~torch.isnan(group.rewards)]
    return scored.numel() >= 2 and float(scored.max() - scored.min()) > p.tolerance


@hookimpl
def register_rollout_filters(register):
    register("filter.zero_variance", zero_variance, params=ZeroVarianceParams,
             doc="drop groups whose rewards are all equal (DAPO's dynamic sampling)")
