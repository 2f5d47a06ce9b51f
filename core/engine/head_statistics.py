"""Per-token log-probs (and entropy, logit mean, argmax) straight from the output layer, one autograd step.

For hidden states h [N, H], a linear output layer (W [V, H], b) and temperature τ, position n's tempered
logits are z = (h Wᵀ + b)/τ, and

    log p(t) = log_softmax(z)_t        H = −Σ_v p_v log p_v        p = softmax(z)

with the gradients of the log-softmax and the entropy:

    ∂ log p(t)/∂z = onehot(t) − p        ∂H/∂z = −p ⊙ (log p + H)        ∂mean(zτ)/∂(zτ) = 1/V

This is what :func:`plait.engine.logprobs.token_logprobs` computes chunk by chunk through autograd (the
projection, a float32 upcast, a log-softmax, a gather; each chunk but the last checkpointed), with the same
float32 values, in far fewer trips through memory. On a CPU the trips are the cost, not the arithmetic: one
chunk of SmolLM2's logits is [682 × 49,152] (134 MB in float32) and the chain's upcast, log-softmax, the
gather's backward (a zero-filled tensor and a scatter), the log-softmax's backward and the downcast each
read and write all of it, forward, recompute and backward. Here each chunk is projected once into a reused
buffer (the layer's dtype), and its softmax is worked out :data:`ROW_BLOCK` rows at a time, whose float32
copy stays in cache from the upcast to the gradient; the gradient replaces the logits in the buffer, and the
weights are cast to the compute dtype once for every chunk rather than per chunk. The forward keeps its last
chunk's logits for the backward; the others are projected again there, as the chain recomputes them.

The projections and their gradients are the chain's GEMMs in the chain's dtype (the autocast's, or the
weights' own without autocast), the weight gradient summed chunk by chunk in the weight's dtype as
autograd's accumulation does, the log-probs, entropies and logit means the same float32 bits (the same
log-softmax on the same rows), and so are the gradients by the logits (the same log-softmax backward on the
same gradient) unless the entropy has a gradient: a float32 run trains to the same weights either way.
One-layer Llama with SmolLM2's widths, ``token_logprobs`` forward and backward at 4 × 512 tokens, bf16
(``benchmarks/head_statistics.py``, 2-core Xeon with AMX, medians of 7): SFT (every position)
1,171 → 875 ms, DPO (completion halves) 517 → 464, GRPO (128-token completions, entropy) 368 → 326;
float32 1.00–1.08×.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor


# Rows whose float32 logits are worked on together: 16 × 49,152 × 4 B = 3 MB stays in cache from the upcast
# to the gradient (8 and 32 rows measured the same, 64 slower for SFT's chunks)
ROW_BLOCK = 16


@attrs.frozen
class Statistics:
    """From fp32 logits [N, V] and targets [N]: (logp, entropy?, logit mean?, argmax?, collision?) each [N]: what
    the chain computes per chunk and :class:`HeadStatistics` per block of rows."""

    temperature: float
    with_entropy: bool
    with_logit_mean: bool
    with_argmax: bool = False
    with_collision: bool = False

    def __call__(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, ...]:
        mean = logits.mean(-1) if self.with_logit_mean else None
        z = _tempered(logits, self.temperature)
        logp_all = z.log_softmax(-1)
        out = [logp_all.gather(-1, targets[:, None]).squeeze(-1)]
        if self.with_entropy:
            out.append(-(logp_all.exp() * logp_all).sum(-1))
        if mean is not None:
            out.append(mean)
        if self.with_argmax:  # as float so every statistic shares one tensor type; ids < 2**24 are exact
            # max's indices: argmax's (the first of tied maxima), in half its time on CPU (22 against 42 ms
            # for 682 x 49,152 fp32 logits on a 2-core Xeon)
            out.append(logits.max(-1).indices.float())
        if self.with_collision:
            out.append(torch.logsumexp(2 * logp_all, dim=-1))
        return tuple(out)


class HeadStatistics(torch.autograd.Function):
    """``statistics`` (a :class:`Statistics` without the collision term) of ``targets`` [N] under
    ``linear(hidden, weight, bias)`` computed in ``dtype``, ``chunk`` positions at a time: float32 [N] each, in
    its order (log-prob, then entropy, logit mean, argmax as asked). Gradients flow to ``hidden``, ``weight``
    and ``bias``."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, dtype: torch.dtype,
                chunk: int, statistics: Statistics):
        if statistics.with_collision:
            raise ValueError("HeadStatistics has no backward for the collision term; use the autograd chain")
        with torch.autocast(hidden.device.type, enabled=False):
            projection = _Projection(weight, bias, dtype, chunk, hidden.shape[0])
            count = 1 + statistics.with_entropy + statistics.with_logit_mean + statistics.with_argmax
            outputs = [hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(count)]
            for rows, logits in projection.logits(hidden):
                for block, _, x in _blocks(rows, logits):
                    for output, value in zip(outputs, statistics(x, targets[block])):
                        output[block] = value
            projection.keep_last_chunk()
        entropy = outputs[1] if statistics.with_entropy else None
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.projection, ctx.settings = projection, (dtype, chunk, statistics)
        if statistics.with_argmax:
            ctx.mark_non_differentiable(outputs[-1])
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        dtype, chunk, statistics = ctx.settings
        grads = iter(grads)
        grad_logp = next(grads)
        grad_entropy = next(grads) if statistics.with_entropy else None
        grad_mean = next(grads) if statistics.with_logit_mean else None
        temperature = statistics.temperature
        # the forward's buffers go with this backward (a graph kept for another backward projects afresh)
        projection, ctx.projection = ctx.projection, None
        if grad_logp is None and grad_entropy is None and grad_mean is None:
            return (None,) * 7
        projection = projection or _Projection(weight, bias, dtype, chunk, hidden.shape[0])
        with torch.autocast(hidden.device.type, enabled=False):
            grad_hidden = torch.empty_like(hidden, dtype=projection.weight.dtype) if ctx.needs_input_grad[0] else None
            grad_weight = product = None
            grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
            # the newest chunk first, as autograd's chain differentiates them (its logits are still here)
            for rows, logits in projection.logits(hidden, newest_first=True):
                for block, view, x in _blocks(rows, logits):  # each block's gradient replaces its logits
                    view.copy_(_logit_gradient(_tempered(x, temperature), targets[block], temperature,
                                               None if grad_logp is None else grad_logp[block],
                                               None if grad_entropy is None else (grad_entropy[block], entropy[block]),
                                               None if grad_mean is None else grad_mean[block]))
                grad_logits = logits
                if grad_hidden is not None:
                    grad_hidden[rows] = grad_logits @ projection.weight
                if ctx.needs_input_grad[1]:  # each chunk's product rounded to the dtype, summed in the weight's
                    if product is not None and grad_weight is None:  # a second chunk: the sum starts
                        grad_weight = product.to(weight.dtype, copy=True)
                    product = projection.weight_product(grad_logits, hidden[rows])
                    if grad_weight is not None:
                        grad_weight.add_(projection.in_dtype(product, weight.dtype))
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0)
            logits = grad_logits = projection.buffer = None
            if ctx.needs_input_grad[1] and grad_weight is None:
                # one chunk: its product is the gradient, converted only once the logits' buffer is freed, so the
                # two are never held together (in float32 it is the gradient as it is); no positions: zeros
                grad_weight = torch.zeros_like(weight) if product is None else product.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _blocks(rows: slice, logits: Tensor):
    """(row slice, its rows of ``logits``, their float32 values [≤ ROW_BLOCK, V]) for each block of a chunk."""
    for start in range(0, logits.shape[0], ROW_BLOCK):
        view = logits[start: start + ROW_BLOCK]
        yield slice(rows.start + start, rows.start + start + view.shape[0]), view, view.float()


def _tempered(x: Tensor, temperature: float) -> Tensor:
    return x if temperature == 1.0 else x / temperature


def _logit_gradient(z: Tensor, targets: Tensor, temperature: float, g_logp: Tensor | None,
                    g_entropy: tuple[Tensor, Tensor] | None, g_mean: Tensor | None) -> Tensor:
    """∂/∂logits of Σ g_logp·log p(t) + g_H·H + g_mean·mean(logits) for tempered logits z [n, V]: what autograd
    gives the chain, by the same kernels in the same order (the same float32 bits without an entropy term):
    the gradient by log p (g_logp at the target; −g_H·(log p·p + p) from H = −Σ p log p), then the log-softmax's
    backward (gradient − p·Σ gradient), over τ, plus g_mean/V."""
    log_p = z.log_softmax(-1)
    if g_entropy is None:
        by_log_p = torch.zeros_like(log_p)
    else:
        g_H, H = g_entropy
        p = log_p.exp()
        by_log_p = (log_p * -g_H[:, None]).mul_(p).add_(p * -g_H[:, None])
    if g_logp is not None:
        by_log_p.index_put_((torch.arange(z.shape[0], device=z.device), targets), g_logp, accumulate=True)
    grad = torch.ops.aten._log_softmax_backward_data(by_log_p, log_p, -1, log_p.dtype)
    if temperature != 1.0:
        grad.div_(temperature)
    if g_mean is not None:
        grad.add_(g_mean[:, None] / grad.shape[-1])
    return grad


class _Projection:
    """The output layer in ``dtype``, chunk by chunk into one reused buffer: :meth:`logits` yields (row slice,
    logits [rows, V] in the layer's dtype), which the caller may overwrite (with the chunk's gradient) until
    it asks for the next chunk. The forward leaves its last chunk's logits there for the backward, as
    autograd's chain keeps its last chunk's graph rather than recompute it."""

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, chunk: int, N: int):
        self.weight = weight.to(dtype)
        self.bias = None if bias is None else bias.to(dtype)
        self.chunks = [slice(start, min(start + chunk, N)) for start in range(0, N, chunk)]
        self.buffer = weight.new_empty(min(chunk, N), weight.shape[0], dtype=dtype)
        self.kept: slice | None = None  # the chunk whose logits the buffer holds
        self._weight_grad = self._weight_grad_float = None

    def logits(self, hidden: Tensor, newest_first: bool = False):
        for rows in reversed(self.chunks) if newest_first else self.chunks:
            logits = self.buffer[: rows.stop - rows.start]
            if rows != self.kept:
                h = hidden[rows].to(self.weight.dtype)
                if self.bias is None:
                    torch.mm(h, self.weight.T, out=logits)
                else:
                    torch.addmm(self.bias, h, self.weight.T, out=logits)
            self.kept = None
            yield rows, logits

    def keep_last_chunk(self) -> None:
        """Between forward and backward hold only the weights' cast and the last chunk's logits."""
        self.kept = self.chunks[-1] if self.chunks else None

    def weight_product(self, grad_logits: Tensor, hidden: Tensor) -> Tensor:
        """grad_logitsᵀ · hidden [V, H] in the projection's dtype, into one reused buffer."""
        if self._weight_grad is None:
            self._weight_grad = torch.empty_like(self.weight)
        return torch.mm(grad_logits.T, hidden.to(self.weight.dtype), out=self._weight_grad)

    def in_dtype(self, product: Tensor, dtype: torch.dtype) -> Tensor:
        """``product`` [V, H] converted to ``dtype`` in a reused buffer (an add of a bf16 tensor into a float32
        one converts element by element, 3-6x slower than a conversion and a float32 add)."""
        if product.dtype == dtype:
            return product
        if self._weight_grad_float is None:
            self._weight_grad_float = torch.empty_like(product, dtype=dtype)
        return self._weight_grad_float.copy_(product)
