"""SAPO: a smooth sigmoid gate on the ratio instead of a hard clip.

Gao et al. 2025, "Soft Adaptive Policy Optimization", eq. 6. Per token:

    L_t = −σ(τ·(ρ − 1))·(4/τ)·A,   τ = τ_pos if A > 0 else τ_neg

At ρ = 1 the gradient equals the unclipped surrogate's; it then decays smoothly as ρ leaves 1
instead of dropping to zero at a boundary. τ_neg > τ_pos damps negative updates faster.
Normalised as ``grpo``. Returns a scalar.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import PolicyTokens
from plait.params import positive

from ._grpo import ClipParams, log_ratio, regularise, sequence_mean


@attrs.frozen
class SAPOParams(ClipParams):
    sapo_temperature_pos: float = attrs.field(default=1.0, validator=positive)
    sapo_temperature_neg: float = attrs.field(default=1.05, validator=positive)


def grpo_sapo(batch: PolicyTokens, p: SAPOParams):
    ratio = torch.exp(log_ratio(batch, p.importance_sampling_level))
    advantages = batch.token_advantages
    tau = torch.where(advantages > 0, p.sapo_temperature_pos, p.sapo_temperature_neg)
    per_token = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * advantages
    return sequence_mean(regularise(per_token, batch, p), batch)


@hookimpl
def register_losses(register):
    register("grpo.sapo", grpo_sapo, params=SAPOParams, consumes=PolicyTokens, output="scalar")
