"""Identity preference optimisation (IPO).

Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
Preferences" (the sampled IPO loss). With s = f(r) the f-divergence scores and |y| the
completion lengths:

    ℓ = (s_c/|y_c| − s_r/|y_r| − 1/(2β))²

A squared loss regresses the length-normalised margin onto 1/(2β) instead of pushing it to
infinity, so IPO does not overfit deterministic preferences; β is typically 0.01–0.5 (larger
β, smaller target margin). Not monotone in the margin: overshooting the target costs too.
"""

import attrs

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class IPOParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_ipo(batch: PreferenceLogps, p: IPOParams):
    # clamp(min=1): an empty completion would otherwise divide 0 by 0
    normalised = batch.chosen_scores / batch.chosen_lengths.clamp(min=1) \
        - batch.rejected_scores / batch.rejected_lengths.clamp(min=1)
    return (normalised - 1 / (2 * p.beta)) ** 2


@hookimpl
def register_losses(register):
    register("dpo.ipo", dpo_ipo, params=IPOParams, consumes=PreferenceLogps, f_divergence=True)
