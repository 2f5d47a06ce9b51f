"""VESPO: REINFORCE scaled by a smooth gamma-shaped kernel of the sequence importance ratio.

Shen et al. 2026, "VESPO: Variational Sequence-Level Soft Policy Optimization", with the true
sequence ratio w = exp(Σ_t m·(log π − log π_old)) (no length normalisation):

    φ(w) = exp(λ + k·log w − λ·w)      (= w^k·e^{λ(1−w)}, so φ(1) = 1)
    L_t  = −sg(φ(w))·A·log π           (k, λ) = (k_pos, λ_pos) if A ≥ 0 else (k_neg, λ_neg)

Stale samples (w ≪ 1) and runaway ones (w ≫ 1) are both smoothly down-weighted. Defaults are
the paper's (k, λ) = (2, 3) for A ≥ 0 and (3, 2) for A < 0. Normalised as ``dapo``. Returns a
scalar.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import PolicyTokens
from plait.params import non_negative, positive

from ._grpo import ClipParams, generation_token_mean, regularise, sequence_log_ratio

LOG_W_BOUND = 20.0  # exp(±20) keeps φ finite in float32 for any sequence


@attrs.frozen
class VESPOParams(ClipParams):
    vespo_k_pos: float = attrs.field(default=2.0, validator=non_negative)
    vespo_lambda_pos: float = attrs.field(default=3.0, validator=positive)
    vespo_k_neg: float = attrs.field(default=3.0, validator=non_negative)
    vespo_lambda_neg: float = attrs.field(default=2.0, validator=positive)


def grpo_vespo(batch: PolicyTokens, p: VESPOParams):
    log_w = sequence_log_ratio(batch).detach().clamp(-LOG_W_BOUND, LOG_W_BOUND)
    advantages = batch.token_advantages
    k = torch.where(advantages >= 0, p.vespo_k_pos, p.vespo_k_neg)
    lam = torch.where(advantages >= 0, p.vespo_lambda_pos, p.vespo_lambda_neg)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    per_token = -phi * advantages * batch.logps
    return generation_token_mean(regularise(per_token, batch, p), batch)


@hookimpl
def register_losses(register):
    register("grpo.vespo", grpo_vespo, params=VESPOParams, consumes=PolicyTokens, output="scalar")
