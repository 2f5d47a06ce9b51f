"""Supervised fine-tuning's negative log-likelihood, per token.

Maximum likelihood on the target tokens (next-token prediction, as in Radford et al. 2018):

    ℓ_t = −log π(y_t | x, y_<t)

Returns ``[B, T]``; the objective averages it over the tokens its mask keeps (completion or
assistant tokens), per micro-batch or over the global token count.
"""

from plait import hookimpl
from plait.engine.batches import TokenLogps


def sft_nll(batch: TokenLogps, params: None):
    return -batch.logps


@hookimpl
def register_losses(register):
    register("sft.nll", sft_nll, consumes=TokenLogps, output="token")
