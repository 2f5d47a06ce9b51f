"""GRPO's group-relative advantage: A = (R − mean_group(R)) / (std_group(R) + ε).

Shao et al. 2024, "DeepSeekMath" (GRPO), §4.1.2, outcome supervision: each completion is scored
against the other completions of its prompt, so no value network is needed. The std is the
unbiased std of the group's R; a group whose rewards are all equal gets zero advantage, and so
does a completion that no reward scored (every reward None). ``scale=False`` keeps the centring
only (the same as ``advantage.none``).
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import Rollout
from plait.online.scoring import group_mean_std, total_reward
from plait.params import positive


@attrs.frozen
class GroupParams:
    scale: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    epsilon: float = attrs.field(default=1e-4, validator=positive)


def group_advantage(rollout: Rollout, p: GroupParams) -> torch.Tensor:
    reward = total_reward(rollout)
    mean, std = group_mean_std(reward, rollout.group_size)
    advantage = reward - mean
    if p.scale:
        advantage = advantage / (std + p.epsilon)
    return advantage.nan_to_num(0.0).float()  # rows with no score (R = NaN) carry no signal


@hookimpl
def register_advantage_estimators(register):
    register("advantage.group", group_advantage, params=GroupParams, zero_mean_per_group=True)
