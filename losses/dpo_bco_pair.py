"""Binary classifier optimisation (BCO), pairwise form.

Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment". With
r = log π − log π_ref:

    ℓ = −log σ(βr_c) − log σ(−βr_r)

A logistic classifier with the implicit reward βr as its logit: chosen completions are
pushed above zero and rejected ones below, each on its own. β is typically 0.05–0.5. Not a
function of the margin alone, so no f-divergence applies: f-DPO's β·log Z(x) cancels only in
a chosen − rejected difference.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class BCOPairParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_bco_pair(batch: PreferenceLogps, p: BCOPairParams):
    return -F.logsigmoid(p.beta * batch.chosen_logratios) - F.logsigmoid(-p.beta * batch.rejected_logratios)


@hookimpl
def register_losses(register):
    register("dpo.bco_pair", dpo_bco_pair, params=BCOPairParams, consumes=PreferenceLogps)
