"""Alignment via optimal transport (AOT), paired form: first-order dominance over the batch.

Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport". With
d = log π(y_c) − log π(y_r) and d_ref likewise under the reference, sorted over the batch:

    δ = sort(d) − sort(d_ref);   ℓ = −(1 − ε)·log σ(βδ) − ε·log σ(−βδ)

Matching quantiles instead of pairs asks the policy's distribution of margins to dominate the
reference's, a distributional rather than per-pair constraint; the batch must be large enough
for quantiles to mean something. Uses raw log-probs (no f-divergence); β typically 0.05–0.5,
ε ∈ [0, 0.5]. Entry k of the result belongs to the k-th quantile, not to pair k.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import in_range, positive


@attrs.frozen
class AOTParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))


def dpo_aot(batch: PreferenceLogps, p: AOTParams):
    policy = (batch.chosen_logps - batch.rejected_logps).sort(dim=0).values
    reference = (batch.ref_chosen_logps - batch.ref_rejected_logps).sort(dim=0).values
    z = p.beta * (policy - reference)
    return -(1 - p.label_smoothing) * F.logsigmoid(z) - p.label_smoothing * F.logsigmoid(-z)


@hookimpl
def register_losses(register):
    register("dpo.aot", dpo_aot, params=AOTParams, consumes=PreferenceLogps, batch_coupled=True,
             sorts_batch=True)
