"""Self-play preference optimisation (SPPO) with hard labels.

Wu et al. 2024, "Self-Play Preference Optimization for Language Model Alignment", with the
win probabilities of chosen/rejected set to 1 and 0. With r = log π − log π_ref:

    ℓ = (r_c − 1/(2β))² + (r_r + 1/(2β))²

Regresses each log-ratio onto a fixed target, +1/(2β) for the winner and −1/(2β) for the
loser, so the chosen likelihood is raised in absolute terms; β is typically 0.01–0.5
(smaller β, farther targets). Not monotone in the margin, and no f-divergence applies: f-DPO's
β·log Z(x) cancels only in a chosen − rejected difference.
"""

import attrs

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class SPPOHardParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_sppo_hard(batch: PreferenceLogps, p: SPPOHardParams):
    target = 1 / (2 * p.beta)
    return (batch.chosen_logratios - target) ** 2 + (batch.rejected_logratios + target) ** 2


@hookimpl
def register_losses(register):
    register("dpo.sppo_hard", dpo_sppo_hard, params=SPPOHardParams, consumes=PreferenceLogps)
