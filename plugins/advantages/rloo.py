"""REINFORCE Leave-One-Out: each completion's baseline is the mean reward of the others.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs", eq. 6 (after Kool et al. 2019): for G scored completions of a prompt,

    b_i = (Σ_group R − R_i) / (G − 1),   A_i = R_i − b_i = G/(G−1)·(R_i − mean_group(R))

The baseline excludes R_i, so A_i is an unbiased estimate. Completions that no reward scored are
left out of G and get A = 0, as does a completion with no scored neighbour. ``normalize`` z-scores
the advantages over the batch (RLOO's normalize_advantages).
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import Rollout
from plait.online.scoring import group_mean_std, nan_mean_std, total_reward
from plait.params import positive


@attrs.frozen
class RlooParams:
    normalize: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    epsilon: float = attrs.field(default=1e-4, validator=positive)


def rloo_advantage(rollout: Rollout, p: RlooParams) -> torch.Tensor:
    reward = total_reward(rollout)
    mean, _ = group_mean_std(reward, rollout.group_size)
    scored = (~reward.isnan()).float().view(-1, rollout.group_size)
    count = scored.sum(dim=1, keepdim=True).expand_as(scored).reshape(-1)  # G: scored completions of the group
    advantage = (count / (count - 1).clamp(min=1)) * (reward - mean)
    advantage = advantage.masked_fill(count < 2, 0.0).nan_to_num(0.0)
    if p.normalize:
        valid = ~reward.isnan()
        mean, std = nan_mean_std(advantage.masked_fill(~valid, float("nan")), dim=0)
        advantage = torch.where(valid, (advantage - mean.nan_to_num(0.0)) / (std + p.epsilon), 0.0)
    return advantage.float()


@hookimpl
def register_advantage_estimators(register):
    register("advantage.rloo", rloo_advantage, params=RlooParams, zero_mean_per_group=True)
