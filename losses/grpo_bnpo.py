"""BNPO: the clipped surrogate averaged over every completion token of the micro-batch.

Xiao et al. 2025, "BNPO: Beta Normalization Policy Optimization". Per token as in GRPO,

    loss = Σ L·m / Σ m   (over the micro-batch) ÷ gradient-accumulation steps

Tokens weigh the same within a micro-batch; the normaliser still varies between micro-batches,
which ``dapo`` fixes by counting the whole generation batch. Returns a scalar.
"""

from plait import hookimpl
from plait.engine.batches import PolicyTokens

from ._grpo import ClipParams, clipped_surrogate, micro_batch_token_mean, regularise


def grpo_bnpo(batch: PolicyTokens, p: ClipParams):
    return micro_batch_token_mean(regularise(clipped_surrogate(batch, p), batch, p), batch)


@hookimpl
def register_losses(register):
    register("grpo.bnpo", grpo_bnpo, params=ClipParams, consumes=PolicyTokens, output="scalar")
