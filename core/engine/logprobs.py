"""The one log-prob path: per-token log-probs of given tokens under a causal LM.

Every method (SFT, DPO, KTO, GRPO, PPO, distillation) calls :func:`token_logprobs`; losses
consume the log-probs it returns, never logits, so each loss formula exists once.

For a model with logits z_t ∈ R^V at position t and temperature τ,

    log p(x_{t+1} | x_{≤t}) = z_t[x_{t+1}]/τ − logsumexp(z_t/τ)
    H_t = −Σ_v p_v log p_v                      (entropy of softmax(z_t/τ))

By default the full [B, T, V] logits are never materialised: the model runs once through the
object passed in (so DDP/FSDP/DeepSpeed wrappers and PEFT adapters see the forward and DDP
all-reduces every gradient), a pre-hook on the output layer captures its input hidden states
and lets it project only one position, and then the output layer is applied to chunks of
positions, each but the last under activation checkpointing so backward recomputes a chunk's
logits rather than storing them (the backward frees the last chunk's graph before it recomputes
another). Peak logits memory is O(chunk_size · V) instead of O(B · T · V). A plain linear output
layer on a CPU takes :class:`~plait.engine.head_statistics.HeadStatistics` instead: the same float32
values in one autograd step with a handwritten backward, one reused [chunk, V] buffer and the softmax
worked out a few rows at a time in cache (1.1-1.4x this path's time in bf16); holding no other tensor of
that size, it takes chunks three times as large by default where a backward follows (which would project
each chunk but the last again: :func:`head_chunk_size`).

``cast_lm_head_to_fp32`` projects the output layer in float32 (its weights and the hidden states
upcast, autocast off), so logits, log-probs and entropies keep fp32 precision under a bf16
autocast (the ScaleRL recipe, Khatri et al. 2025). The layer's stored weights are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from typing import Any, Callable

import attrs
import torch
from accelerate.utils import extract_model_from_parallel
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from plait.engine.head_statistics import HeadStatistics, Statistics
from plait.errors import PlaitError

__all__ = ["TokenLogprobs", "compare_distributions", "default_chunk_size", "fp32_projection", "head_chunk_size",
           "sequence_starts",
           "token_logprobs"]

# fp32 bytes of one chunk's logits; a few temporaries of this size live at once.
LOGITS_BUDGET_BYTES = 128 * 2**20
# Bytes of HeadStatistics' one [chunk, V] buffer, in the projection's dtype: three of the chain's float32 chunks,
# of which that chain holds a few at once (its upcast logits, their log-softmax, the gradients of both)
HEAD_BUFFER_BYTES = 3 * LOGITS_BUDGET_BYTES


@attrs.frozen(eq=False)
class TokenLogprobs:
    """Per-token statistics aligned to ``input_ids``; every tensor is float32 ``[B, T]``.

    ``logps[:, t] = log p(input_ids[:, t] | input_ids[:, <t])``, so a completion mask aligned to
    ``input_ids`` applies directly. At a sequence start (t = 0, or where ``position_ids`` do not
    count on in a padding-free batch) nothing predicts the token and all its statistics are 0.
    ``entropy`` is the entropy of the tempered next-token distribution that predicts token t;
    ``logit_mean`` is the mean over the vocabulary of the model's raw (untempered) logits there.
    """

    logps: Tensor
    entropy: Tensor | None = None
    logit_mean: Tensor | None = None
    argmax: Tensor | None = None  # int64: the most likely token at the position predicting token t
    collision: Tensor | None = None  # log Σ_v p_v², the log collision probability (WPO's normaliser)


def _per_chunk(fn: Callable[..., Any], chunks: list[tuple[Tensor, ...]], needs_grad: bool) -> list:
    """``fn(*chunk)`` for each chunk of positions. With gradients, backward recomputes a chunk's
    projections and statistics rather than keeping its [chunk, V] tensors alive, except the last
    chunk's: the backward (which runs the newest nodes first) frees its graph before it recomputes
    any other, so keeping it costs no peak memory and saves a recompute (GKD's step at 4 x 128
    tokens is one chunk: 4.5 -> 2.6 s in bf16, profiled)."""
    last = len(chunks) - 1
    return [checkpoint(fn, *chunk, use_reentrant=False) if needs_grad and i < last else fn(*chunk)
            for i, chunk in enumerate(chunks)]


def default_chunk_size(vocab_size: int) -> int:
    """Positions per chunk so one chunk's fp32 logits take about ``LOGITS_BUDGET_BYTES``."""
    return max(16, min(4096, LOGITS_BUDGET_BYTES // (4 * vocab_size)))


def head_chunk_size(positions: int, vocab: int, dtype: torch.dtype) -> int:
    """Positions per chunk of :class:`~plait.engine.head_statistics.HeadStatistics` for a call that will be
    differentiated, when the caller gives none: as few chunks as :data:`HEAD_BUFFER_BYTES` allows, of equal size.
    Each chunk but the last is projected twice (forward, then again in the backward) and adds its own
    weight-gradient product into the sum, so fewer chunks is faster:
    SmolLM2's output layer over SFT's 4 × 512 positions in one chunk rather than three, forward and backward,
    914 → 700 ms in bf16 and 3,152 → 2,569 ms in float32 on AVX2; an SFT step 0.936 of the three-chunk one in
    bf16, 0.976 in float32 on AVX2 (2-core Xeon with AMX, 2026-12-06, docs/benchmarks.md)."""
    most = max(16, HEAD_BUFFER_BYTES // (dtype.itemsize * vocab))
    chunks = max(1, -(-positions // most))
    return max(1, -(-positions // chunks))


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    position_ids: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_logit_mean: bool = False,
    with_argmax: bool = False,
    with_collision: bool = False,
    chunk_size: int | None = None,
    chunked: bool = True,
    cast_lm_head_to_fp32: bool = False,
    select: Tensor | None = None,
    **model_kwargs,
) -> TokenLogprobs:
    """Log-probs of ``input_ids`` [B, T] under ``model`` (a causal LM, possibly wrapped).

    ``model`` may be a DDP/accelerate-wrapped module or a PEFT model; its forward is always
    called through that object. A padding-free batch is B = 1 with ``position_ids`` restarting
    at 0 for each document and ``attention_mask=None``. ``chunk_size`` counts positions over the
    flattened batch (default :func:`default_chunk_size`). ``chunked=False`` computes full logits
    through the model's own forward: the same values, for models whose output layer cannot be
    split off. ``cast_lm_head_to_fp32`` computes the output layer in float32 (a plain linear layer
    only). ``select`` [B, T] marks the tokens whose statistics are wanted (e.g. the completion):
    the chunked path projects only the positions that predict them, and the rest come back as 0.
    Methods that score completions pass it: the output layer and the log-softmax over the
    vocabulary cost per position, so a 992-token prompt with a 32-token completion would
    otherwise pay for 31× more positions than it reads. ``model_kwargs`` go to the model's
    forward unchanged.
    """
    _check_arguments(temperature, chunk_size, input_ids)
    forward_kwargs = _forward_kwargs(attention_mask, position_ids, model_kwargs)

    B, T = input_ids.shape
    # Position t predicts token t+1; the last position of each row predicts nothing (target 0).
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1).reshape(-1)
    stats = Statistics(temperature, with_entropy, with_logit_mean, with_argmax, with_collision)

    # the positions to project: position p predicts token p + 1
    rows = None if select is None else _predictors(select.to(input_ids.device).bool(), input_ids.shape)
    if chunked:
        out = _chunked(model, input_ids, forward_kwargs, targets, stats, chunk_size, cast_lm_head_to_fp32, rows)
    else:
        with _fp32_head(model) if cast_lm_head_to_fp32 else contextlib.nullcontext():
            logits = _own_positions(model(input_ids=input_ids, **forward_kwargs).logits, input_ids)
        out = stats(logits.float().reshape(B * T, -1), targets)

    def align(x: Tensor) -> Tensor:
        if rows is not None:
            x = x.reshape(-1).masked_fill(~rows, 0)
        x = torch.cat([x.new_zeros(B, 1), x.reshape(B, T)[:, :-1]], dim=1)
        if position_ids is not None and position_ids.dim() == 2:
            x = x.masked_fill(sequence_starts(position_ids), 0.0)
        return x

    aligned = iter(align(x) for x in out)
    return TokenLogprobs(
        logps=next(aligned),
        entropy=next(aligned) if with_entropy else None,
        logit_mean=next(aligned) if with_logit_mean else None,
        argmax=next(aligned).long() if with_argmax else None,
        collision=next(aligned) if with_collision else None,
    )


def compare_distributions(
    model: torch.nn.Module,
    other: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    fn: Callable[[Tensor, Tensor], Tensor | tuple[Tensor, ...]],
    select: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    chunked: bool = True,
    position_ids: Tensor | None = None,
    **model_kwargs,
) -> tuple[Tensor, ...]:
    """``fn`` applied to two models' next-token distributions at the same positions, chunk by chunk.

    Both causal LMs read ``input_ids`` [B, T]; at every selected position ``fn`` receives
    ``(logp [n, V], other_logp [n, V])``: the log-softmax of each model's logits divided by
    ``temperature``, for ``n`` ≤ ``chunk_size`` positions at a time, and returns one value per
    position ``[n]`` (or a tuple of such). Gradients flow into ``model`` only: ``other`` runs
    without gradient and its log-probs are constants (a teacher, a frozen reference).

    Results are aligned to ``input_ids`` like :func:`token_logprobs`: ``out[:, t]`` comes from the
    distributions that predict token t, and is 0 where ``select`` [B, T] is False (and at t = 0,
    which nothing predicts). Only selected positions are projected at all.

    By default neither model's [B, T, V] logits are materialised: each model runs once through
    the object passed in (wrappers and adapters see the forward), its final hidden states are
    captured at the output layer, and each chunk's two projections, log-softmaxes and ``fn`` run
    under activation checkpointing, so peak logits memory is O(chunk_size · V) for both models
    together. The hidden sizes may differ; the vocabularies must match. ``chunked=False``
    computes full logits through both models' own forwards, for comparison.
    """
    _check_arguments(temperature, chunk_size, input_ids)
    forward_kwargs = _forward_kwargs(attention_mask, position_ids, model_kwargs)
    B, T = input_ids.shape
    wanted = torch.ones_like(input_ids, dtype=torch.bool) if select is None else select.to(input_ids.device).bool()
    if wanted.shape != input_ids.shape:
        raise PlaitError(f"select has shape {tuple(wanted.shape)}; pass a [batch, seq] mask like input_ids {(B, T)}")
    # Position p predicts token p + 1: the hidden states to project are one column to the left.
    rows = torch.cat([wanted[:, 1:], torch.zeros_like(wanted[:, :1])], dim=1)
    if position_ids is not None and position_ids.dim() == 2:  # packed: a document's first token has no predictor
        rows &= torch.cat([~sequence_starts(position_ids)[:, 1:], torch.zeros_like(wanted[:, :1])], dim=1)

    def tempered(logits: Tensor) -> Tensor:
        logits = logits.float()
        return (logits / temperature if temperature != 1.0 else logits).log_softmax(-1)

    if chunked:
        hidden, head, project, output, _ = _final_hidden(model, input_ids, forward_kwargs)
        with torch.no_grad():
            other_hidden, other_head, other_project, _, _ = _final_hidden(other, input_ids, forward_kwargs)
        _check_same_width(_width(head), _width(other_head))
        mine, theirs = hidden[rows], other_hidden[rows]

        def piece(h: Tensor, g: Tensor) -> tuple[Tensor, ...]:
            logp = tempered(project(h))
            with torch.no_grad():
                other_logp = tempered(other_project(g))
            _check_same_width(logp.shape[-1], other_logp.shape[-1])
            out = fn(logp, other_logp)
            return out if isinstance(out, tuple) else (out,)

        size = chunk_size or default_chunk_size(_width(head) or output.logits.shape[-1])
        needs_grad = torch.is_grad_enabled() and (mine.requires_grad or any(p.requires_grad for p in head.parameters()))
        pieces = _per_chunk(piece, list(zip(mine.split(size), theirs.split(size))), needs_grad)
    else:
        logits = model(input_ids=input_ids, **forward_kwargs).logits
        with torch.no_grad():
            other_logits = other(input_ids=input_ids, **forward_kwargs).logits
        _check_same_width(logits.shape[-1], other_logits.shape[-1])
        out = fn(tempered(logits[rows]), tempered(other_logits[rows]))
        pieces = [out if isinstance(out, tuple) else (out,)]

    def align(values: Tensor) -> Tensor:
        full = values.new_zeros(B, T)
        full[rows] = values  # the value for hidden position p belongs to token p + 1
        return torch.cat([full.new_zeros(B, 1), full[:, :-1]], dim=1)

    return tuple(align(torch.cat(parts)) for parts in zip(*pieces))


def _width(head: torch.nn.Module) -> int | None:
    """Vocabulary size an output layer projects to, when it says."""
    width = getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)
    return int(width) if isinstance(width, int) else None


def _check_same_width(mine: int | None, theirs: int | None) -> None:
    if mine is not None and theirs is not None and mine != theirs:
        raise PlaitError(f"the second model predicts over {theirs} tokens but the first over {mine}; distributions "
                         "are only comparable over the same vocabulary (use models that share a tokenizer)")


def _check_arguments(temperature, chunk_size, input_ids: Tensor) -> None:
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and 0 < temperature < float("inf")):
        raise PlaitError(f"temperature={temperature!r} must be a number > 0; use 1.0 for the model's own distribution")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise PlaitError(f"chunk_size={chunk_size!r} must be an integer >= 1 (positions per chunk) or None for the default")
    if input_ids.dim() != 2:
        raise PlaitError(f"input_ids has shape {tuple(input_ids.shape)}; pass a [batch, seq] tensor of token ids")


def sequence_starts(position_ids: Tensor) -> Tensor:
    """[B, T] bool: where a packed sequence (or a branch, :func:`plait.engine.attention.packed_segments`)
    begins, a position that does not follow the one before it; the token the row's previous
    token would seem to predict there belongs to another sequence."""
    follows = position_ids[:, 1:] == position_ids[:, :-1] + 1
    return torch.cat([torch.ones_like(position_ids[:, :1], dtype=torch.bool), ~follows], dim=1)


def _forward_kwargs(attention_mask, position_ids, model_kwargs) -> dict:
    if position_ids is not None and attention_mask is not None and bool(attention_mask.all()):
        # transformers only detects packed documents from position_ids when no mask is given.
        attention_mask = None
    forward_kwargs = {"use_cache": False, **model_kwargs}
    if attention_mask is not None:
        forward_kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        forward_kwargs["position_ids"] = position_ids
    return forward_kwargs


# Output layers already checked to reproduce the model's own logits (see _check_head).
_checked_heads: weakref.WeakSet = weakref.WeakSet()


def fp32_projection(head: torch.nn.Module) -> Callable[[Tensor], Tensor]:
    """``head`` as a float32 projection: weights and input upcast, autocast off."""
    if not isinstance(head, torch.nn.Linear):
        raise PlaitError(f"cast_lm_head_to_fp32=True needs a plain linear output layer, but it is a "
                         f"{type(head).__name__} (an adapter on lm_head?); remove lm_head from the adapter's target "
                         "modules or set cast_lm_head_to_fp32=False")

    def project(h: Tensor) -> Tensor:
        with torch.autocast(h.device.type, enabled=False):
            bias = None if head.bias is None else head.bias.float()
            return torch.nn.functional.linear(h.float(), head.weight.float(), bias)

    return project


@contextlib.contextmanager
def _fp32_head(model):
    """While active, the model's output layer returns its float32 projection (full-logits path)."""
    head = extract_model_from_parallel(model).get_output_embeddings()
    fp32 = fp32_projection(head)
    handle = head.register_forward_hook(lambda module, args, output: fp32(args[0]))
    try:
        yield
    finally:
        handle.remove()


def _final_hidden(model, input_ids, forward_kwargs, fp32_head: bool = False
                  ) -> tuple[Tensor, torch.nn.Module, Callable[[Tensor], Tensor], Any, torch.dtype | None]:
    """Run ``model`` once and return the hidden states its output layer projects ``[B, T, H]``,
    that layer, ``project`` (hidden states -> logits exactly as the model computes them: the layer,
    what follows it (see :func:`_post_head`), under the autocast its forward ran under; with
    ``fp32_head`` the layer in float32 instead), the model's output (logits of one position per row)
    and, for a plain linear layer, the dtype it computes in (see :func:`_linear_dtype`)."""
    inner = extract_model_from_parallel(model)  # unwraps DDP/compile; PeftModel forwards attributes
    head = inner.get_output_embeddings()
    if head is None:
        raise PlaitError(f"{type(inner).__name__} has no output embeddings; pass chunked=False to token_logprobs")
    post = _post_head(inner.config)

    # A pre-hook on the output layer rather than output_hidden_states: it sees exactly the
    # tensor the model projects (after its final norm) for any architecture, keeps no
    # per-layer states alive, and replaces it by one position per row so full logits never form.
    captured: list = []

    def keep_last_position(module, args, kwargs):
        if captured:  # only the first call is the final projection
            return None
        h = args[0] if args else kwargs.pop("input")
        # The RNG state lets _check_head replay dropout inside the layer (e.g. LoRA's) exactly.
        captured.append((h, None if head in _checked_heads else _rng_state(h.device), _autocast_state(h.device)))
        return (h[..., -1:, :], *args[1:]), kwargs

    handle = head.register_forward_pre_hook(keep_last_position, with_kwargs=True)
    try:
        output = model(input_ids=input_ids, **forward_kwargs)
    finally:
        handle.remove()
    if not captured:
        raise PlaitError(f"{type(inner).__name__}'s forward never called its output layer; pass chunked=False to token_logprobs")
    hidden, rng, autocast = captured[0]
    fp32 = fp32_projection(head) if fp32_head else None

    def project(h: Tensor) -> Tensor:
        if fp32 is not None:
            z = fp32(h)
        else:
            # accelerate's mixed precision autocasts only the model's forward; the chunks run after
            # it returns, so they re-enter the same autocast (bf16 projections, as the model's own).
            with autocast():
                z = call(h)
        return z if post is None else post(z)

    # An FSDP2-sharded layer is called through forward(): its module hooks would start a second
    # unshard/reshard cycle of its group outside the model's forward (seen: a segfault in the next
    # backward); its weights are still gathered here (accelerate keeps the output group unsharded).
    call = head.forward if _fsdp2_sharded(head) else head

    if rng is not None:
        _check_head(head, project, hidden, output.logits, rng)
    return hidden, head, project, output, _linear_dtype(head, post, fp32_head, autocast, hidden)


def _linear_dtype(head: torch.nn.Module, post, fp32_head: bool, autocast: functools.partial, hidden: Tensor) -> torch.dtype | None:
    """The dtype ``head`` computes in, where :class:`~plait.engine.head_statistics.HeadStatistics` can stand in
    for it: a plain linear layer that nothing follows and no hook or adapter changes, with an ordinary local
    weight (not sharded), on a CPU (where its gain was measured; elsewhere the autograd chain stays)."""
    module_hooks = torch.nn.modules.module
    if (type(head) is not torch.nn.Linear or post is not None or hidden.device.type != "cpu"
            or head._forward_hooks or head._forward_pre_hooks
            or module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks
            or type(head.weight) not in (torch.Tensor, torch.nn.Parameter) or hasattr(head.weight, "ds_id")
            or head.weight.shape[-1] != hidden.shape[-1] or _fsdp2_sharded(head)):
        return None
    if fp32_head:
        return torch.float32
    return autocast.keywords["dtype"] if autocast.keywords["enabled"] else head.weight.dtype


def _fsdp2_sharded(module: torch.nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # loaded wherever a module was sharded; never imported here
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def _predictors(select: Tensor, shape: torch.Size) -> Tensor:
    """Flat [B·T] mask of the positions that predict the selected tokens (one column to the left)."""
    if select.shape != shape:
        raise PlaitError(f"select has shape {tuple(select.shape)}; pass a [batch, seq] mask like input_ids {tuple(shape)}")
    return torch.cat([select[:, 1:], torch.zeros_like(select[:, :1])], dim=1).reshape(-1)


def _chunked(model, input_ids, forward_kwargs, targets, stats: Statistics, chunk_size,
             fp32_head: bool = False, rows: Tensor | None = None) -> tuple[Tensor, ...]:
    hidden, head, project, output, linear_dtype = _final_hidden(model, input_ids, forward_kwargs, fp32_head)
    flat = _own_positions(hidden, input_ids).reshape(-1, hidden.shape[-1])
    if rows is not None:
        flat, targets = flat[rows], targets[rows]
    vocab = getattr(head, "out_features", None) or output.logits.shape[-1]
    needs_grad = torch.is_grad_enabled() and (flat.requires_grad or any(p.requires_grad for p in head.parameters()))
    if linear_dtype is not None and not stats.with_collision:
        # a backward projects each chunk but the last again: one large chunk where its buffer allows
        trained = head_chunk_size(flat.shape[0], vocab, linear_dtype) if needs_grad else None
        size = chunk_size or trained or default_chunk_size(vocab)
        values = HeadStatistics.apply(flat, head.weight, head.bias, targets, linear_dtype, size, stats)
    else:
        size = chunk_size or default_chunk_size(vocab)

        def chunk_stats(h: Tensor, t: Tensor) -> tuple[Tensor, ...]:
            return stats(project(h).float(), t)

        pieces = _per_chunk(chunk_stats, list(zip(flat.split(size), targets.split(size))), needs_grad)
        values = tuple(torch.cat(parts) if parts else flat.new_zeros(0) for parts in zip(*pieces))
    if rows is None:
        return values
    return tuple(v.new_zeros(rows.shape[0]).masked_scatter(rows, v) for v in values)


def _own_positions(values: Tensor, input_ids: Tensor) -> Tensor:
    """``values`` [B, T', ...] at the positions of ``input_ids`` [B, T]: a PEFT prompt-learning model (prompt
    tuning, P-tuning) prepends T' - T virtual tokens, whose outputs predict none of the given tokens."""
    extra = values.shape[1] - input_ids.shape[1]
    return values[:, extra:] if extra > 0 else values


def _post_head(config) -> Callable[[Tensor], Tensor] | None:
    """What a transformers model does to its output layer's result before returning logits (None: nothing)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)  # Cohere multiplies
    divisor = getattr(text, "logits_scaling", None)  # Granite divides
    cap = getattr(text, "final_logit_softcapping", None)  # Gemma 2/3: cap·tanh(z/cap)
    if not (isinstance(scale, (int, float)) or isinstance(divisor, (int, float)) or cap):
        return None

    def post(z: Tensor) -> Tensor:
        if isinstance(scale, (int, float)):
            z = z * scale
        if isinstance(divisor, (int, float)):
            z = z / divisor
        if cap:
            z = torch.tanh(z / cap) * cap
        return z

    return post


def _rng_state(device: torch.device) -> tuple:
    accel = None if device.type == "cpu" else torch.get_device_module(device.type).get_rng_state(device)
    return torch.get_rng_state(), accel


def _autocast_state(device: torch.device) -> functools.partial:
    """A context manager factory that re-enters the autocast state active now on ``device`` (its
    ``keywords`` say whether it is enabled and in which dtype)."""
    enabled = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type)
    return functools.partial(torch.autocast, device.type, dtype=dtype, enabled=enabled)


def _check_head(head, project, hidden: Tensor, model_logits: Tensor, rng: tuple) -> None:
    """Once per output layer: our projection of the last position must match the model's."""
    device = hidden.device
    accel = [] if device.type == "cpu" else [device]
    with torch.no_grad(), torch.random.fork_rng(devices=accel, device_type=device.type):
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.get_device_module(device.type).set_rng_state(rng[1], device)
        ours = project(hidden[..., -1:, :]).float()
    theirs = model_logits.detach().float()
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=2e-2, atol=2e-2):
        raise PlaitError(
            f"{type(head).__name__} output differs from the model's logits (an unknown transform follows the output "
            "layer); pass chunked=False to token_logprobs"
        )
    _checked_heads.add(head)
