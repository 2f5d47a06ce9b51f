"""PPO's clipped surrogate policy loss, per token.

Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7, written as a loss:

    ρ_t = π(y_t) / π_old(y_t),    L_t = max(−A_t·ρ_t, −A_t·clip(ρ_t, 1 − ε, 1 + ε))

ε = cliprange (0.2). The max keeps the pessimistic branch, so a step gains nothing from moving
ρ beyond the clip range in the direction the advantage favours. Input: a
:class:`~plait.engine.batches.PolicyTokens` with per-token advantages (GAE) or one per sequence;
returns ``[B, T]``, which the method averages over the completion tokens of its minibatch.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import PolicyTokens
from plait.params import positive


@attrs.frozen
class PPOPolicyParams:
    cliprange: float = attrs.field(default=0.2, validator=positive)


def ppo_policy(batch: PolicyTokens, p: PPOPolicyParams) -> torch.Tensor:
    ratio = torch.exp(batch.logps - batch.old_logps)
    advantages = batch.token_advantages
    clipped = torch.clamp(ratio, 1 - p.cliprange, 1 + p.cliprange)
    return torch.maximum(-advantages * ratio, -advantages * clipped)


@hookimpl
def register_losses(register):
    register("ppo.policy", ppo_policy, params=PPOPolicyParams, consumes=PolicyTokens, output="token",
             doc="PPO clipped surrogate: max(−A·ρ, −A·clip(ρ, 1±ε)) per token")
