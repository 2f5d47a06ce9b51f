"""Pieces the ``grpo.*`` loss types share: importance ratios, the clipped surrogate, the k3 KL
and the normalisations of Σ L·mask. Not a plugin (underscore): each loss type is its own module.

Every function takes a :class:`plait.batches.PolicyTokens`; per-token terms are ``[B, T]`` (or
``[B, 1]`` at sequence level, broadcast over tokens). Shapes and symbols follow the GRPO table
of the reference semantics: ρ = π/π_old, A the advantage, m the mask.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from plait.batches import PolicyTokens
from plait.errors import PlaitError
from plait.params import non_negative, positive

LEVELS = ("token", "sequence")


def _level(instance, attribute, value) -> None:
    if value not in LEVELS:
        raise ValueError(f"{attribute.name}={value!r} must be one of {', '.join(LEVELS)}")


def _optional_positive(instance, attribute, value) -> None:
    if value is not None:
        positive(instance, attribute, value)


@attrs.frozen
class ClipParams:
    """Knobs every GRPO loss type reads; names and defaults follow TRL's GRPOConfig.

    ``epsilon`` / ``epsilon_high`` bound the ratio clip [1 − ε, 1 + ε_high] (ε_high defaults to ε;
    DAPO recommends 0.28; for cispo it is the truncation cap, ScaleRL uses 5.0). ``delta`` caps ρ
    in the unclipped branch (two-sided clipping, INTELLECT-2). ``beta`` > 0 adds β·KL(π‖π_ref)
    with the k3 estimator, weighted by the importance ratio ρ unless ``use_bias_correction_kl`` is
    False. ``importance_sampling_level`` "sequence" is GSPO's length-normalised sequence ratio.
    """

    epsilon: float = attrs.field(default=0.2, validator=positive)
    epsilon_high: float | None = attrs.field(default=None, validator=_optional_positive)
    delta: float | None = attrs.field(default=None, validator=_optional_positive)
    beta: float = attrs.field(default=0.0, validator=non_negative)
    importance_sampling_level: str = attrs.field(default="token", validator=_level)
    use_bias_correction_kl: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# -- ratios ------------------------------------------------------------------------------------


def log_ratio(batch: PolicyTokens, level: str) -> Tensor:
    """log ρ: per token ``[B, T]``, or GSPO's masked mean over the sequence ``[B, 1]``."""
    delta = batch.logps - batch.old_logps
    if level == "token":
        return delta
    mask = batch.mask.to(delta.dtype)
    return ((delta * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def sequence_log_ratio(batch: PolicyTokens) -> Tensor:
    """log w = Σ_t m·(log π − log π_old), the true sequence ratio (no length normalisation), ``[B, 1]``."""
    mask = batch.mask.to(batch.logps.dtype)
    return ((batch.logps - batch.old_logps) * mask).sum(-1, keepdim=True)


def clipped_surrogate(batch: PolicyTokens, p: ClipParams, level: str | None = None) -> Tensor:
    """L = −min(min(ρ, δ)·A, clip(ρ, 1 − ε, 1 + ε_high)·A) (PPO, Schulman et al. 2017, eq. 7)."""
    ratio = torch.exp(log_ratio(batch, level or p.importance_sampling_level))
    advantages = batch.token_advantages
    clipped = torch.clamp(ratio, 1 - p.epsilon, 1 + p.eps_high)
    capped = ratio if p.delta is None else torch.clamp(ratio, max=p.delta)
    return -torch.minimum(capped * advantages, clipped * advantages)


# -- what every type adds ----------------------------------------------------------------------


def k3_kl(batch: PolicyTokens) -> Tensor:
    """KL(π‖π_ref) per token, k3 estimator: exp(r) − r − 1 with r = log π_ref − log π (Schulman 2020)."""
    if batch.ref_logps is None:
        raise PlaitError("beta > 0 but the batch has no reference log-probs; the method must load a reference "
                         "(or set beta=0)")
    r = batch.ref_logps - batch.logps
    return torch.exp(r) - r - 1


def corrected_kl(batch: PolicyTokens, p: ClipParams) -> Tensor:
    """ρ·k3 with ρ = π/π_old at the loss's importance-sampling level: the unbiased KL estimate of
    DeepSeek-AI 2025, "DeepSeek-V3.2".

    The completions were sampled from π_old, so k3 averaged over them estimates KL(π_old‖π_ref);
    weighting by ρ (with its gradient) makes the estimate, and its gradient, those of KL(π‖π_ref).
    On-policy ρ = 1 but its gradient is not zero: d(ρ·k3)/d log π = log π − log π_ref per token.
    """
    return torch.exp(log_ratio(batch, p.importance_sampling_level)) * k3_kl(batch)


def regularise(per_token: Tensor, batch: PolicyTokens, p: ClipParams) -> Tensor:
    """Apply the sampler-correction weights to the policy term, then add β·KL; ``[B, T]``."""
    per_token = per_token.expand_as(batch.logps)
    if batch.importance_weights is not None:
        per_token = per_token * batch.importance_weights
    if p.beta > 0:
        per_token = per_token + p.beta * (corrected_kl(batch, p) if p.use_bias_correction_kl else k3_kl(batch))
    return per_token


# -- normalisations of Σ L·m -------------------------------------------------------------------


def _masked(per_token: Tensor, batch: PolicyTokens) -> Tensor:
    return per_token * batch.mask.to(per_token.dtype)


def sequence_mean(per_token: Tensor, batch: PolicyTokens) -> Tensor:
    """grpo, sapo: mean over sequences of (Σ_t L·m / Σ_t m), ÷ gradient-accumulation steps."""
    per_sequence = _masked(per_token, batch).sum(-1) / batch.lengths.clamp(min=1.0)
    return per_sequence.mean() / batch.gradient_accumulation_steps


def micro_batch_token_mean(per_token: Tensor, batch: PolicyTokens) -> Tensor:
    """bnpo: Σ L·m / Σ m over this micro-batch, ÷ gradient-accumulation steps."""
    return _masked(per_token, batch).sum() / batch.lengths.sum().clamp(min=1.0) / batch.gradient_accumulation_steps


def constant_length(per_token: Tensor, batch: PolicyTokens) -> Tensor:
    """dr_grpo: Σ L·m / (B · max_completion_length), ÷ gradient-accumulation steps (Liu et al. 2025)."""
    length = batch.max_completion_length or per_token.shape[-1]
    return _masked(per_token, batch).sum() / (batch.batch_size * length) / batch.gradient_accumulation_steps


def generation_token_mean(per_token: Tensor, batch: PolicyTokens) -> Tensor:
    """dapo, cispo, vespo: Σ L·m / active tokens of the generation batch per process (DAPO, Yu et al. 2025)."""
    total = batch.num_items_in_batch
    if total is None:
        total = batch.lengths.sum()
    total = torch.as_tensor(total, dtype=per_token.dtype, device=per_token.device).clamp(min=1.0)
    return _masked(per_token, batch).sum() / total


def length_weighted_sequence_mean(per_token: Tensor, batch: PolicyTokens) -> Tensor:
    """luspo: mean over sequences of Σ_t L·m (each sequence's mean scaled by |y|), ÷ grad-accum."""
    return _masked(per_token, batch).sum(-1).mean() / batch.gradient_accumulation_steps
