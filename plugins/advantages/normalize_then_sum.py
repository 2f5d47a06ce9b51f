"""GDPO: z-score each reward within its group, take the weighted sum, then z-score over the batch.

Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward
RL Optimization" (arXiv 2601.05242): normalising the summed reward lets distinct reward
combinations collapse onto one advantage (format 1 + correctness 0 looks like format 0 +
correctness 1); normalising each reward within its group first keeps them apart. For reward k of completion i in group g:

    z_ik = (r_ik − mean_g(r_k)) / (std_g(r_k) + ε),   S_i = Σ_k w_k·z_ik,
    A_i = (S_i − mean_batch(S)) / (std_batch(S) + ε)

A None score contributes nothing to S; a completion with no score at all gets A = 0.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import Rollout
from plait.online.scoring import check_groups, nan_mean_std
from plait.params import positive


@attrs.frozen
class NormalizeThenSumParams:
    epsilon: float = attrs.field(default=1e-4, validator=positive)


def normalize_then_sum_advantage(rollout: Rollout, p: NormalizeThenSumParams) -> torch.Tensor:
    rewards = rollout.rewards.double()  # [N, K]; float64 as in plait.online.scoring.nan_mean_std
    n, k = rewards.shape
    check_groups(n, rollout.group_size)
    grouped = rewards.view(-1, rollout.group_size, k)
    mean, std = nan_mean_std(grouped, dim=1, keepdim=True)
    z = ((grouped - mean) / (std + p.epsilon)).view(n, k)
    unscored = rewards.isnan().all(dim=1)
    summed = (z * rollout.weights.double()).nansum(dim=1).masked_fill(unscored, float("nan"))
    batch_mean, batch_std = nan_mean_std(summed, dim=0)
    return ((summed - batch_mean) / (batch_std + p.epsilon)).nan_to_num(0.0).float()


@hookimpl
def register_advantage_estimators(register):
    register("advantage.normalize_then_sum", normalize_then_sum_advantage, params=NormalizeThenSumParams,
             zero_mean_per_group=True)
