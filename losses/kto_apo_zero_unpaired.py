"""Anchored preference optimisation, APO-zero, for unpaired examples.

D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive Revisions:
Addressing Underspecification in Alignment". With r = log π − log π_ref:

    desirable:    λ_D·(1 − σ(βr))
    undesirable:  λ_U·σ(βr)

KTO with the reference point fixed at zero: desirable completions become likelier than under
the reference and undesirable ones less likely. β typically 0.05–0.5; λ_D, λ_U balance classes.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import UnpairedLogps
from plait.params import non_negative, positive


@attrs.frozen
class APOZeroUnpairedParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    desirable_weight: float = attrs.field(default=1.0, validator=non_negative)
    undesirable_weight: float = attrs.field(default=1.0, validator=non_negative)


def kto_apo_zero_unpaired(batch: UnpairedLogps, p: APOZeroUnpairedParams):
    reward = (p.beta * batch.logratios).sigmoid()
    return torch.where(batch.desirable, p.desirable_weight * (1 - reward), p.undesirable_weight * reward)


@hookimpl
def register_losses(register):
    register("kto.apo_zero_unpaired", kto_apo_zero_unpaired, params=APOZeroUnpairedParams,
             consumes=UnpairedLogps)
