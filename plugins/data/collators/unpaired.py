"""Unpaired batches (KTO), with the mismatched pairs its KL estimate needs.

KTO's reference point z is estimated from prompts paired with completions that were written
for *other* prompts (Ethayarajh et al. 2024, KTO, Sec. 4.1). A row may carry its partner's
completion as ``kl_completion_ids`` (KTO fixes them when it prepares the data, so no pair is a
prompt with its own completion); otherwise row i borrows the completion of row i-1 (the batch
rotated by one).
"""

import torch

from plait import hookimpl

from .._collate import check_multiple, flat_batch, pad_token_id, padded_batch, sequences

PASSTHROUGH = ("ref_logps", "ref_kl_logps")


def _unpaired(layout):
    def factory(processing_class, *, pad_to_multiple_of=None, passthrough=PASSTHROUGH):
        pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

        def collate(examples):
            prompts = [ex["prompt_ids"] for ex in examples]
            completions = [ex["completion_ids"] for ex in examples]
            batch = layout(*sequences(prompts, completions), pad_id, multiple)
            if all(ex.get("kl_completion_ids") is not None for ex in examples):
                mismatched = [ex["kl_completion_ids"] for ex in examples]
            else:
                mismatched = completions[-1:] + completions[:-1]
            batch.update(layout(*sequences(prompts, mismatched), pad_id, multiple, prefix="kl_"))
            batch["label"] = torch.tensor([bool(ex["label"]) for ex in examples], dtype=torch.bool)
            for key in passthrough:
                if all(ex.get(key) is not None for ex in examples):
                    batch[key] = torch.tensor([float(ex[key]) for ex in examples], dtype=torch.float32)
            return batch

        return collate

    return factory


unpaired_collator = _unpaired(padded_batch)
unpaired_collator.__doc__ = """Collate rows with ``prompt_ids``, ``completion_ids``, ``label`` (and optionally
``kl_completion_ids``).

Returns ``input_ids``, ``attention_mask``, ``completion_mask`` ``[B, T]``, ``label`` (bool
``[B]``), ``kl_input_ids``, ``kl_attention_mask``, ``kl_completion_mask`` for the mismatched
pairs (with ``B = 1`` and no ``kl_completion_ids`` the pair is the row itself), and each
column of ``passthrough`` that every row has (cached reference log-probs) as a float ``[B]``.
"""

unpaired_padding_free_collator = _unpaired(flat_batch)
unpaired_padding_free_collator.__doc__ = """The rows ``collator.unpaired`` takes, each side (the rows and their
mismatched pairs, ``kl_``) back to back in one row without padding: ``input_ids``, ``position_ids``
``[1, N]``, ``seq_lengths`` and ``completion_mask`` as :func:`plait.plugins.data._collate.flat_batch`
lays them out; ``label`` and passthrough columns as in ``collator.unpaired``.
"""


@hookimpl
def register_collators(register):
    register("collator.unpaired", unpaired_collator, doc="KTO batches plus mismatched prompt/completion pairs for the KL estimate.")
    register("collator.unpaired_padding_free", unpaired_padding_free_collator,
             doc="KTO batches and their mismatched pairs, each side back to back in one row, no padding.")
