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


def _finite(logp: Tensor) -> Tensor:
    # A model that masks tokens with −inf logits gives log p = −inf where p = 0; 0·(−inf) is NaN.
    logp = logp.float()
    return torch.nan_to_num(logp, neginf=torch.finfo(logp.dtype).min)


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p ‖ q) = Σ_v p_v (log p_v − log q_v) over the last dimension."""
    return (logp.exp() * (logp - logq)).sum(-1)


class _Divergence(torch.autograd.Function):
    """The divergence with its gradient written out: one fused pass over [N, V] in the backward
    instead of autograd's chain through every intermediate (a third of a GKD step went there).

    With ``s`` the student's log-probs taken as free coordinates (the log-softmax before them
    projects the gradient back onto the simplex) and log m as above:

        ∂JSD_β/∂s_v = (1 − β)·p_s,v·(s_v − log m_v)     (each KL's "+1" cancels the mixture's own)
        ∂KL(p_t ‖ p_s)/∂s_v = −p_t,v                    ∂KL(p_s ‖ p_t)/∂s_v = p_s,v·(s_v − t_v + 1)

    The teacher's log-probs are a constant (:class:`~plait.engine.batches.TokenDistributions`
    detaches them).
    """

    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, beta: float) -> Tensor:
        s, t = _finite(student), _finite(teacher)
        ctx.beta, ctx.dtype = beta, student.dtype
        if beta == 0.0:
            ctx.save_for_backward(s, t)
            return _kl(t, s)
        if beta == 1.0:
            ctx.save_for_backward(s, t)
            return _kl(s, t)
        log_m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
        ctx.save_for_backward(s, log_m)
        return beta * _kl(t, log_m) + (1 - beta) * _kl(s, log_m)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad, beta = grad.unsqueeze(-1), ctx.beta
        if beta == 0.0:  # the one gradient without a p_s factor: zero it at masked (−inf) tokens
            s, t = ctx.saved_tensors
            d_s = t.exp().mul_(-grad).masked_fill_(s == torch.finfo(s.dtype).min, 0.0)
        elif beta == 1.0:
            s, t = ctx.saved_tensors
            d_s = s.exp().mul_((s - t).add_(1)).mul_(grad)
        else:
            s, log_m = ctx.saved_tensors
            d_s = s.exp().mul_(s - log_m).mul_((1 - beta) * grad)
        return d_s.to(ctx.dtype), None, None


def distill_jsd(batch: TokenDistributions, p: JSDParams) -> Tensor:
    return _Divergence.apply(batch.logps, batch.teacher_logps, p.beta)


@hookimpl
def register_losses(register):
    register("distill.jsd", distill_jsd, params=JSDParams, consumes=TokenDistributions, output="example",
             doc="Generalised JSD (β=0 forward KL, β=1 reverse KL) between student and teacher, per position")
