"""DPO's sigmoid loss.

Rafailov et al. 2023, "Direct Preference Optimization", eq. 7. With Δ the f-divergence margin
s_c − s_r:

    ℓ = −log σ(βΔ)

β (typically 0.05–0.5) sets how far the policy may move from the reference. It takes no label
smoothing: as in TRL 1.16, DPOConfig's label_smoothing reaches only the losses that take it
(``dpo.cdpo``, robust, exo_pair, aot, aot_unpaired).
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class SigmoidParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_sigmoid(batch: PreferenceLogps, p: SigmoidParams):
    return -F.logsigmoid(p.beta * batch.margin)


@hookimpl
def register_losses(register):
    register("dpo.sigmoid", dpo_sigmoid, params=SigmoidParams, consumes=PreferenceLogps,
             monotone="non_increasing_in_margin", f_divergence=True)
