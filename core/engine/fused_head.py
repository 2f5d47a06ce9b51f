"""The output layer and the log-softmax in one autograd step: per-token log-probs without [n, V] graphs.

For hidden states h ∈ R^{n×H}, a linear output layer W ∈ R^{V×H} (bias b), temperature τ and
targets y, with z = (hWᵀ + b)/τ, lse = logsumexp(z) and p = softmax(z):

    log p(y) = z_y − lse                         H = lse − Σ_v p_v z_v        (the entropy)
    ∂log p(y)/∂z = onehot(y) − p                 ∂H/∂z = −p ⊙ (log p + H)

so the gradient with respect to the logits is one [n, V] expression of p, and with g_l and g_H
the incoming gradients of the log-probs and entropies,

    ∂L/∂z = g_l·(onehot(y) − p) − g_H·p ⊙ (log p + H),   ∂L/∂h = (∂L/∂z)W/τ,   ∂L/∂W = (∂L/∂z)ᵀh/τ

(plus g_m/V on every raw logit for the mean of the raw logits, g_m its incoming gradient).

The chunked log-prob path used to run "project, upcast, log_softmax, gather" under activation
checkpointing: the backward recomputed all four, then ran gather's backward (a zero-filled
[n, V] tensor and a scatter), log_softmax's backward and the upcast's backward, each a full pass
over the chunk's logits. This function keeps only the chunk's logsumexp (and entropy) from the
forward, recomputes the logits once in the backward and forms ∂L/∂z in place (the same approach
as "Cut Your Losses in Large-Vocabulary Language Models", Wijmans et al. 2024, §3, and the
fused linear cross-entropy of Liger Kernel, Hsu et al. 2024, without their custom kernels); what
it saves a SmolLM2 step: benchmarks/step_parts.py (results/step_parts.json). The numbers are those
of the unfused path to float32 rounding: the same matmuls in the same dtype, fp32 softmax statistics.

It applies to a plain ``nn.Linear`` output layer whose logits the model returns unchanged (no
scaling or soft-capping after it) and whose weight is a whole local tensor; anything else (an
adapter on the output layer, a sharded weight, a hook on the layer) takes the unfused path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

__all__ = ["fusable", "linear_head_stats"]


def fusable(head: torch.nn.Module) -> bool:
    """Whether ``head`` is a plain local linear layer this module can compute with, and nothing
    watches its calls (a forward hook of its own or a global one would miss the fused projection)."""
    if type(head) is not torch.nn.Linear:  # a subclass (quantised, an adapter) may compute otherwise
        return False
    if head._forward_hooks or head._forward_pre_hooks or _global_forward_hooks or _global_forward_pre_hooks:
        return False
    weight = head.weight
    return type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.numel() > 0  # not DTensor / ZeRO-3 empty


def linear_head_stats(h: Tensor, head: torch.nn.Linear, compute_weight: Tensor, compute_bias: Tensor | None,
                      targets: Tensor, temperature: float, with_entropy: bool, with_logit_mean: bool,
                      with_argmax: bool) -> tuple[Tensor, ...]:
    """(logp, entropy?, logit mean?, argmax?) each [n] float32, for hidden states ``h`` [n, H].

    ``compute_weight`` / ``compute_bias`` are the layer's parameters already cast to the dtype the
    projection runs in (bf16 under a bf16 autocast), detached: cast once per batch rather than
    once per chunk and again in its backward. Gradients reach ``h`` and ``head``'s own parameters
    (the argmax carries none)."""
    bias = head.bias if head.bias is not None else None
    out = _LinearHeadStats.apply(h, head.weight, bias, compute_weight, compute_bias, targets, float(temperature),
                                 with_entropy, with_logit_mean, with_argmax)
    return tuple(x for x in out if x is not None)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    with torch.autocast(h.device.type, enabled=False):
        z = F.linear(h.to(weight.dtype), weight, bias).float()
    return z.div_(temperature) if temperature != 1.0 else z


class _LinearHeadStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, compute_weight, compute_bias, targets, temperature, with_entropy,
                with_logit_mean, with_argmax):
        z = _logits(h, compute_weight, compute_bias, 1.0)
        logit_mean = z.mean(-1) if with_logit_mean else None  # of the raw logits, before the temperature
        argmax = z.argmax(-1).float() if with_argmax else None
        if temperature != 1.0:
            z.div_(temperature)
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        entropy = None
        if with_entropy:
            logp_all = z.sub_(lse[:, None])
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        ctx.save_for_backward(h, compute_weight, compute_bias, targets, lse, entropy)
        ctx.temperature, ctx.weight_dtype, ctx.has_bias = temperature, weight.dtype, bias is not None
        if argmax is not None:
            ctx.mark_non_differentiable(argmax)
        return logp, entropy, logit_mean, argmax

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_mean, _grad_argmax):
        h, weight, bias, targets, lse, entropy = ctx.saved_tensors
        logp_all = _logits(h, weight, bias, ctx.temperature).sub_(lse[:, None])  # log p, [n, V]
        if grad_entropy is not None and entropy is not None:  # −g_H·p ⊙ (log p + H)
            p = logp_all.exp()
            grad_z = logp_all.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None])
            if grad_logp is not None:
                grad_z.addcmul_(p, grad_logp[:, None], value=-1.0)
        elif grad_logp is not None:  # −g_l·p, computed in place over log p
            grad_z = logp_all.exp_().mul_(-grad_logp[:, None])
        else:
            grad_z = logp_all.zero_()
        if grad_logp is not None:  # + g_l·onehot(y)
            grad_z.scatter_add_(-1, targets[:, None], grad_logp[:, None].to(grad_z.dtype))
        if ctx.temperature != 1.0:
            grad_z.div_(ctx.temperature)
        if grad_mean is not None:  # the mean of the raw logits: 1/V to each
            grad_z.add_(grad_mean[:, None] / grad_z.shape[-1])
        grad_z = grad_z.to(weight.dtype)
        grad_h = (grad_z @ weight).to(h.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad_z.T @ h.to(weight.dtype)).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad_z.float().sum(0).to(ctx.weight_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_h, grad_weight, grad_bias, *([None] * 7)
