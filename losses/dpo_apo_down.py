"""Anchored preference optimisation, APO-down.

D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive Revisions:
Addressing Underspecification in Alignment". With r_c = log π(y_c) − log π_ref(y_c) and Δ the
f-divergence margin s_c − s_r:

    ℓ = σ(βr_c) + (1 − σ(βΔ))

Lowers the chosen likelihood while still widening the margin: for data whose chosen outputs
are worse than the model's own. β typically 0.05–0.5. Not a function of the margin alone.
"""

import attrs

from plait import hookimpl
from plait.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class APODownParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_apo_down(batch: PreferenceLogps, p: APODownParams):
    return (p.beta * batch.chosen_logratios).sigmoid() + (1 - (p.beta * batch.margin).sigmoid())


@hookimpl
def register_losses(register):
    register("dpo.apo_down", dpo_apo_down, params=APODownParams, consumes=PreferenceLogps)
