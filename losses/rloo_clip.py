"""RLOO's loss: a PPO clip on the whole sequence's importance ratio, averaged over sequences.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs", with a PPO clip for re-used samples. With ρ_i = exp(Σ_t m·(log π −
log π_old)) (the product of the token ratios) and A_i the leave-one-out advantage:

    L_i  = −min(ρ_i A_i, clip(ρ_i, 1 − ε, 1 + ε_high)·A_i)
    loss = mean_i L_i ÷ gradient-accumulation steps

The KL to the reference is part of RLOO's reward, not of this loss. A sampler correction
(``importance_weights``) weighs each sequence by its masked mean. Returns a scalar.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import PolicyTokens, masked_mean
from plait.params import positive

from ._grpo import _optional_positive, sequence_log_ratio


@attrs.frozen
class RLOOClipParams:
    epsilon: float = attrs.field(default=0.2, validator=positive)
    epsilon_high: float | None = attrs.field(default=None, validator=_optional_positive)
    delta: float | None = attrs.field(default=None, validator=_optional_positive)


def rloo_clip(batch: PolicyTokens, p: RLOOClipParams):
    ratio = torch.exp(sequence_log_ratio(batch)).squeeze(-1)
    advantages = batch.advantages if batch.advantages.dim() == 1 else batch.advantages[:, 0]
    clipped = torch.clamp(ratio, 1 - p.epsilon, 1 + (p.epsilon if p.epsilon_high is None else p.epsilon_high))
    capped = ratio if p.delta is None else torch.clamp(ratio, max=p.delta)
    per_sequence = -torch.minimum(capped * advantages, clipped * advantages)
    if batch.importance_weights is not None:
        per_sequence = per_sequence * masked_mean(batch.importance_weights, batch.mask, dim=-1)
    return per_sequence.mean() / batch.gradient_accumulation_steps


@hookimpl
def register_losses(register):
    register("rloo.clip", rloo_clip, params=RLOOClipParams, consumes=PolicyTokens, output="scalar")
