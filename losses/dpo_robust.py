"""Robust DPO (rDPO): an unbiased DPO loss under label noise.

Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with Noisy Feedback".
With Δ the f-divergence margin s_c − s_r and ε the probability a label is flipped:

    ℓ = [−(1 − ε)·log σ(βΔ) + ε·log σ(−βΔ)] / (1 − 2ε)

Its expectation over noisy labels equals the clean DPO loss; unlike cDPO it stays decreasing
in Δ for every ε. ε ∈ [0, 0.5) (at 0.5 labels carry no signal); β typically 0.05–0.5.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import in_range, positive


@attrs.frozen
class RobustParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5, high_open=True))


def dpo_robust(batch: PreferenceLogps, p: RobustParams):
    z, eps = p.beta * batch.margin, p.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


@hookimpl
def register_losses(register):
    register("dpo.robust", dpo_robust, params=RobustParams, consumes=PreferenceLogps,
             monotone="non_increasing_in_margin", f_divergence=True)
