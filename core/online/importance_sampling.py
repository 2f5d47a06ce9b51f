"""Correcting for a sampler whose numerics differ from the trainer's.

An inference engine (vLLM, often in bf16 with its own kernels) samples completion tokens
y_t from π_s, which differs slightly from the trainer's π_old even for the same weights. The
policy-gradient estimate assumes samples from π_old; weighting each token's loss term by

    ρ_t = π_old(y_t) / π_s(y_t) = exp(log π_old(y_t) − log π_s(y_t))

corrects for it, and bounding ρ keeps the variance in check (truncated importance sampling:
Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
Ionides 2008, "Truncated Importance Sampling"). Modes:

- ``token_truncate``: clamp(ρ_t, C_min, C_max); ``token_mask``: ρ_t, or 0 where ρ_t > C_max or
  ρ_t < C_min (the token is dropped);
- ``sequence_truncate`` / ``sequence_mask``: the same with the sequence ratio
  ρ = exp(Σ_t m_t (log π_old − log π_s)) (product over the completion), broadcast to its tokens.

C_max is the cap (``vllm_importance_sampling_clip_max``, 3.0 by default in the online methods),
C_min the floor (``vllm_importance_sampling_clip_min``, none by default); a bound that is None
does not bound. Padding (m_t = 0) contributes a log-ratio of 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
METRICS = tuple(f"sampling/{name}" for name in (
    "sampling_logp_difference/mean", "sampling_logp_difference/max", "importance_sampling_ratio/min",
    "importance_sampling_ratio/mean", "importance_sampling_ratio/max", "importance_sampling_ratio/bounded_fraction"))
_LOG_RATIO_LIMIT = math.log(1e6)  # exp of a larger log-ratio is capped or masked anyway; avoids inf * 0


def importance_weights(trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor, mode: str, cap: float | None,
                       floor: float | None = None) -> Tensor:
    """Per-token weights ``[B, T]`` for the policy term: the (sequence or token) ratio π_old/π_s,
    clamped to [``floor``, ``cap``] (``*_truncate``) or zeroed outside it (``*_mask``); None leaves
    that side unbounded.

    ``trainer_logps`` and ``sampler_logps`` ``[B, T]`` are the log-probs of the sampled completion
    tokens under the trainer (π_old) and the sampler; ``mask`` ``[B, T]`` marks real tokens.
    """
    if mode not in MODES:
        raise ValueError(f"importance-sampling mode {mode!r} is not one of {', '.join(MODES)}")
    log_ratio = (trainer_logps - sampler_logps) * mask
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(trainer_logps)
    ratio = torch.exp(log_ratio.clamp(max=_LOG_RATIO_LIMIT))
    if mode.endswith("truncate"):
        return ratio if cap is None and floor is None else ratio.clamp(min=floor, max=cap)
    return ratio.masked_fill(_outside(ratio, cap, floor), 0.0)


def _outside(ratio: Tensor, cap: float | None, floor: float | None) -> Tensor:
    high = ratio > cap if cap is not None else torch.zeros_like(ratio, dtype=torch.bool)
    return high | (ratio < floor) if floor is not None else high


def importance_sampling_metrics(trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor, mode: str,
                                cap: float | None, floor: float | None = None) -> dict[str, float]:
    """How far the sampler is from the trainer, over the real tokens (TRL's metric names).

    ``sampling/sampling_logp_difference/{mean,max}``: |log π_old − log π_s| per token;
    ``sampling/importance_sampling_ratio/{min,mean,max}``: the weights :func:`importance_weights`
    applies; ``sampling/importance_sampling_ratio/bounded_fraction``: the share of tokens whose
    (token or sequence) ratio lay outside [``floor``, ``cap``] and was truncated or masked. NaN when no token is real.
    """
    real = mask.bool()
    if not real.any():  # NaN, not absent: every process records the same names (they are gathered)
        return dict.fromkeys(METRICS, math.nan)
    gap = (trainer_logps - sampler_logps).abs()[real]
    applied = importance_weights(trainer_logps, sampler_logps, mask, mode, cap, floor)[real]
    level = "sequence_truncate" if mode.startswith("sequence") else "token_truncate"
    ratio = importance_weights(trainer_logps, sampler_logps, mask, level, None)[real]
    values = (gap.mean(), gap.max(), applied.min(), applied.mean(), applied.max(),
              _outside(ratio, cap, floor).float().mean())
    return {name: value.item() for name, value in zip(METRICS, values)}
