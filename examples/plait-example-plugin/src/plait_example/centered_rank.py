"""advantage.centered_rank: a completion's rank within its group, centred to [−½, ½].

The centred-rank fitness shaping of Salimans et al. 2017, "Evolution Strategies as a Scalable
Alternative to Reinforcement Learning", applied per prompt group where GRPO would
z-score: only the order of the rewards matters, so one outlier or a reward on another scale
cannot dominate a group. Ties share their average rank, so an all-equal group gets zeros; a
completion whose every reward is None gets 0 and is left out of the ranking.
"""

import torch

from plait import hookimpl
from plait.engine.batches import Rollout


def centered_rank(rollout: Rollout, params: None) -> torch.Tensor:
    reward = rollout.total_reward.view(-1, rollout.group_size)  # [groups, G], NaN: no reward
    valid = ~reward.isnan()
    both = valid.unsqueeze(1) & valid.unsqueeze(2)
    below = ((reward.unsqueeze(1) < reward.unsqueeze(2)) & both).sum(-1)  # [g, i]: #{j: r_j < r_i}
    ties = ((reward.unsqueeze(1) == reward.unsqueeze(2)) & both).sum(-1) - 1
    count = valid.sum(-1, keepdim=True)
    rank = (below + ties / 2) / (count - 1).clamp(min=1)  # average rank, scaled to [0, 1]
    return torch.where(valid & (count > 1), rank - 0.5, 0.0).view(-1)


@hookimpl
def register_advantage_estimators(register):
    register("advantage.centered_rank", centered_rank, zero_mean_per_group=True)
