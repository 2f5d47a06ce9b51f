"""DPO's sigmoid loss on length-normalised scores.

Rafailov et al. 2023, "Direct Preference Optimization", eq. 7, with each score divided by its
completion length as in the length-normalised reward of Meng et al. 2024, "SimPO: Simple
Preference Optimization with a Reference-Free Reward" (the reference is kept here):

    ℓ = −log σ(β·(s_c/|y_c| − s_r/|y_r|))

Normalising removes DPO's incentive to prefer longer completions. Per-token scores are small,
so β is typically larger than for plain DPO (SimPO uses 2–10). Not a function of Δ = s_c − s_r alone.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class SigmoidNormParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_sigmoid_norm(batch: PreferenceLogps, p: SigmoidNormParams):
    # clamp(min=1): an empty completion would otherwise divide 0 by 0
    margin = batch.chosen_scores / batch.chosen_lengths.clamp(min=1) \
        - batch.rejected_scores / batch.rejected_lengths.clamp(min=1)
    return -F.logsigmoid(p.beta * margin)


@hookimpl
def register_losses(register):
    register("dpo.sigmoid_norm", dpo_sigmoid_norm, params=SigmoidNormParams, consumes=PreferenceLogps,
             f_divergence=True)
