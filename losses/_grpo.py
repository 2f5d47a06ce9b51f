"""Pieces the ``grpo.*`` loss types share: importance ratios, the clipped surrogate, the k3 KL
and the normalisations of Σ L·mask. Not a plugin (underscore): each loss type is its own module.

Every function takes a :class:`plait.engine.batches.PolicyTokens`; per-token terms are ``[B, T]`` (or
``[B, 1]`` at sequence level, broadcast over tokens). Shapes and symbols follow the GRPO table
of the reference semantics: ρ = π/π_old, A the advantage, m the mask.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from plait.engine.batches import PolicyTokens
from plait.errors import PlaitError
from plait.params import finite, in_range, non_negative, positive

LEVELS = ("token", "sequence")


def _level(instance, attribute, value) -> None:
    if value not in LEVELS:
        raise ValueError(f"{attribute.name}={value!r} must be one of {', '.join(LEVELS)}")


def _optional_positive(instance, attribute, value) -> None:
    if value is not None:
        positive(instance, attribute, value)


# top_entropy_quantile: the share of tokens (by entropy) the policy term keeps; 1 keeps them all
in_unit_interval = in_range(0.0, 1.0)


@attrs.frozen
class ClipParams:
    """Knobs every GRPO loss type reads; names and defaults follow TRL's GRPOConfig.

    ``epsilon`` / ``epsilon_high`` bound the ratio clip [1 − ε, 1 + ε_high] (ε_high defaults to ε;
    DAPO recommends 0.28; for cispo it is the truncation cap, ScaleRL uses 5.0). ``delta`` caps ρ
    in the unclipped branch (two-sided clipping, INTELLECT-2). ``beta`` > 0 adds β·KL(π‖π_ref)
    with the k3 estimator, weighted by the importance ratio ρ unless ``use_bias_correction_kl`` is
    False. ``importance_sampling_level`` "sequence" is GSPO's length-normalised sequence ratio.
    ``top_entropy_quantile`` ρ < 1 keeps only the policy term of the top-ρ tokens by entropy
    (:func:`high_entropy_tokens`); ``off_policy_mask_threshold`` δ drops the policy term of
    negative-advantage sequences that drifted more than δ from the sampler (:func:`off_policy_kept`).
    """

    epsilon: float = attrs.field(default=0.2, validator=positive)
    epsilon_high: float | None = attrs.field(default=None, validator=_optional_positive)
    delta: float | None = attrs.field(default=None, validator=_optional_positive)
    beta: float = attrs.field(default=0.0, validator=non_negative)
    importance_sampling_level: str = attrs.field(default="token", validator=_level)
    use_bias_correction_kl: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    top_entropy_quantile: float = attrs.field(default=1.0, validator=in_unit_interval)
    off_policy_mask_threshold: float | None = attrs.field(default=None, validator=attrs.validators.optional(finite))

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
    """Zero the policy term where a mask drops it (off-policy sequences, low-entropy tokens), weight
    it by the sampler correction, then add β·KL (never masked); ``[B, T]``.

    The masks only zero terms: every normaliser still counts the tokens of ``batch.mask``.
    """
    per_token = per_token.expand_as(batch.logps)
    if p.off_policy_mask_threshold is not None:
        per_token = per_token * off_policy_kept(batch, p.off_policy_mask_threshold)
    high = high_entropy_tokens(batch, p.top_entropy_quantile)
    if high is not None:
        per_token = per_token * high
    if batch.importance_weights is not None:
        per_token = per_token * batch.importance_weights
    if p.beta > 0:
        per_token = per_token + p.beta * (corrected_kl(batch, p) if p.use_bias_correction_kl else k3_kl(batch))
    return per_token


# -- token and sequence masks -----------------------------------------------------------------


def off_policy_kept(batch: PolicyTokens, threshold: float) -> Tensor:
    """Off-policy sequence masking (DeepSeek-AI 2025, "DeepSeek-V3.2", eq. 9): 1 where kept.

    A sequence is dropped when its advantage is negative *and* the policy drifted from the one that
    sampled it by more than δ = ``threshold``, measured as the masked mean over its tokens of
    log π_sampler − log π (a KL(π_sampler‖π) estimate, no gradient). π_sampler is the sampler's
    own log-probs when the backend reports them, else π_old; tokens it could not score (NaN)
    count as 0. ``[B, 1]`` (``[B, T]`` for per-token advantages, judged token by token).
    """
    sampler = batch.sampling_logps if batch.sampling_logps is not None else batch.old_logps
    drift = torch.nan_to_num(sampler - batch.logps.detach(), nan=0.0)
    mask = batch.mask.to(drift.dtype)
    mean_drift = (drift * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((batch.token_advantages >= 0) | (mean_drift <= threshold)).to(drift.dtype)


def high_entropy_tokens(batch: PolicyTokens, top: float) -> Tensor | None:
    """The top-``top`` share of counted tokens by entropy (Wang et al. 2025, "Beyond the 80/20 Rule"),
    as a 0/1 ``[B, T]`` mask; None when ``top`` = 1 (every token).

    The cut is the (1 − ``top``) quantile (linear interpolation) of the entropies of every counted
    token of this micro-batch on every process; a token is kept when its entropy is at least the
    cut, so ``top`` = 0 keeps only the highest-entropy token(s).
    """
    if top >= 1.0:
        return None
    if batch.entropy is None:
        raise PlaitError("top_entropy_quantile < 1 but the batch has no token entropies; the method must compute "
                         "them (GRPO does) or set top_entropy_quantile=1.0")
    counted = batch.mask.bool()
    entropy = batch.entropy.detach()
    everyone = batch.gather(entropy[counted].float())
    if everyone.numel() == 0:
        return torch.zeros_like(entropy)
    cut = torch.quantile(everyone, 1.0 - top)
    return ((entropy.float() >= cut) & counted).to(entropy.dtype)


def entropy_sum(batch: PolicyTokens, top: float = 1.0) -> tuple[Tensor, Tensor]:
    """(Σ H·m′, Σ m′) with m′ the counted tokens (only the high-entropy ones when ``top`` < 1), the
    sum with gradient: an entropy bonus acts on the tokens the policy term acts on."""
    if batch.entropy is None:
        raise PlaitError("an entropy bonus needs the batch's token entropies; the method must compute them "
                         "(GRPO does)")
    mask = batch.mask.to(batch.entropy.dtype)
    high = high_entropy_tokens(batch, top)
    if high is not None:
        mask = mask * high
    return (batch.entropy * mask).sum(), mask.sum()


def mean_entropy(batch: PolicyTokens, top: float = 1.0) -> Tensor:
    """H̄ = Σ H·m′ / Σ m′ (see :func:`entropy_sum`)."""
    total, tokens = entropy_sum(batch, top)
    return total / tokens.clamp(min=1.0)


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
