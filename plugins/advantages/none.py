"""Dr. GRPO's unscaled advantage: A = R − mean_group(R).

Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO), §3.1:
dividing by the group std biases updates towards questions that are too easy or too hard, so the
advantage is only centred. Completions that no reward scored get zero advantage.
"""

import torch

from plait import hookimpl
from plait.engine.batches import Rollout
from plait.online.scoring import group_mean_std, total_reward


def no_scale_advantage(rollout: Rollout, params: None) -> torch.Tensor:
    reward = total_reward(rollout)
    mean, _ = group_mean_std(reward, rollout.group_size)
    return (reward - mean).nan_to_num(0.0).float()


@hookimpl
def register_advantage_estimators(register):
    register("advantage.none", no_scale_advantage, zero_mean_per_group=True)
