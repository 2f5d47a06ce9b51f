"""SimPO: a reference-free DPO variant on length-normalised log-probs, with a target margin γ.

Meng, Xia & Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
eq. 6. The implicit reward is the average token log-prob, β·log π(y|x)/|y|, and the chosen
completion must beat the rejected one by at least γ:

    ℓ = −log σ(β·log π(y_c|x)/|y_c| − β·log π(y_r|x)/|y_r| − γ)

The paper's setups use β of a few units (2–10) and γ ≈ 0.5–1.5.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import non_negative, positive


@attrs.frozen
class SimPOParams:
    beta: float = attrs.field(default=2.0, validator=positive)
    gamma: float = attrs.field(default=1.0, validator=non_negative)


def simpo(batch: PreferenceLogps, p: SimPOParams):
    # clamp(min=1): an empty completion has log-prob 0 and length 0
    chosen = batch.chosen_logps / batch.chosen_lengths.clamp(min=1)
    rejected = batch.rejected_logps / batch.rejected_lengths.clamp(min=1)
    return -F.logsigmoid(p.beta * (chosen - rejected) - p.gamma)


@hookimpl
def register_losses(register):
    register("dpo.simpo", simpo, params=SimPOParams, consumes=PreferenceLogps,
             monotone="non_increasing_in_margin")
