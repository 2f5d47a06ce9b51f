"""LUSPO: the clipped surrogate with each sequence's loss scaled by its length.

Length-Unbiased Sequence Policy Optimization (2025). With L_it the clipped surrogate of token t
of sequence i:

    loss = mean_i( Σ_t L_it·m_it ) ÷ gradient-accumulation steps

GSPO's per-sequence mean makes a long completion's tokens count less; summing instead removes
that bias. The paper pairs it with GSPO's sequence ratio ρ_i = exp(mean_t(log π − log π_old)),
shared by every token of sequence i (then mean_i(L_i·|y_i|)): set
``importance_sampling_level="sequence"``. The default is the token ratio, as in TRL 1.16, which
warns about it as plait does. Returns a scalar.
"""

import logging

import attrs

from plait import hookimpl
from plait.engine.batches import PolicyTokens

from ._grpo import ClipParams, clipped_surrogate, length_weighted_sequence_mean, regularise

logger = logging.getLogger("plait")


@attrs.frozen
class LUSPOParams(ClipParams):
    def __attrs_post_init__(self) -> None:
        if self.importance_sampling_level != "sequence":
            logger.warning("grpo.luspo: importance_sampling_level=%r (the default, as in TRL 1.16); the LUSPO paper "
                           "uses 'sequence'", self.importance_sampling_level)


def grpo_luspo(batch: PolicyTokens, p: LUSPOParams):
    return length_weighted_sequence_mean(regularise(clipped_surrogate(batch, p), batch, p), batch)


@hookimpl
def register_losses(register):
    register("grpo.luspo", grpo_luspo, params=LUSPOParams, consumes=PolicyTokens, output="scalar")
