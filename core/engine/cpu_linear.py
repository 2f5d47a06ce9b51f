"""Linear layers under bf16 autocast on a CPU: one cast of an input that several layers read, and weight
gradients whose GEMM reads both operands row-major.

A linear layer y = x Wᵀ has three GEMMs: the forward, the input's gradient dx = dy W and the weight's
dW = dyᵀ x, which sums over tokens. In the last both operands hold tokens in rows, so its first operand is a
transposed view; oneDNN's AMX kernel, which torch runs bf16 GEMMs through, reads a transposed first operand at
about half its rate: on SmolLM2's shapes (2,048 tokens, 2-core Xeon with AMX, 2026-12-06) 1.0–1.4 TFLOP/s
against 2.0–2.7 for the same GEMM with that operand row-major (float32 GEMMs, through MKL, run at one rate
either way). Copying the narrower of dy and x transposed first (the hidden size, 576 of SmolLM2's 1,536, in
0.47 ms) turns the GEMM into one with both operands row-major: dW = (dyᵀ) x when dy is the narrower, else
dWᵀ = (xᵀ) dy, whose small [in, out] product is copied transposed into the float32 gradient. That pays where
the GEMM is large beside the copy: a layer whose wider side is at least :data:`MIN_WIDTH` and twice its
narrower (SmolLM2's gate, up and down projections, not its 576 × 576 and 576 × 192 ones), over at least
:data:`MIN_TOKENS` tokens; other layers keep autograd's GEMM.

Autocast casts a layer's float32 input to bf16 at every call, and caches only weights: the query, key and
value projections cast the same normalised hidden states three times, the MLP's gate and up projections
twice, in the forward and again in the recompute under gradient checkpointing. Here the second and third
layers reading the same tensor take the first one's cast (and, in the backward, its transposed copy). Each
layer still returns its input's gradient in float32, so the three gradients are summed in float32 as
autograd sums them. (An input that is itself a leaf taking a gradient autocast does cache, and sums its
gradients in bf16; such a layer runs ``nn.Linear``'s own forward.) A layer with nothing to share and no
row-major weight gradient (an output projection fed bf16 by attention), or a batch under :data:`MIN_TOKENS`
tokens, where a layer's forward and backward through the Function cost more than autograd's (0.1–0.6 ms at
512 tokens), runs ``nn.Linear``'s own forward too.

Everything but the weight gradient is the same number: the forward and the input's gradient are the same
kernels on the same operands (the weight cast to bf16 as autocast casts it). The weight gradient is the same
sum in float32 accumulators, blocked differently, so its bf16 rounding differs in the last place for some
elements (within 2⁻⁸ of the largest, ``tests/test_cpu_linear.py``). Float32 runs, other devices and calls
with nothing to differentiate run ``nn.Linear``'s own forward; so does the model's output layer, whose
log-probs plait computes by :mod:`plait.engine.head_statistics`.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from .autocast import differentiated_in_bf16_on_cpu

__all__ = ["AutocastLinear", "CpuLinear", "cpu_linears"]

COMPUTE_DTYPE = torch.bfloat16
# Measured on SmolLM2's shapes (2-core Xeon with AMX, 2026-12-06), one layer's forward and backward: the down
# projection (1,536 -> 576) 5.80 -> 5.09 ms at 1,024 tokens and 11.1 -> 10.3 at 2,048, but 3.24 -> 3.11 at 512,
# where the gate projection's (576 -> 1,536) 2.69 -> 3.27 and the key's (576 -> 192) 0.87 -> 0.99 lose.
MIN_TOKENS = 1024  # fewer tokens in a batch: nn.Linear's own forward
MIN_WIDTH = 1024  # a narrower layer's weight gradient: autograd's GEMM


def transposed(x: Tensor) -> Tensor:
    """``x`` [N, C] copied to [C, N] row-major. Through the channels-last conversion, torch's fastest transposing
    copy on a CPU: 0.47 ms for a bf16 [2,048 × 576] against 0.79 ms by ``x.t().contiguous()``."""
    rows, columns = x.shape
    return x.view(1, rows, 1, columns).permute(0, 3, 1, 2).contiguous().view(columns, rows)


class _LastOf:
    """f(tensor) for the tensor it was last asked about, computed once while that tensor lives unchanged: the
    bf16 cast (or transposed copy) that consecutive layers reading one tensor share."""

    def __init__(self, make):
        self.make = make
        self.source: weakref.ref | None = None
        self.version = -1
        self.value: Tensor | None = None

    def __call__(self, tensor: Tensor) -> Tensor:
        if self.source is None or self.source() is not tensor or self.version != tensor._version:
            self.value = self.make(tensor)
            self.source, self.version = weakref.ref(tensor), tensor._version
        return self.value


_cast = _LastOf(lambda x: x.to(COMPUTE_DTYPE))
_transposed_input = _LastOf(lambda x: transposed(x.reshape(-1, x.shape[-1])))


class AutocastLinear(torch.autograd.Function):
    """``AutocastLinear.apply(x, weight, bias)``: ``F.linear`` under bf16 autocast, as the module docstring says."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x_low = _cast(x) if x.dtype != COMPUTE_DTYPE else x
        weight_low = weight.to(COMPUTE_DTYPE)
        with torch.autocast("cpu", enabled=False):
            output = F.linear(x_low, weight_low, None if bias is None else bias.to(COMPUTE_DTYPE))
        ctx.save_for_backward(x_low, weight_low)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor):
        x_low, weight_low = ctx.saved_tensors
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        out_features, in_features = weight_low.shape
        dy = grad_output.reshape(-1, out_features)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(dy, weight_low).view(x_low.shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            x = x_low.reshape(-1, in_features)
            narrower = _row_major_side(in_features, out_features)
            if narrower == "output":  # dW = (dyᵀ) x: dy copied transposed
                grad_weight = torch.mm(transposed(dy), x).to(weight_dtype)
            elif narrower == "input":  # dWᵀ = (xᵀ) dy, then into the gradient transposed
                product = torch.mm(_transposed_input(x_low), dy)
                grad_weight = torch.empty(weight_low.shape, dtype=weight_dtype).copy_(product.t())
            else:  # the copy would cost about what it saves: autograd's GEMM
                grad_weight = torch.mm(dy.t(), x).to(weight_dtype)
        if bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(0).to(bias_dtype)
        return grad_x, grad_weight, grad_bias


def _row_major_side(in_features: int, out_features: int) -> str | None:
    """Which of x ("input") and dy ("output") a layer's weight gradient copies transposed, or None for
    autograd's GEMM: the narrower, where the wider side is at least :data:`MIN_WIDTH` and twice as wide."""
    narrow, wide = sorted((in_features, out_features))
    if wide < MIN_WIDTH or 2 * narrow > wide:
        return None
    return "input" if in_features < out_features else "output"


def _takes_the_function(module: torch.nn.Linear, x: Tensor) -> bool:
    weight = module.weight
    return (differentiated_in_bf16_on_cpu(x) and weight.dtype == torch.float32 and type(weight.data) is torch.Tensor
            and x.dtype in (torch.float32, COMPUTE_DTYPE) and (weight.requires_grad or x.requires_grad)
            and not (x.is_leaf and x.requires_grad)  # autocast caches such an input's cast: its own numbers
            and x.numel() >= MIN_TOKENS * x.shape[-1]
            # something to gain: a float32 input's cast to share, or a weight gradient from row-major operands
            and (x.dtype == torch.float32
                 or (weight.requires_grad and _row_major_side(weight.shape[1], weight.shape[0]) is not None))
            and not torch.compiler.is_compiling())


class CpuLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward runs :class:`AutocastLinear` under bf16 autocast on a CPU when a backward may
    follow, and ``nn.Linear.forward`` otherwise. A class rather than an instance's forward: transformers'
    ``train()`` drops instance forwards of the layers its ``kernels`` integration may replace."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 -- nn.Linear's own parameter name
        if _takes_the_function(self, input):
            return AutocastLinear.apply(input, self.weight, self.bias)
        return super().forward(input)


def cpu_linears(model: torch.nn.Module) -> int:
    """Make every ``nn.Linear`` of ``model`` (that class exactly, with no forward of its own) other than its output
    layer a :class:`CpuLinear`. Returns how many it changed; doing it twice changes nothing more."""
    output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not output_layer and "forward" not in vars(module):
            module.__class__ = CpuLinear
            changed += 1
    return changed
