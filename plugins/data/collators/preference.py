"""Preference batches (DPO, reward models): chosen rows then rejected rows, sharing one padding.

One forward pass over ``2B`` rows gives both log-prob sums; ``batch[k].chunk(2)`` splits any
tensor back into its chosen and rejected halves.
"""

import torch

from plait import hookimpl

from .._collate import check_multiple, pad_token_id, padded_batch, sequences

PASSTHROUGH = ("ref_chosen_logps", "ref_rejected_logps", "margin")


def preference_collator(processing_class, *, pad_to_multiple_of=None, passthrough=PASSTHROUGH):
    """Collate rows with ``prompt_ids``, ``chosen_ids``, ``rejected_ids``.

    Returns ``input_ids``, ``attention_mask``, ``completion_mask`` of shape ``[2B, T]`` (rows
    ``0..B-1`` prompt+chosen, ``B..2B-1`` prompt+rejected, right padded), and each column of
    ``passthrough`` that every row has (cached reference log-probs, reward margins) as a float
    tensor ``[B]``.
    """
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        prompts = [ex["prompt_ids"] for ex in examples] * 2
        completions = [ex["chosen_ids"] for ex in examples] + [ex["rejected_ids"] for ex in examples]
        batch = padded_batch(*sequences(prompts, completions), pad_id, multiple)
        for key in passthrough:
            if all(ex.get(key) is not None for ex in examples):
                batch[key] = torch.tensor([float(ex[key]) for ex in examples], dtype=torch.float32)
        return batch

    return collate


@hookimpl
def register_collators(register):
    register("collator.preference", preference_collator, doc="2B rows [chosen; rejected] with shared padding and completion_mask.")
