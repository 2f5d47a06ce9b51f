"""The SFT anchor of a preference objective: NLL of the chosen completions, per token of the batch.

Pang et al. 2024, "Iterative Reasoning Preference Optimization" (RPO: DPO + NLL on the
winner); Liu et al. 2024, "Provably Mitigating Overoptimization in RLHF: Your SFT Loss is
Implicitly an Adversarial Regularizer". Over the batch, as TRL 1.16 computes it:

    ℓ = −Σ_i log π(y_c,i|x_i) / Σ_i |y_c,i|

Every chosen token weighs the same, however long its completion; the log-probs are the plain
ones even when LD-DPO down-weights the tail of the longer completion in the preference terms.
Each pair gets the same value (so WPO weights scale it by their mean, as in TRL 1.16).
Composed with a DPO loss at a small weight (0.2–1.0) it keeps the chosen likelihood from
falling while the margin grows. It has no β and takes no parameters.
"""

from plait import hookimpl
from plait.engine.batches import PreferenceLogps


def dpo_sft(batch: PreferenceLogps, params: None):
    # clamp: a batch whose chosen completions are all empty
    nll = -batch.plain_chosen_logps.sum() / batch.chosen_lengths.sum().clamp(min=1)
    return nll.expand(batch.batch_size)


@hookimpl
def register_losses(register):
    register("dpo.sft", dpo_sft, consumes=PreferenceLogps, batch_coupled=True, f_divergence=True)
