"""Noise contrastive alignment (NCA), pairwise form.

Chen et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit Rewards".
With r = log π − log π_ref:

    ℓ = −log σ(βr_c) − ½·log σ(−βr_c) − ½·log σ(−βr_r)

Unlike DPO it scores each completion against the reference on its own, not only the margin,
so the chosen likelihood is kept from falling along with the rejected one. β is typically
0.01–0.1. Not a function of the margin alone, so no f-divergence applies: f-DPO's β·log Z(x)
cancels only in a chosen − rejected difference.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class NCAPairParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_nca_pair(batch: PreferenceLogps, p: NCAPairParams):
    chosen, rejected = p.beta * batch.chosen_logratios, p.beta * batch.rejected_logratios
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


@hookimpl
def register_losses(register):
    register("dpo.nca_pair", dpo_nca_pair, params=NCAPairParams, consumes=PreferenceLogps)
