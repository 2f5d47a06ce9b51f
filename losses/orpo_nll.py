"""ORPO's supervised term: NLL of the whole chosen sequence, per token of the batch.

Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", eq. 2,
as the authors' code and TRL 1.16 compute it: every predicted token of the chosen row counts,
the prompt's included:

    ℓ = −Σ_i log π(x_i, y_c,i) / Σ_i (|x_i| + |y_c,i| − 1)

A batch whose method gives no whole-sequence log-probs (``chosen_sequence_logps`` None) gets the
NLL of the chosen completions, ``dpo.sft``'s value. Every pair gets the same value.
"""

from plait import hookimpl
from plait.engine.batches import PreferenceLogps


def orpo_nll(batch: PreferenceLogps, params: None):
    if batch.chosen_sequence_logps is None:
        logps, lengths = batch.plain_chosen_logps, batch.chosen_lengths
    else:
        logps, lengths = batch.chosen_sequence_logps, batch.chosen_sequence_lengths
    # clamp: a batch of empty sequences
    return (-logps.sum() / lengths.sum().clamp(min=1)).expand(batch.batch_size)


@hookimpl
def register_losses(register):
    register("orpo.nll", orpo_nll, consumes=PreferenceLogps, batch_coupled=True)
