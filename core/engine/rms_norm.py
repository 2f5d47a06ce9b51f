"""A decoder's RMSNorm differentiated by its closed-form gradient on a CPU, in half the passes autograd takes.

RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4; transformers' Llama form,
over the hidden size H):

    r = 1 / sqrt(mean(x²) + ε)      x̂ = x · r      y = w ⊙ x̂

Its gradient, written out (g = ∂L/∂y; the mean runs over H, the sum over tokens):

    g_x̂ = g ⊙ w      g_x = r · (g_x̂ − x̂ · mean(g_x̂ ⊙ x̂))      g_w = Σ g ⊙ x̂

Autograd differentiates the forward's six ops one by one (the square's, the mean's, the reciprocal root's,
the two products' and the sum of x's two paths), a dozen passes over the float32 residual stream of which
most write a tensor as large as it; the formula above takes seven. Under gradient checkpointing every norm
is differentiated once a step, two a layer: on SmolLM2-135M (4 × 512 tokens, a 2-core Xeon with AMX,
2026-12-05) one norm's backward takes 3.4 ms by autograd and 1.5 ms by the formula (docs/benchmarks.md).

:func:`closed_form_rms_norms` makes each RMSNorm of a model whose own forward computes exactly this (checked
on a probe, bit for bit, so a Gemma-style ``1 + w`` gain or any other norm keeps its own) an instance of a
subclass whose forward runs :class:`ClosedFormRMSNorm` for a float32 input on a CPU that a backward will
differentiate. Its forward is transformers' ops in transformers' order, so every output is the same number
(but for the compiled loop below); the gradient is the formula's, which rounds differently from autograd's
chain: within 1e-7 of it, relative to its largest element. Anything else (a bf16 input, whose x̂ transformers
rounds to bf16 before the gain; another device) runs the module's own forward. A run that trains on a CPU does
this to its model and to the frozen models it holds (a reference, a teacher).

Under bf16 autocast, on batches where :func:`plait.engine.compiled_kernels.forward_pays`, forward and backward
each run as one loop compiled by inductor (:func:`compiled_normalise` and :func:`compiled_backward`: the same
formulas, summed in inductor's order, within float32 rounding of these numbers), with gradients or without: a
trained model and its frozen reference then give a batch the same numbers, as they must at the first step (a
DPO loss of ln 2).
"""

from __future__ import annotations

import torch

from . import compiled_kernels
from .subclassing import subclass_with_forward

__all__ = ["ClosedFormRMSNorm", "closed_form_rms_norms", "compiled_backward", "compiled_normalise"]


def _normalise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(w ⊙ x̂, r) for a float32 ``x``: transformers' LlamaRMSNorm ops in its order, so the same numbers."""
    inverse_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x * inverse_rms), inverse_rms


def _closed_form_gradients(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           inverse_rms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_x, g_w) by the formula in the module docstring for [tokens, H] rows, written for one compiled loop
    (:class:`ClosedFormRMSNorm`'s eager backward writes it in place instead); g_w summed over tokens in float32."""
    grad = grad.float()
    x_hat = x * inverse_rms
    grad_x_hat = grad * weight
    mean = (grad_x_hat * x_hat).sum(-1, keepdim=True) / x.shape[-1]
    return inverse_rms * grad_x_hat - x_hat * (mean * inverse_rms), (grad * x_hat).sum(0)


def compiled_normalise(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_normalise` for float32 ``x`` [..., H] as one compiled loop: (w ⊙ x̂, r [..., 1])."""
    output, inverse_rms = compiled_kernels.run(_normalise, compiled_kernels.rows(x), weight, eps)
    return output.view(x.shape), inverse_rms.view(*x.shape[:-1], 1)


def compiled_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      inverse_rms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_closed_form_gradients` for float32 ``x`` [..., H] as one compiled loop: (g_x shaped as ``x``, g_w)."""
    rows = compiled_kernels.rows
    grad_x, grad_weight = compiled_kernels.run(_closed_form_gradients, rows(grad), rows(x), weight, rows(inverse_rms))
    return grad_x.view(x.shape), grad_weight


class ClosedFormRMSNorm(torch.autograd.Function):
    """``ClosedFormRMSNorm.apply(x, weight, eps, compiled=False)``: RMSNorm over the last dimension of a float32
    ``x``, differentiated by the closed form in the module docstring (each way one compiled loop where
    ``compiled``). It keeps x and r for the backward (autograd's chain keeps x̂ as well)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, compiled: bool = False) -> torch.Tensor:
        output, inverse_rms = (compiled_normalise if compiled else _normalise)(x, weight, eps)
        ctx.save_for_backward(x, weight, inverse_rms)
        ctx.compiled = compiled
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        x, weight, inverse_rms = ctx.saved_tensors
        if ctx.compiled:
            grad_x, grad_weight = compiled_backward(grad_output, x, weight, inverse_rms)
            return (grad_x if ctx.needs_input_grad[0] else None,
                    grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None)
        grad_output = grad_output.float()
        x_hat = x * inverse_rms
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_output * x_hat).flatten(0, -2).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x_hat = grad_output * weight
            # r · (g_x̂ − x̂ · mean(g_x̂ ⊙ x̂)) as r·g_x̂ − x̂ · (r · mean): two passes where the three-term form takes three
            mean = torch.linalg.vecdot(grad_x_hat, x_hat).unsqueeze(-1).div_(x.shape[-1])
            grad_x = torch.addcmul(grad_x_hat.mul_(inverse_rms), x_hat, mean.mul_(inverse_rms), value=-1)
        return grad_x, grad_weight, None, None


def _closed_form_class(norm_class: type) -> type:
    """``norm_class`` with a forward that runs :class:`ClosedFormRMSNorm` for a float32 input on a CPU that a
    backward will differentiate, the compiled forward alone where none will but it pays, and ``norm_class``'s
    own forward otherwise."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if hidden_states.device.type == "cpu" and hidden_states.dtype == weight.dtype == torch.float32:
            # decided here, not in the Function: its forward runs with gradients off
            compiled = compiled_kernels.forward_pays(hidden_states)
            if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
                return ClosedFormRMSNorm.apply(hidden_states, weight, self.variance_epsilon, compiled)
            if compiled:  # a frozen reference, old log-probs: the kernel the trained forward runs on this batch
                return compiled_normalise(hidden_states, weight, self.variance_epsilon)[0]
        return norm_class.forward(self, hidden_states)

    return subclass_with_forward(norm_class, "ClosedForm", forward, "_plait_closed_form", __name__)


def _computes_the_formula(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own forward gives :func:`_normalise`'s output, bit for bit, on a float32 probe."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if (not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or not weight.numel()
            or weight.is_meta or weight.dtype != torch.float32 or not isinstance(eps, float)):
        return False
    probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device)
    with torch.no_grad():
        try:
            own = type(module).forward(module, probe)
        except Exception:  # noqa: BLE001 -- a norm that takes other arguments is not this one
            return False
        expected, _ = _normalise(probe, weight, eps)
    return torch.is_tensor(own) and own.dtype == expected.dtype and torch.equal(own, expected)


def closed_form_rms_norms(model: torch.nn.Module) -> int:
    """Make every RMSNorm of ``model`` (a module whose class name ends in ``RMSNorm``, transformers' naming)
    whose own forward computes the formula in the module docstring, bit for bit on a probe, an instance of
    :func:`_closed_form_class` of its class. Returns how many norms it changed; doing it twice changes nothing
    more."""
    changed = 0
    for module in model.modules():
        if (type(module).__name__.endswith("RMSNorm") and not getattr(module, "_plait_closed_form", False)
                and "forward" not in vars(module) and _computes_the_formula(module)):
            module.__class__ = _closed_form_class(type(module))
            changed += 1
    return changed
