"""Causal attention's backward on a CPU in bf16: blocked GEMMs where torch's flash kernel is slow.

torch's CPU flash-attention backward runs bf16 far below the GEMM rate on short sequences: on SmolLM2's
heads (9 query heads over 3 key/value heads, 64 wide) a batch of 4 × 512 tokens takes 23 ms a layer to
differentiate (2.4 GFLOP of causal GEMMs: 0.1 TFLOP/s, where bf16 GEMMs of these shapes run at 2), its
forward 4.5 ms, and 8 × 128 tokens take 13 ms (2-core Xeon with AMX, 2026-12-05). The math is four GEMMs
and a softmax's backward (Dao et al. 2022, "FlashAttention", Algorithm 4, with the softmax recomputed
rather than rebuilt from its log-sum-exp):

    P = softmax(Q Kᵀ · scale + causal bias)      dV = Pᵀ dO      dP = dO Vᵀ
    dS = P ⊙ (dP − rowsum(dP ⊙ P))              dQ = dS K · scale      dK = dSᵀ Q · scale

:class:`CausalAttention` keeps the forward exactly as given (the caller's own SDPA call, so every output is
the same number) and computes this backward in blocks of :data:`BLOCK_ROWS` queries: a block reads only the
keys its queries can see, so the causal triangle's upper half is mostly skipped and no block holds more than
``BLOCK_ROWS × keys`` scores per head. The query heads that share a key/value head are stacked into one
matrix (grouped-query attention without repeating keys). For 4 × 512 tokens the layer's forward and backward
take 19.0 ms against SDPA's 26.2, for 8 × 128 tokens 3.5 against 13.2, for a reward model's rejected branches
(4 × 256 after a 255-token prompt) 15.2 against 18.4, at 1,024 and 2,048 tokens about the same as SDPA's
(`benchmarks/attention_backward.py`). In float32 the flash kernel is faster, so :func:`pays` keeps it there.

Gradients differ from flash's by bf16 rounding: both round probabilities and their gradients to bf16 for
the GEMMs, this one the scores too (flash keeps them in float32). On SmolLM2's heads each gradient is within
1.7e-2 of the float64 definition (max error over max value), flash's within 1.4e-2
(``tests/test_causal_attention.py``).
"""

from __future__ import annotations

import collections
import contextvars
from typing import Callable

import torch

# queries per block: small enough that a block's keys stop near the diagonal, large enough for full GEMMs
BLOCK_ROWS = 128


def pays(query: torch.Tensor) -> bool:
    """Whether :class:`CausalAttention` is faster than the SDPA kernel's own backward: a bf16 query on a CPU
    that a backward will differentiate."""
    return query.device.type == "cpu" and query.dtype == torch.bfloat16 and query.requires_grad and torch.is_grad_enabled()


class KeptOutputs:
    """The outputs :class:`CausalAttention` computed in one checkpointed forward, handed back in the same order to
    that forward's recompute, which then runs no attention kernel. This is selective activation checkpointing
    for attention (:mod:`plait.engine.checkpointing`) without torch's dispatch mode, which runs Python for every
    op of the forward and the recompute to find the attention kernels: on SmolLM2 (bf16, 4 × 512 tokens) that
    cost as much as the attention forward it saved, 3.5 ms a layer a step."""

    def __init__(self):
        self.outputs: collections.deque[torch.Tensor] = collections.deque()

    def recording(self) -> _Phase:
        """The checkpointed forward: each attention output is kept."""
        return _Phase(self, replaying=False)

    def replaying(self) -> _Phase:
        """The recompute (entered again by each backward through a retained graph): each attention output is
        the next one kept, computed afresh once none is left."""
        return _Phase(self, replaying=True)


class _Phase:
    """A reusable context manager: while inside, :class:`CausalAttention` records into or replays from ``kept``."""

    def __init__(self, kept: KeptOutputs, replaying: bool):
        self.state, self.tokens = (kept, replaying), []

    def __enter__(self):
        self.tokens.append(_KEPT.set(self.state))

    def __exit__(self, *exc_info):
        _KEPT.reset(self.tokens.pop())


_KEPT: contextvars.ContextVar[tuple[KeptOutputs, bool] | None] = contextvars.ContextVar("plait_kept_attention", default=None)


class CausalAttention(torch.autograd.Function):
    """``attend(query, key, value)`` forward, the blocked backward above. ``query`` is [batch, heads, Lq, dim],
    ``key`` and ``value`` [batch, kv_heads, Lk, dim] with Lk ≥ Lq: query i sees keys 0 … i + Lk − Lq (causal,
    aligned at the end: a branch's queries after its shared prefix). ``attend`` returns [batch, Lq, heads, dim],
    as transformers' attention functions do."""

    @staticmethod
    def forward(ctx, query, key, value, scale: float, attend: Callable):
        ctx.save_for_backward(query, key, value)
        ctx.scale = scale
        kept, replaying = _KEPT.get() or (None, False)
        if replaying and kept.outputs:
            return kept.outputs.popleft()
        output = attend(query, key, value)
        if kept is not None and not replaying:
            kept.outputs.append(output.detach())
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value = ctx.saved_tensors
        grad_query, grad_key, grad_value = causal_attention_backward(query, key, value, grad_output.transpose(1, 2), ctx.scale)
        return grad_query, grad_key, grad_value, None, None


def causal_attention_backward(query, key, value, grad_output, scale: float):
    """Gradients of causal attention (end-aligned, as :class:`CausalAttention`) for ``grad_output`` [batch, heads, Lq, dim]."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups, offset, dtype = heads // kv_heads, keys - queries, query.dtype
    # [batch·kv_heads, groups, Lq, dim]: a key/value head's query heads one above the other
    grouped_query = query.reshape(batch * kv_heads, groups, queries, dim)
    grouped_grad = grad_output.to(dtype).reshape(batch * kv_heads, groups, queries, dim)
    flat_key, flat_value = key.reshape(batch * kv_heads, keys, dim), value.reshape(batch * kv_heads, keys, dim)
    # −inf where query i may not see key j > i + offset, 0 elsewhere
    bias = torch.full((queries, keys), float("-inf"), dtype=dtype, device=query.device).triu_(diagonal=offset + 1)
    grad_query = torch.empty_like(grouped_query)
    grad_key = grad_value = None
    for start in reversed(range(0, queries, BLOCK_ROWS)):  # the last block sees every key: it sets dK, dV
        stop = min(queries, start + BLOCK_ROWS)
        rows, seen = stop - start, stop + offset
        block_query = grouped_query[:, :, start:stop].reshape(batch * kv_heads, groups * rows, dim)
        block_grad = grouped_grad[:, :, start:stop].reshape(batch * kv_heads, groups * rows, dim)
        block_key, block_value = flat_key[:, :seen], flat_value[:, :seen]
        scores = torch.baddbmm(bias[start:stop, :seen].repeat(groups, 1), block_query, block_key.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        grad_scores = torch._softmax_backward_data(torch.bmm(block_grad, block_value.transpose(1, 2)), probs, -1, dtype)
        block_grad_key = torch.bmm(grad_scores.transpose(1, 2), block_query)
        block_grad_value = torch.bmm(probs.transpose(1, 2), block_grad)
        if grad_key is None:
            grad_key, grad_value = block_grad_key, block_grad_value
        else:
            grad_key[:, :seen] += block_grad_key
            grad_value[:, :seen] += block_grad_value
        grad_query[:, :, start:stop] = torch.bmm(grad_scores, block_key).view(batch * kv_heads, groups, rows, dim)
    return (grad_query.mul_(scale).view(batch, heads, queries, dim),
            grad_key.mul_(scale).view(batch, kv_heads, keys, dim), grad_value.view(batch, kv_heads, keys, dim))
