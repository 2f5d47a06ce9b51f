"""LUSPO: GSPO's sequence-level clipped surrogate, with each sequence weighted by its length.

Length-Unbiased Sequence Policy Optimization (2025). With the GSPO ratio
ρ_i = exp(mean_t(log π − log π_old)) shared by every token of sequence i:

    L_i = −min(ρ_i A_i, clip(ρ_i, 1 − ε, 1 + ε_high)·A_i)
    loss = mean_i( Σ_t L_i·m_it ) = mean_i( L_i·|y_i| ) ÷ gradient-accumulation steps

GSPO's per-sequence mean makes a long completion's tokens count less; scaling by |y_i| removes
that bias. The ratio is sequence-level by default (``importance_sampling_level``). Returns a scalar.
"""

import attrs

from plait import hookimpl
from plait.batches import PolicyTokens

from ._grpo import ClipParams, _level, clipped_surrogate, length_weighted_sequence_mean, regularise


@attrs.frozen
class LUSPOParams(ClipParams):
    importance_sampling_level: str = attrs.field(default="sequence", validator=_level)


def grpo_luspo(batch: PolicyTokens, p: LUSPOParams):
    return length_weighted_sequence_mean(regularise(clipped_surrogate(batch, p), batch, p), batch)


@hookimpl
def register_losses(register):
    register("grpo.luspo", grpo_luspo, params=LUSPOParams, consumes=PolicyTokens, output="scalar")
