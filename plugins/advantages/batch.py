"""Group-centred advantage scaled by the batch std: A = (R − mean_group(R)) / (std_batch(R) + ε).

Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning" (Lite PPO): a
group std divides by tiny numbers when a group's rewards nearly agree and so over-weights easy or
hopeless prompts; one std over the whole generation batch keeps the relative scale of groups. The mean stays per group, so each group still sums to zero.
Completions that no reward scored get zero advantage and are left out of both statistics.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import Rollout
from plait.online.scoring import group_mean_std, nan_mean_std, total_reward
from plait.params import positive


@attrs.frozen
class BatchParams:
    epsilon: float = attrs.field(default=1e-4, validator=positive)


def batch_advantage(rollout: Rollout, p: BatchParams) -> torch.Tensor:
    reward = total_reward(rollout)
    mean, _ = group_mean_std(reward, rollout.group_size)
    _, std = nan_mean_std(reward, dim=0)
    return ((reward - mean) / (std + p.epsilon)).nan_to_num(0.0).float()


@hookimpl
def register_advantage_estimators(register):
    register("advantage.batch", batch_advantage, params=BatchParams, zero_mean_per_group=True)
