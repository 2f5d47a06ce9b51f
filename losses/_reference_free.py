"""What the reference-free preference losses (ORPO, CPO, SimPO, AlphaPO) share.

They read the policy's own log-probs in a :class:`plait.engine.batches.PreferenceLogps`, never the
reference's: ℓ = log π(y|x), summed over the completion or averaged per token (ā = ℓ/|y|).
Each registers ``metrics=`` (what TRL 1.16 logs for it, per pair: its shaped rewards in place of the
preference family's default β·log π), which the objective averages.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from plait.engine.batches import PreferenceLogps, preference_metrics


def policy_logps(batch: PreferenceLogps, averaged: bool) -> tuple[Tensor, Tensor]:
    """(ℓ_c, ℓ_r): summed completion log-probs, or per token (clamp(min=1): an empty completion gives 0)."""
    if not averaged:
        return batch.chosen_logps, batch.rejected_logps
    return (batch.chosen_logps / batch.chosen_lengths.clamp(min=1),
            batch.rejected_logps / batch.rejected_lengths.clamp(min=1))


def alpha_reward(logps: Tensor, alpha: float) -> Tensor:
    """AlphaPO's reward shape (Gupta et al. 2025, "AlphaPO: Reward Shape Matters for LLM Alignment"):
    u = (1 − π^−α)/α = (1 − exp(−α·ℓ))/α, with ℓ itself at α = 0 (its limit)."""
    if alpha == 0:
        return logps
    # an exponential of log-probs: in float32 at least (float16 overflows at e^11), with the exponent
    # clamped so |u| stays finite (as the alpha-divergence does); saturated entries get zero gradient
    logps = logps.to(torch.promote_types(logps.dtype, torch.float32))
    bound = math.log(torch.finfo(logps.dtype).max * abs(alpha) / 4.0)
    return -torch.expm1((-alpha * logps).clamp(max=bound)) / alpha


def smoothed_sigmoid_loss(z: Tensor, label_smoothing: float) -> Tensor:
    """−(1 − ε)·log σ(z) − ε·log σ(−z): the logistic loss on labels flipped with probability ε."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def shaped_logps(batch: PreferenceLogps, p, averaged: bool) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """((ℓ_c, ℓ_r), (u_c, u_r)): ℓ summed or per token, u its AlphaPO shape with ``p.alpha`` (u = ℓ
    when the loss has no ``alpha``)."""
    logps = policy_logps(batch, averaged)
    alpha = getattr(p, "alpha", 0.0)
    return logps, (alpha_reward(logps[0], alpha), alpha_reward(logps[1], alpha))


def reward_metrics(batch: PreferenceLogps, p, *, averaged: bool) -> dict[str, Tensor]:
    """TRL 1.16's metrics of a CPO loss per pair: rewards/* of β·u, logps/* = ℓ."""
    logps, (u_c, u_r) = shaped_logps(batch, p, averaged)
    return preference_metrics((p.beta * u_c, p.beta * u_r), logps)
