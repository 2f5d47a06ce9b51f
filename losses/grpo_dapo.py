"""DAPO (the default GRPO loss type): token-level mean over the whole generation batch.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 8:

    loss = Σ L·m / N,   N = active completion tokens of the generation batch per process

N is fixed for every micro-batch of one generation batch, so gradient accumulation and several
processes give the same update as one big batch, and every token weighs the same. DAPO pairs
it with a decoupled clip (``epsilon_high`` = 0.28). Returns a scalar.
"""

from plait import hookimpl
from plait.engine.batches import PolicyTokens

from ._grpo import ClipParams, clipped_surrogate, generation_token_mean, regularise


def grpo_dapo(batch: PolicyTokens, p: ClipParams):
    return generation_token_mean(regularise(clipped_surrogate(batch, p), batch, p), batch)


@hookimpl
def register_losses(register):
    register("grpo.dapo", grpo_dapo, params=ClipParams, consumes=PolicyTokens, output="scalar")
