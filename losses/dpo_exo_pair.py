"""Efficient exact optimisation (EXO), pairwise form.

Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment". With
p = σ(βΔ), Δ = s_c − s_r the f-divergence margin:

    ℓ = p·[log p − log(1 − ε)] + (1 − p)·[log(1 − p) − log ε] = KL(Bern(p) ‖ Bern(1 − ε))

Where DPO minimises the forward KL to the preference labels, EXO minimises the reverse KL, so
it is mode-seeking; the minimum sits at p = 1 − ε, not at p = 1. ε must be > 0: 0 (DPOConfig's
default) means the paper's recommended 1e-3, where TRL 1.16 refuses it; β is typically 0.05–0.5.
"""

import math

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import in_range, positive


@attrs.frozen
class ExoPairParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=1e-3, converter=lambda e: 1e-3 if e == 0 else e,
                                         validator=in_range(0.0, 0.5, low_open=True))


def dpo_exo_pair(batch: PreferenceLogps, p: ExoPairParams):
    z, eps = p.beta * batch.margin, p.label_smoothing
    return z.sigmoid() * (F.logsigmoid(z) - math.log(1 - eps)) \
        + (-z).sigmoid() * (F.logsigmoid(-z) - math.log(eps))


@hookimpl
def register_losses(register):
    register("dpo.exo_pair", dpo_exo_pair, params=ExoPairParams, consumes=PreferenceLogps, f_divergence=True)
