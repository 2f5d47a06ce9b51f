"""Rotary position tables in the autocast's dtype, so rotating q and k costs no float32 round trip.

A transformers decoder computes its rotary tables (cos, sin) in the dtype of the hidden states it
is given, and under mixed precision those are the float32 residual stream: the query and key come
out of their projections in bf16, meet float32 tables, are promoted to float32 for the four
products and two sums of the rotation, and are then cast back to bf16 by autocast for attention.
Each layer pays that in its forward, again in the recompute under gradient checkpointing, and in
the backward, over tensors of heads × tokens × head size: two casts and a float32 rotation per
layer per pass. On SmolLM2-135M (4 × 512 tokens, forward and backward with checkpointing, bf16 on
an AMX CPU, 2 cores) the step took 8.53 s with float32 tables and 8.15 s with these: 1.05×
(benchmarks/step_parts.py, results/step_parts.json).

Under autocast, :func:`rotary_in_compute_dtype` gives the layers their tables in the autocast's
dtype instead, so the rotation runs in bf16 on bf16 query and key, as it does in a model loaded in
bf16. Only the rotation's rounding changes (bf16 products instead of a float32 rotation rounded to
bf16 once), an error of the size autocast already makes in every projection; without autocast
nothing changes.
"""

from __future__ import annotations

import torch

__all__ = ["rotary_in_compute_dtype"]


def _tables_in_compute_dtype(module, args, output):
    if not isinstance(output, tuple) or not output or not all(torch.is_tensor(t) for t in output):
        return None
    device = output[0].device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.dtype == torch.float32 else t for t in output)


def rotary_in_compute_dtype(model: torch.nn.Module) -> int:
    """Hook every rotary embedding of ``model`` (a module whose class name ends in ``RotaryEmbedding``,
    transformers' naming, returning its (cos, sin) tables) so that under autocast it returns them in
    the autocast's dtype. Returns how many it hooked; hooking a model twice does nothing more."""
    hooked = 0
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and not getattr(module, "_plait_compute_dtype", False):
            module.register_forward_hook(_tables_in_compute_dtype)
            module._plait_compute_dtype = True
            hooked += 1
    return hooked
