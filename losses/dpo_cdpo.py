"""Conservative DPO (cDPO): the sigmoid loss on labels smoothed for noise.

Mitchell 2023, "A note on DPO with noisy preferences"; Rafailov et al. 2023, eq. 7. With Δ the
f-divergence margin s_c − s_r and ε the assumed probability that a preference label is flipped:

    ℓ = −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ)

The margin stops growing once σ(βΔ) = 1 − ε. β typically 0.05–0.5; ε ∈ [0, 0.5].
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import in_range, positive


@attrs.frozen
class CDPOParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))


def dpo_cdpo(batch: PreferenceLogps, p: CDPOParams):
    z = p.beta * batch.margin
    return -(1 - p.label_smoothing) * F.logsigmoid(z) - p.label_smoothing * F.logsigmoid(-z)


@hookimpl
def register_losses(register):
    # not monotone: with ε > 0 the loss is least at σ(βΔ) = 1 − ε and rises beyond it
    register("dpo.cdpo", dpo_cdpo, params=CDPOParams, consumes=PreferenceLogps, f_divergence=True)
