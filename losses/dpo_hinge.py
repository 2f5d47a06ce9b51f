"""DPO's hinge loss (SLiC / RSO).

Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback" (rank
calibration loss); Liu et al. 2024, "Statistical Rejection Sampling Improves Preference
Optimization" (the hinge loss on normalised likelihoods). With Δ the f-divergence margin s_c − s_r:

    ℓ = max(0, 1 − βΔ)

A pair stops contributing once its margin reaches 1/β, so β (typically 0.05–0.5) sets the
target margin: the smaller β, the wider the policy must separate chosen from rejected.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class HingeParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_hinge(batch: PreferenceLogps, p: HingeParams):
    return torch.relu(1 - p.beta * batch.margin)


@hookimpl
def register_losses(register):
    register("dpo.hinge", dpo_hinge, params=HingeParams, consumes=PreferenceLogps,
             monotone="non_increasing_in_margin", f_divergence=True)
