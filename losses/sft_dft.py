"""Dynamic fine-tuning (DFT): SFT's NLL reweighted by each token's own probability.

Wu et al. 2025, "On the Generalization of SFT: A Reinforcement Learning Perspective with
Reward Rectification". Per token, with p_t = π(y_t | x, y_<t):

    ℓ_t = −sg(p_t)·log p_t        (sg: stop-gradient)

The SFT gradient is a policy gradient with an implicit reward 1/p_t that explodes on unlikely
tokens; scaling by the detached p_t cancels it, which the paper finds generalises better.
Returns ``[B, T]``; the objective does the masked reduction.
"""

from plait import hookimpl
from plait.engine.batches import TokenLogps


def sft_dft(batch: TokenLogps, params: None):
    return -batch.logps.detach().exp() * batch.logps


@hookimpl
def register_losses(register):
    register("sft.dft", sft_dft, consumes=TokenLogps, output="token")
