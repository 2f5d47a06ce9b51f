"""Anchored preference optimisation, APO-down.

D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive Revisions:
Addressing Underspecification in Alignment", eq. 8. With r = log π − log π_ref:

    ℓ = σ(βr_c) + (1 − σ(β(r_c − r_r)))

Lowers the chosen likelihood while still widening the margin: for data whose chosen outputs
are worse than the model's own. β typically 0.05–0.5. Not a function of the margin alone, so
no f-divergence applies (f-DPO's β·log Z(x) cancels only in a chosen − rejected difference).
"""

import attrs

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class APODownParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_apo_down(batch: PreferenceLogps, p: APODownParams):
    chosen, rejected = p.beta * batch.chosen_logratios, p.beta * batch.rejected_logratios
    return chosen.sigmoid() + (1 - (chosen - rejected).sigmoid())


@hookimpl
def register_losses(register):
    register("dpo.apo_down", dpo_apo_down, params=APODownParams, consumes=PreferenceLogps)
