"""DPO's sigmoid loss, and its conservative form (cDPO) for noisy labels.

Rafailov et al. 2023, "Direct Preference Optimization", eq. 7. With Δ the f-divergence margin
s_c − s_r:

    sigmoid:  ℓ = −log σ(βΔ)
    cdpo:     ℓ = −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ)

cDPO (Mitchell 2023, "A note on DPO with noisy preferences") trains on labels smoothed by ε,
the assumed probability that a preference is flipped, so the margin stops growing once
σ(βΔ) = 1 − ε. ``dpo.sigmoid`` takes no ε: DPOConfig's label_smoothing reaches only the losses
that take it (cdpo, robust, exo_pair, aot, aot_unpaired), as in TRL 1.16. β (typically
0.05–0.5) sets how far the policy may move from the reference; ε ∈ [0, 0.5].
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.batches import PreferenceLogps
from plait.params import in_range, positive


@attrs.frozen
class SigmoidParams:
    beta: float = attrs.field(default=0.1, validator=positive)


@attrs.frozen
class CDPOParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))


def dpo_sigmoid(batch: PreferenceLogps, p: SigmoidParams):
    return -F.logsigmoid(p.beta * batch.margin)


def dpo_cdpo(batch: PreferenceLogps, p: CDPOParams):
    z = p.beta * batch.margin
    return -(1 - p.label_smoothing) * F.logsigmoid(z) - p.label_smoothing * F.logsigmoid(-z)


@hookimpl
def register_losses(register):
    register("dpo.sigmoid", dpo_sigmoid, params=SigmoidParams, consumes=PreferenceLogps,
             monotone="non_increasing_in_margin", f_divergence=True)
    # not monotone: with ε > 0 the loss is least at σ(βΔ) = 1 − ε and rises beyond it
    register("dpo.cdpo", dpo_cdpo, params=CDPOParams, consumes=PreferenceLogps, f_divergence=True)
