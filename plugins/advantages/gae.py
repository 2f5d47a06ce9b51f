"""Generalised advantage estimation over the tokens of each completion.

Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", eq. 16. With per-token rewards r_t, value estimates V_t and a mask m that keeps a
prefix of each row (its completion tokens):

    δ_t = r_t + γ·V_{t+1} − V_t            V_{t+1} = 0 past the last kept token
    A_t = δ_t + γλ·A_{t+1}                 A = 0 past the last kept token

γ = 1, λ = 0.95 are the RLHF defaults (Ziegler et al. 2019). Returns raw advantages ``[N, T]``
(0 where the mask is 0): the method forms the value targets R = A + V from them and whitens the
advantages itself. Reads ``rollout.token_rewards``, ``rollout.values`` and ``rollout.mask``.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import Rollout
from plait.errors import PlaitError
from plait.params import in_range


@attrs.frozen
class GAEParams:
    gamma: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    lam: float = attrs.field(default=0.95, validator=in_range(0.0, 1.0))


def gae_advantage(rollout: Rollout, p: GAEParams) -> torch.Tensor:
    if rollout.token_rewards is None or rollout.values is None or rollout.mask is None:
        raise PlaitError("advantage.gae needs per-token token_rewards, values and mask in the Rollout; use it with a "
                         "method that has a value model (ppo), or pick a sequence-level estimator")
    dtype = torch.promote_types(rollout.token_rewards.dtype, torch.float32)
    mask = rollout.mask.to(dtype)
    rewards, values = rollout.token_rewards.to(dtype) * mask, rollout.values.to(dtype) * mask
    # Shifting by one column makes "the next token's value" 0 past the end of each row.
    next_values = torch.cat([values[:, 1:], values.new_zeros(values.shape[0], 1)], dim=1)
    next_kept = torch.cat([mask[:, 1:], mask.new_zeros(mask.shape[0], 1)], dim=1)
    deltas = rewards + p.gamma * next_values - values
    advantages = torch.zeros_like(deltas)
    running = deltas.new_zeros(deltas.shape[0])
    for t in reversed(range(deltas.shape[1])):
        running = deltas[:, t] + p.gamma * p.lam * running * next_kept[:, t]
        advantages[:, t] = running * mask[:, t]
    return advantages


@hookimpl
def register_advantage_estimators(register):
    register("advantage.gae", gae_advantage, params=GAEParams, token_level=True,
             doc="Generalised advantage estimation from per-token rewards and values (PPO)")
