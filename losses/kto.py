"""Kahneman-Tversky optimisation (KTO): a preference loss for unpaired good/bad examples.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization". With
r = log π − log π_ref and z the detached batch estimate of KL(π‖π_ref) (clamped at 0):

    desirable:    λ_D·(1 − σ(β(r − z)))
    undesirable:  λ_U·(1 − σ(β(z − r)))

z is the reference point of prospect theory: an example counts as a gain only when it beats
what the policy already does on average. β is typically 0.05–0.5; set λ_D, λ_U so that
λ_D·n_D / (λ_U·n_U) lies in [1, 4/3] when the classes are imbalanced.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import UnpairedLogps
from plait.params import non_negative, positive


@attrs.frozen
class KTOParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    desirable_weight: float = attrs.field(default=1.0, validator=non_negative)
    undesirable_weight: float = attrs.field(default=1.0, validator=non_negative)


def kto(batch: UnpairedLogps, p: KTOParams):
    gain = p.beta * (batch.logratios - batch.kl_logratio)
    return torch.where(batch.desirable, p.desirable_weight * (1 - gain.sigmoid()),
                       p.undesirable_weight * (1 - (-gain).sigmoid()))


@hookimpl
def register_losses(register):
    register("kto.kto", kto, params=KTOParams, consumes=UnpairedLogps)
