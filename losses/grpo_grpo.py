"""GRPO's original loss: the clipped surrogate averaged per sequence, then over sequences.

Shao et al. 2024, "DeepSeekMath", eq. 3. Per token, with ρ = π/π_old and A the group advantage:

    L_t = −min(ρA, clip(ρ, 1 − ε, 1 + ε_high)·A) + β·KL_t
    loss = mean_i( Σ_t L_it·m_it / Σ_t m_it ) ÷ gradient-accumulation steps

Every sequence weighs the same whatever its length, so a token of a long completion counts less
than one of a short completion (the length bias Dr. GRPO and DAPO remove). Returns a scalar.
"""

from plait import hookimpl
from plait.engine.batches import PolicyTokens

from ._grpo import ClipParams, clipped_surrogate, regularise, sequence_mean


def grpo_grpo(batch: PolicyTokens, p: ClipParams):
    return sequence_mean(regularise(clipped_surrogate(batch, p), batch, p), batch)


@hookimpl
def register_losses(register):
    register("grpo.grpo", grpo_grpo, params=ClipParams, consumes=PolicyTokens, output="scalar")
