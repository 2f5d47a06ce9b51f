"""Anchored preference optimisation, APO-zero.

D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive Revisions:
Addressing Underspecification in Alignment". With r = log π − log π_ref:

    ℓ = (1 − σ(βr_c)) + σ(βr_r)

Anchored at zero: raises the chosen likelihood and lowers the rejected one, each relative to
the reference. Use it when chosen outputs are better than the model's own (e.g. from a
stronger model). Uses raw log-ratios (no f-divergence); β typically 0.05–0.5.
"""

import attrs

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class APOZeroParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_apo_zero(batch: PreferenceLogps, p: APOZeroParams):
    return (1 - (p.beta * batch.chosen_logratios).sigmoid()) + (p.beta * batch.rejected_logratios).sigmoid()


@hookimpl
def register_losses(register):
    register("dpo.apo_zero", dpo_apo_zero, params=APOZeroParams, consumes=PreferenceLogps)
