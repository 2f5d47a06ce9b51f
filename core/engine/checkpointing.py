"""Activation checkpointing that keeps attention's output: the recompute runs every op but attention.

Checkpointing a decoder layer keeps only its input and runs its forward again in the backward.
The recomputed ops cost very different amounts per byte they would take to keep: a projection's
output costs about 2·hidden FLOPs per number it holds, the attention kernel's about 2·context
(its output is one vector per token, but every token attended over its whole context), and on a
CPU the attention kernels run at a third of the matmuls' rate. On SmolLM2 at 512 tokens (SFT,
batch 4, fp32, 2 cores) attention's forward was 1.5 s of a 22 s step, half of it the recompute,
for 135 MiB of outputs over all 30 layers (TRL's logits for the same batch take 384 MiB).

So plait's default checkpointing is selective (PyTorch's selective activation checkpointing,
``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the attention kernels' outputs
are saved in the forward and reused by the recompute; every other op is recomputed as before.
Gradients are the same numbers (the recompute would have produced those very outputs again).

torch finds the attention kernels with a dispatch mode that runs a Python policy for every op of the
forward and the recompute (about 200 a layer), which on a CPU costs as much as the attention forward
it saves: a bf16 SmolLM2 layer over 4 × 512 tokens took the same time with it as with plain
checkpointing. Under bf16 autocast on a CPU, where plait's own :class:`~plait.engine.causal_attention.CausalAttention`
differentiates attention, that Function keeps its outputs itself
(:class:`~plait.engine.causal_attention.KeptOutputs`): 3.5 ms a layer less than either (2026-12-05,
docs/benchmarks.md). Attention that does not go through that Function there (a left-padded batch's masked
SDPA) is recomputed, as under plain checkpointing, which cost the same as the dispatch mode. Elsewhere
(float32, GPUs, torch.compile) the dispatch mode runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plait.engine.causal_attention import KeptOutputs
from plait.errors import PlaitError
from plait.import_paths import import_object

# the fused attention kernels torch's scaled_dot_product_attention dispatches to (CPU, CUDA, cuDNN)
_KERNEL_NAMES = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
ATTENTION_KERNELS = frozenset(getattr(torch.ops.aten, name).default for name in _KERNEL_NAMES
                              if hasattr(torch.ops.aten, name))


def _save_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: save the attention kernels' outputs, recompute the rest."""
    if (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and not torch.compiler.is_compiling()):  # compiled checkpoints take only dispatch modes
        kept = KeptOutputs()
        return kept.recording(), kept.replaying()
    return create_selective_checkpoint_contexts(_save_attention)


def checkpointing_kwargs(given: dict[str, Any] | str | None) -> dict[str, Any] | str:
    """The ``activation_checkpointing_kwargs`` a run uses: the user's, with ``context_fn=keep_attention``
    unless they chose a ``context_fn`` (an import path such as ``pkg.module:func`` names one) or
    reentrant checkpointing, which cannot run one."""
    if given is not None and not isinstance(given, dict):
        return given  # transformers' own reading (a JSON file's path)
    kwargs = dict(given or {})
    if kwargs.get("use_reentrant"):
        if "context_fn" in kwargs:
            raise PlaitError("activation_checkpointing_kwargs: context_fn needs use_reentrant=False (torch's "
                             "reentrant checkpointing takes none); drop use_reentrant or the context_fn")
        return kwargs
    kwargs["use_reentrant"] = False
    context_fn = import_object(kwargs.get("context_fn", keep_attention), "activation_checkpointing_kwargs.context_fn")
    if not callable(context_fn):
        raise PlaitError(f"activation_checkpointing_kwargs: context_fn={context_fn!r} is not callable; give a function "
                         "returning two context managers (torch.utils.checkpoint), or 'pkg.module:func'")
    kwargs["context_fn"] = context_fn
    return kwargs
