"""CPO's IPO loss: IPO's squared loss on the policy's per-token log-probs, no reference.

Xu et al. 2024 (CPO) with the loss of Azar et al. 2023, "A General Theoretical Paradigm to
Understand Learning from Human Preferences". With ā = log π(y|x)/|y| (the per-token average, as
TRL 1.16 uses for this loss type) and u = ā (AlphaPO's (1 − e^(−αā))/α when α ≠ 0):

    ℓ = (u_c − u_r − 1/(2β))²

It regresses the margin onto 1/(2β) (β = 0.1: 5 nats per token) instead of pushing it to infinity.
"""

from functools import partial

import attrs

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import finite, positive

from ._reference_free import reward_metrics, shaped_logps


@attrs.frozen
class CPOIPOParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    alpha: float = attrs.field(default=0.0, validator=finite)


def cpo_ipo(batch: PreferenceLogps, p: CPOIPOParams):
    _, (u_c, u_r) = shaped_logps(batch, p, averaged=True)
    return (u_c - u_r - 1 / (2 * p.beta)) ** 2


@hookimpl
def register_losses(register):
    register("cpo.ipo", cpo_ipo, params=CPOIPOParams, consumes=PreferenceLogps,
             metrics=partial(reward_metrics, averaged=True))
