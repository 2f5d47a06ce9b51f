"""Binary classifier optimisation (BCO), pairwise form.

Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment". With
s = f(r) the f-divergence scores:

    ℓ = −log σ(βs_c) − log σ(−βs_r)

A logistic classifier with the implicit reward βs as its logit: chosen completions are
pushed above zero and rejected ones below, each on its own. β is typically 0.05–0.5. Not a
function of the margin alone.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.batches import PreferenceLogps
from plait.params import positive


@attrs.frozen
class BCOPairParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def dpo_bco_pair(batch: PreferenceLogps, p: BCOPairParams):
    return -F.logsigmoid(p.beta * batch.chosen_scores) - F.logsigmoid(-p.beta * batch.rejected_scores)


@hookimpl
def register_losses(register):
    register("dpo.bco_pair", dpo_bco_pair, params=BCOPairParams, consumes=PreferenceLogps)
