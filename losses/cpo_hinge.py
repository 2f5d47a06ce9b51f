"""CPO's hinge loss: the SLiC hinge on the policy's own log-probs, no reference.

Xu et al. 2024 (CPO) with the hinge of Zhao et al. 2023, "SLiC-HF: Sequence Likelihood
Calibration with Human Feedback" (rank calibration loss). With ℓ = log π(y|x) summed over the
completion and u = ℓ (AlphaPO's (1 − e^(−αℓ))/α when α ≠ 0, as TRL 1.16):

    ℓ = max(0, 1 − β(u_c − u_r))

A pair stops contributing once its margin reaches 1/β.
"""

from functools import partial

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import finite, positive

from ._reference_free import reward_metrics, shaped_logps


@attrs.frozen
class CPOHingeParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    alpha: float = attrs.field(default=0.0, validator=finite)


def cpo_hinge(batch: PreferenceLogps, p: CPOHingeParams):
    _, (u_c, u_r) = shaped_logps(batch, p, averaged=False)
    return torch.relu(1 - p.beta * (u_c - u_r))


@hookimpl
def register_losses(register):
    register("cpo.hinge", cpo_hinge, params=CPOHingeParams, consumes=PreferenceLogps,
             monotone="non_increasing_in_margin", metrics=partial(reward_metrics, averaged=False))
