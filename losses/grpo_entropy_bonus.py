"""Entropy bonus: reward the policy for keeping its next-token distributions spread out.

With H_t the entropy of the (tempered) distribution that sampled token t and m the counted
tokens (only the top ``top_entropy_quantile`` by entropy when it is < 1, the tokens the policy
term acts on):

    loss = −(Σ_t H_t·m_t / Σ_t m_t) ÷ gradient-accumulation steps

The term's weight is the coefficient c, so the objective is L_policy − c·H̄ whatever the policy
loss's own normalisation (TRL 1.16's ``entropy_coef``; a negative weight penalises entropy).
Compose it with any ``grpo.*`` loss. Returns a scalar.
"""

import attrs

from plait import hookimpl
from plait.engine.batches import PolicyTokens

from ._grpo import in_unit_interval, mean_entropy


@attrs.frozen
class EntropyBonusParams:
    top_entropy_quantile: float = attrs.field(default=1.0, validator=in_unit_interval)


def grpo_entropy_bonus(batch: PolicyTokens, p: EntropyBonusParams):
    return -mean_entropy(batch, p.top_entropy_quantile) / batch.gradient_accumulation_steps


@hookimpl
def register_losses(register):
    register("grpo.entropy_bonus", grpo_entropy_bonus, params=EntropyBonusParams, consumes=PolicyTokens,
             output="scalar")
