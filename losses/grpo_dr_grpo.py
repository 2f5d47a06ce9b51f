"""Dr. GRPO: the clipped surrogate over a constant normaliser, free of length bias.

Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", eq. 3:

    loss = Σ L·m / (B · max_completion_length) ÷ gradient-accumulation steps

Dividing by a constant instead of each sequence's length removes GRPO's preference for short
correct and long wrong answers. Pair it with ``scale_rewards="none"`` as the paper does.
Returns a scalar.
"""

from plait import hookimpl
from plait.engine.batches import PolicyTokens

from ._grpo import ClipParams, clipped_surrogate, constant_length, regularise


def grpo_dr_grpo(batch: PolicyTokens, p: ClipParams):
    return constant_length(regularise(clipped_surrogate(batch, p), batch, p), batch)


@hookimpl
def register_losses(register):
    register("grpo.dr_grpo", grpo_dr_grpo, params=ClipParams, consumes=PolicyTokens, output="scalar")
