"""Alignment via optimal transport (AOT), unpaired form: chosen log-ratios dominate rejected ones.

Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport". With
r the log-ratios log π − log π_ref, sorted over the batch separately:

    δ = sort(r_c) − sort(r_r);   ℓ = −(1 − ε)·log σ(βδ) − ε·log σ(−βδ)

Each quantile of the chosen rewards is pushed above the same quantile of the rejected ones,
so the data need not be paired. Registered as ``dpo.aot_unpaired`` and under TRL's older name
``dpo.aot_pair``. β typically 0.05–0.5, ε ∈ [0, 0.5]; entry k belongs to the k-th quantile.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import in_range, positive


@attrs.frozen
class AOTUnpairedParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))


def dpo_aot_unpaired(batch: PreferenceLogps, p: AOTUnpairedParams):
    z = p.beta * (batch.chosen_logratios.sort(dim=0).values - batch.rejected_logratios.sort(dim=0).values)
    return -(1 - p.label_smoothing) * F.logsigmoid(z) - p.label_smoothing * F.logsigmoid(-z)


@hookimpl
def register_losses(register):
    for name in ("dpo.aot_unpaired", "dpo.aot_pair"):
        register(name, dpo_aot_unpaired, params=AOTUnpairedParams, consumes=PreferenceLogps,
                 batch_coupled=True, sorts_batch=True)
