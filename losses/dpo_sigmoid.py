"""DPO's sigmoid loss, with label smoothing as conservative DPO (cDPO).

Rafailov et al. 2023, "Direct Preference Optimization", eq. 7; Mitchell 2023, "A note on DPO
with noisy preferences" (cDPO). With Δ the f-divergence margin s_c − s_r:

    ℓ = −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ)

β (typically 0.05–0.5) sets how far the policy may move from the reference; ε ∈ [0, 0.5] is
the assumed probability that a preference label is flipped.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.batches import PreferenceLogps
from plait.params import in_range, positive


@attrs.frozen
class SigmoidParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))


def dpo_sigmoid(batch: PreferenceLogps, p: SigmoidParams):
    z = p.beta * batch.margin
    return -(1 - p.label_smoothing) * F.logsigmoid(z) - p.label_smoothing * F.logsigmoid(-z)


@hookimpl
def register_losses(register):
    register("dpo.sigmoid", dpo_sigmoid, params=SigmoidParams, consumes=PreferenceLogps,
             monotone="non_increasing_in_margin")
