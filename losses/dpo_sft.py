"""The SFT anchor of a preference objective: token-mean NLL of the chosen completion.

Pang et al. 2024, "Iterative Reasoning Preference Optimization" (RPO: DPO + NLL on the
winner); Liu et al. 2024, "Provably Mitigating Overoptimization in RLHF: Your SFT Loss is
Implicitly an Adversarial Regularizer". Per pair:

    ℓ = −log π(y_c|x) / |y_c|

Composed with a DPO loss at a small weight (0.2–1.0) it keeps the chosen likelihood from
falling while the margin grows. It has no β and takes no parameters.
"""

from plait import hookimpl
from plait.batches import PreferenceLogps


def dpo_sft(batch: PreferenceLogps, params: None):
    return -batch.chosen_logps / batch.chosen_lengths.clamp(min=1)  # clamp: empty completions


@hookimpl
def register_losses(register):
    register("dpo.sft", dpo_sft, consumes=PreferenceLogps)
