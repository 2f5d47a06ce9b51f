"""Rotary position tables in the autocast's dtype, so rotating q and k costs no float32 round trip;
a frozen model's linear layers stored in the autocast's dtype, so it holds and casts half as much.

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

A frozen model (the reference of DPO, KTO and the online methods) runs only under the trainer's
autocast (accelerate wraps the forward of the model it prepares in it), which casts every linear
layer's float32 weight to bf16 at every call: autocast's cast cache keeps only weights that take
gradients, so a frozen weight is cast afresh at each forward, and its float32 copy is held all run
for nothing else. :func:`frozen_linears_in_compute_dtype` stores those weights cast once: the products
are the same bit for bit (the same rounding of the same float32 weight), the layers hold half the
memory, and no forward casts them. DPO on SmolLM2-135M (512 tokens, batch 4, bf16, six steps on a
2-core Xeon with AMX): every logged loss, gradient norm, margin and log-prob equal, peak RSS 4,250 ->
3,879 MiB (docs/benchmarks.md).
"""

from __future__ import annotations

from collections import Counter

import torch

__all__ = ["computed_in_bf16_on_cpu", "differentiated_in_bf16_on_cpu", "frozen_linears_in_compute_dtype",
           "rotary_in_compute_dtype"]

# accelerate's mixed-precision setting -> the dtype its autocast computes linear layers in
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def computed_in_bf16_on_cpu(x: torch.Tensor) -> bool:
    """Whether work on ``x`` runs on a CPU under bf16 autocast, with gradients on or off."""
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def differentiated_in_bf16_on_cpu(x: torch.Tensor) -> bool:
    """Whether work on ``x`` runs on a CPU under bf16 autocast with gradients on: where plait's CPU training
    kernels (:mod:`plait.engine.cpu_linear`, :mod:`plait.engine.compiled_kernels`) may act. Gradients are tested
    first, so generation's many small no-grad calls leave at once."""
    return torch.is_grad_enabled() and computed_in_bf16_on_cpu(x)


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


def frozen_linears_in_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store the float32 weights (and biases) of ``model``'s frozen linear layers in ``dtype``, the
    autocast's compute dtype, for a model that only ever runs under that autocast (see the module
    docstring). Only plain ``nn.Linear`` layers whose parameters all are frozen, float32 and held by
    no other module, and never the output layer: ``cast_lm_head_to_fp32`` projects it from its float32
    weight, and a tied one is the input embedding too. Returns how many layers changed."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    holders = Counter(id(param) for module in model.modules() for param in module.parameters(recurse=False))
    changed = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module is output:
            continue
        params = list(module.parameters(recurse=False))
        if all(not p.requires_grad and p.dtype == torch.float32 and holders[id(p)] == 1 for p in params):
            module.to(dtype)
            changed += 1
    return changed
