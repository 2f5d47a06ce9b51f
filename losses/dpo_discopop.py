"""DiscoPOP: the log-ratio modulated loss found by LLM-driven objective discovery.

Lu et al. 2024, "Discovering Preference Optimization Algorithms with and for Large Language
Models" (LRML). With z = βΔ, Δ the f-divergence margin, and m = σ(z/τ):

    ℓ = (1 − m)·(−log σ(z)) + m·exp(−z)

A blend of DPO's logistic loss (small margins) and an exponential loss (large ones), switched
by a sharp sigmoid of temperature τ (0.05 in the paper; τ > 0). Non-convex, and not monotone
in Δ: near z = 0 the switch briefly raises the loss. β typically 0.05–0.5. τ is DPOConfig's
``discopop_tau`` (TRL's name, shared into this loss like ``beta``) unless the loss entry sets it.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class DiscoPOPParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    discopop_tau: float = attrs.field(default=0.05, validator=positive)


def dpo_discopop(batch: PreferenceLogps, p: DiscoPOPParams):
    z = p.beta * batch.margin
    # m·exp(−z) is formed in log space: for z ≪ 0, m underflows to 0 while exp(−z) overflows.
    return (-z / p.discopop_tau).sigmoid() * F.softplus(-z) + (F.logsigmoid(z / p.discopop_tau) - z).exp()


@hookimpl
def register_losses(register):
    register("dpo.discopop", dpo_discopop, params=DiscoPOPParams, consumes=PreferenceLogps, f_divergence=True)
