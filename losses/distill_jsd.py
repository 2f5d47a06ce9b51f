"""Generalised Jensen-Shannon divergence between a student's and a teacher's next-token distributions.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD), §3, eq. 1–2. With p_s the student's and p_t the teacher's distribution at one
position (both at the method's temperature) and the mixture m = (1 − β)·p_s + β·p_t:

    β = 0        KL(p_t ‖ p_s)                          forward KL: the student covers the teacher's mass
    β = 1        KL(p_s ‖ p_t)                          reverse KL: the student seeks the teacher's modes
    0 < β < 1    JSD_β = β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m)

The end points are the two KLs themselves (the mixture formula vanishes there). log m is a
logsumexp of log-probs, so near one-hot distributions stay finite. Typical β: 0.5 (GKD's JSD),
1.0 for on-policy reverse-KL distillation. Input: a :class:`~plait.engine.batches.TokenDistributions`
of N positions × V tokens; returns one divergence per position, ``[N]``, in float32.
"""

import math

import attrs
import torch
from torch import Tensor

from plait import hookimpl
from plait.engine.batches import TokenDistributions
from plait.params import in_range


@attrs.frozen
class JSDParams:
    beta: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p ‖ q) = Σ_v p_v (log p_v − log q_v) over the last dimension."""
    return (logp.exp() * (logp - logq)).sum(-1)


def _finite(logp: Tensor) -> Tensor:
    # A model that masks tokens with −inf logits gives log p = −inf where p = 0; 0·(−inf) is NaN.
    logp = logp.float()
    return torch.nan_to_num(logp, neginf=torch.finfo(logp.dtype).min)


def distill_jsd(batch: TokenDistributions, p: JSDParams) -> Tensor:
    student, teacher = _finite(batch.logps), _finite(batch.teacher_logps)
    if p.beta == 0.0:
        return _kl(teacher, student)
    if p.beta == 1.0:
        return _kl(student, teacher)
    log_m = torch.logaddexp(student + math.log(1 - p.beta), teacher + math.log(p.beta))
    return p.beta * _kl(teacher, log_m) + (1 - p.beta) * _kl(student, log_m)


@hookimpl
def register_losses(register):
    register("distill.jsd", distill_jsd, params=JSDParams, consumes=TokenDistributions, output="example",
             doc="Generalised JSD (β=0 forward KL, β=1 reverse KL) between student and teacher, per position")
