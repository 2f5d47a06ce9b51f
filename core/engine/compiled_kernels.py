"""A decoder layer's elementwise chains as single kernels compiled by inductor, under bf16 autocast on a CPU.

Between its GEMMs a decoder layer runs chains of elementwise ops, each a pass over a tensor as large as the
layer's activations; on a CPU each pass is a trip through memory. Two chains are compiled through :func:`run`
(``torch.compile``, inductor's C++ backend) into one loop each:

- **SwiGLU** (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5: FFN = (silu(x W) ⊙ x V) W₂): eager torch
  runs silu and the product forward (twice under gradient checkpointing) and three ops backward; for the gate
  projection's output a, the up projection's b, the gradient g by the product, s = silu(a) and σ = sigmoid(a):

      ∂/∂b = g ⊙ s        ∂/∂a = (g ⊙ b) ⊙ σ (1 + a (1 − σ))

  :class:`SwiGLU` computes the same values, each rounded to bf16 where eager rounds it (silu's output, each
  product), in one pass forward and one backward. :func:`compiled_mlps` makes every MLP whose own forward is
  ``down(silu(gate(x)) ⊙ up(x))`` (checked on a probe, bit for bit) an instance of a subclass that runs it.
- **RMSNorm's closed form** (its two kernels beside the norm, in :mod:`plait.engine.rms_norm`): its forward's
  five ops and its backward's seven passes, one loop each. The compiled forward sums its mean in inductor's
  order, not ATen's (within 1e-7 relative), and bf16 carries such a difference far: a DPO policy whose norms
  ran it while its frozen reference ran transformers' eager ops started at a loss of 0.669 instead of ln 2
  (SmolLM2, 2026-12-06). So the norms take it wherever :func:`forward_pays`, with gradients or without, and a
  frozen reference's norms are converted like the policy's: both compute a batch alike, as the same ops on the
  same rows give the same bits (one kernel serves every number of rows; each row is summed alike).

On SmolLM2-135M (4 × 512 tokens, bf16, 2-core Xeon with AMX, 2026-12-06) a ``training_step`` runs 0.960–0.965
of its time without them for SFT, 0.957–0.958 for DPO, 0.938–0.946 for the reward model (alternated rounds,
``benchmarks/compiled_kernels.py``; the baseline's twin 0.984–1.007); with the norm's forward left eager, SFT
0.981–0.994 and DPO 0.973.
Compiling costs about 4 s a process once inductor's C++ kernels are on disk (6–10 s before), and importing inductor
about 150 MiB of the process's memory, so only batches of :data:`MIN_TOKENS` tokens or more take them, and
``PLAIT_COMPILED_KERNELS=0`` switches them off. A machine where inductor cannot build (no C++ compiler) warns
once and runs eager torch.

The numbers: SwiGLU's are eager's roundings of the same float32 values; inductor's float32 silu and sigmoid may
differ from ATen's in the last float32 place, which bf16 rounding hides (every test finds them bit-equal). The
norm's mean and gradient sum in another order than ATen's (float32; within 1e-7 and 1e-5 relative). Inductor's
FX-graph cache is off for these kernels: in torch 2.13 it handed kernels built for one vector instruction set to
a process on another (AVX2 and AMX), which gave wrong values; its C++ cache, keyed by the generated source and
flags, is shared safely.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import record_function

from .autocast import computed_in_bf16_on_cpu, differentiated_in_bf16_on_cpu
from .subclassing import subclass_with_forward

__all__ = ["SwiGLU", "compiled_mlps", "forward_pays", "pays", "rows", "run"]

logger = logging.getLogger("plait")

COMPUTE_DTYPE = torch.bfloat16
MIN_TOKENS = 1024  # fewer tokens in a batch: eager torch (a kernel call's guards cost ~50 µs; compiling, seconds)
SWITCH = "PLAIT_COMPILED_KERNELS"


def pays(x: Tensor) -> bool:
    """Whether ``x`` (activations [..., width]) goes through the compiled kernels: a CPU tensor of at least
    :data:`MIN_TOKENS` tokens under bf16 autocast, a backward to follow, kernels not switched off or broken."""
    return differentiated_in_bf16_on_cpu(x) and _large_enough(x)


def forward_pays(x: Tensor) -> bool:
    """:func:`pays` with gradients on or off: where a forward whose numbers differ from eager's (the norm's)
    runs compiled, so that a trained model and its frozen reference compute a batch alike."""
    return computed_in_bf16_on_cpu(x) and _large_enough(x)


def _large_enough(x: Tensor) -> bool:
    return (x.numel() >= MIN_TOKENS * x.shape[-1] and not _BROKEN and os.environ.get(SWITCH) != "0"
            and not torch.compiler.is_compiling())


_BROKEN: list[str] = []  # why inductor failed, once it has: every later call runs eager
_COMPILED: dict[Callable, Callable] = {}
# emulate_precision_casts: a cast to bf16 and back inside a kernel rounds, as eager's separate ops round
_INDUCTOR_OPTIONS = {"fx_graph_cache": False, "emulate_precision_casts": True}


def rows(x: Tensor) -> Tensor:
    """``x`` as [tokens, width], not a view: dynamo guards on a view's base (its rank, and a batch size of 1, which
    it specialises), so a kernel given 2-d tensors of their own compiles once for every batch shape."""
    return x.reshape(-1, x.shape[-1]).detach()


def run(kernel: Callable, *args) -> tuple[Tensor, ...]:
    """``kernel(*args)`` compiled (on first use: importing inductor costs a second, so not at import), or eager
    if inductor fails here. ``kernel`` returns a tuple of tensors; its tensor arguments are 2-d (:func:`rows`)."""
    if not _BROKEN:
        compiled = _COMPILED.get(kernel)
        if compiled is None:
            if not _COMPILED:  # the first step stalls a few seconds: say why
                logger.info("plait: compiling SwiGLU and RMSNorm kernels for this CPU (4-10 s, once a process; "
                            "%s=0 skips them)", SWITCH)
            # every kernel takes 2-d tensors, so one compile serves every batch shape; eager's roundings kept
            compiled = _COMPILED[kernel] = torch.compile(kernel, dynamic=True, options=_INDUCTOR_OPTIONS)
        try:
            # gradients off whoever calls: a Function's forward and backward run so already, a frozen norm may not,
            # and dynamo would compile the kernel again for the other grad mode; named for torch's profiler, which
            # sees no op inside an inductor kernel
            with torch.autocast("cpu", enabled=False), torch.no_grad(), record_function(f"plait::{kernel.__name__}"):
                return compiled(*args)
        except Exception as error:  # noqa: BLE001 -- any failure to build: the eager kernel is the same math
            _BROKEN.append(f"{type(error).__name__}: {error}".splitlines()[0])
            warnings.warn(f"plait: inductor could not compile {kernel.__name__} ({_BROKEN[0]}); running eager torch. "
                          f"Set {SWITCH}=0 to skip the attempt", RuntimeWarning, stacklevel=3)
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        return kernel(*args)


def _swiglu(gate: Tensor, up: Tensor) -> tuple[Tensor]:
    """silu(gate) ⊙ up, each op rounded to the inputs' dtype as eager rounds it."""
    dtype = gate.dtype
    return ((F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype),)


def _swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(∂/∂gate, ∂/∂up) of silu(gate) ⊙ up given ``grad``: the product's two gradients and silu's backward,
    rounded where eager's three ops round."""
    dtype = gate.dtype
    a, g = gate.float(), grad.float()
    sigmoid = torch.sigmoid(a)
    silu = (a * sigmoid).to(dtype).float()
    grad_silu = (g * up.float()).to(dtype).float()
    return (grad_silu * (sigmoid * (1 + a * (1 - sigmoid)))).to(dtype), (g * silu).to(dtype)


class SwiGLU(torch.autograd.Function):
    """``SwiGLU.apply(gate, up)``: silu(gate) ⊙ up for bf16 ``gate`` and ``up``, forward and backward each one
    compiled loop (the module docstring)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return run(_swiglu, rows(gate), rows(up))[0].view(gate.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = run(_swiglu_backward, rows(grad), rows(gate), rows(up))
        return grad_gate.view(gate.shape), grad_up.view(up.shape)


def _compiled_mlp_class(mlp_class: type) -> type:
    """``mlp_class`` with a forward that runs :class:`SwiGLU` between its projections where :func:`pays`, and
    ``mlp_class``'s own forward otherwise."""

    def forward(self, x: Tensor) -> Tensor:
        if pays(x):
            gate, up = self.gate_proj(x), self.up_proj(x)
            if gate.dtype == up.dtype == COMPUTE_DTYPE and (gate.requires_grad or up.requires_grad):
                return self.down_proj(SwiGLU.apply(gate, up))
            return self.down_proj(F.silu(gate) * up)
        return mlp_class.forward(self, x)

    return subclass_with_forward(mlp_class, "Compiled", forward, "_plait_compiled", __name__)


def _computes_swiglu(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own forward is down(silu(gate(x)) ⊙ up(x)) of its three layers (plain, a
    :class:`plait.engine.cpu_linear.CpuLinear`, or a LoRA-wrapped one), bit for bit on a float32 probe."""
    gate, up, down = (getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    width = getattr(gate, "in_features", None)
    parameter = next(module.parameters(), None)
    if (not all(isinstance(layer, torch.nn.Module) for layer in (gate, up, down)) or not isinstance(width, int)
            or parameter is None or parameter.is_meta or parameter.dtype != torch.float32):
        return False
    probe = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(parameter.device)
    with torch.no_grad(), torch.autocast(probe.device.type, enabled=False):
        try:
            own = type(module).forward(module, probe)
            expected = down(F.silu(gate(probe)) * up(probe))
        except Exception:  # noqa: BLE001 -- an MLP that takes other arguments or shapes is not this one
            return False
    return torch.is_tensor(own) and own.shape == expected.shape and torch.equal(own, expected)


def compiled_mlps(model: torch.nn.Module) -> int:
    """Make every MLP of ``model`` (a module with ``gate_proj``, ``up_proj`` and ``down_proj`` linear layers and
    no forward of its own) whose forward computes SwiGLU, bit for bit on a probe, an instance of
    :func:`_compiled_mlp_class` of its class. Returns how many it changed; doing it twice changes nothing more."""
    changed = 0
    for module in model.modules():
        if (hasattr(module, "gate_proj") and not getattr(module, "_plait_compiled", False)
                and "forward" not in vars(module) and _computes_swiglu(module)):
            module.__class__ = _compiled_mlp_class(type(module))
            changed += 1
    return changed
