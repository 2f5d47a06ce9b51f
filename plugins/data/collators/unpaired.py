"""Unpaired batches (KTO), with the mismatched pairs its KL estimate needs.

KTO's reference point z is estimated from prompts paired with completions that were written
for *other* prompts (Ethayarajh et al. 2024, KTO, Sec. 4.1): row i's KL pair is prompt i with
the completion of row i-1 (the batch rotated by one).
"""

import torch

from plait import hookimpl

from .._collate import check_multiple, pad_token_id, padded_batch, sequences


def unpaired_collator(processing_class, *, pad_to_multiple_of=None):
    """Collate rows with ``prompt_ids``, ``completion_ids``, ``label``.

    Returns ``input_ids``, ``attention_mask``, ``completion_mask`` ``[B, T]``, ``label`` (bool
    ``[B]``) and ``kl_input_ids``, ``kl_attention_mask``, ``kl_completion_mask`` for the
    mismatched pairs (with ``B = 1`` the pair is the row itself).
    """
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        prompts = [ex["prompt_ids"] for ex in examples]
        completions = [ex["completion_ids"] for ex in examples]
        batch = padded_batch(*sequences(prompts, completions), pad_id, multiple)
        rotated = completions[-1:] + completions[:-1]
        batch.update(padded_batch(*sequences(prompts, rotated), pad_id, multiple, prefix="kl_"))
        batch["label"] = torch.tensor([bool(ex["label"]) for ex in examples], dtype=torch.bool)
        return batch

    return collate


@hookimpl
def register_collators(register):
    register("collator.unpaired", unpaired_collator, doc="KTO batches plus mismatched prompt/completion pairs for the KL estimate.")
