"""Unpaired batches (KTO), with the mismatched pairs its KL estimate needs.

KTO's reference point z is estimated from prompts paired with completions that were written
for *other* prompts (Ethayarajh et al. 2024, KTO, Sec. 4.1). A row may carry its partner's
completion as ``kl_completion_ids`` (KTO fixes them when it prepares the data, so no pair is a
prompt with its own completion); otherwise row i borrows the completion of row i-1 (the batch
rotated by one).
"""

import torch

from plait import hookimpl
from plait.engine.layout import check_multiple, flat_batch, pad_token_id, padded_batch, prompt_shared_batch, sequences

PASSTHROUGH = ("ref_logps", "ref_kl_logps")


def _rows(layout):
    """A layout of prompt and completion lists, from one of token rows and completion masks."""
    return lambda prompts, completions, pad_id, multiple, prefix="": layout(
        *sequences(prompts, completions), pad_id, multiple, prefix=prefix)


def _prompt_shared(prompts, completions, pad_id, multiple, prefix=""):
    return prompt_shared_batch(*sequences(prompts, completions), [len(p) for p in prompts], pad_id, multiple, prefix)


def _unpaired(layout, with_both: bool = False):
    def factory(processing_class, *, pad_to_multiple_of=None, passthrough=PASSTHROUGH):
        pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

        def collate(examples):
            prompts = [ex["prompt_ids"] for ex in examples]
            completions = [ex["completion_ids"] for ex in examples]
            batch = layout(prompts, completions, pad_id, multiple)
            if all(ex.get("kl_completion_ids") is not None for ex in examples):
                mismatched = [ex["kl_completion_ids"] for ex in examples]
            else:
                mismatched = completions[-1:] + completions[:-1]
            batch.update(layout(prompts, mismatched, pad_id, multiple, prefix="kl_"))
            if with_both:  # the reference scores both sides: in one forward, each prompt once
                batch.update(layout(prompts * 2, completions + mismatched, pad_id, multiple, prefix="both_"))
            batch["label"] = torch.tensor([bool(ex["label"]) for ex in examples], dtype=torch.bool)
            for key in passthrough:
                if all(ex.get(key) is not None for ex in examples):
                    batch[key] = torch.tensor([float(ex[key]) for ex in examples], dtype=torch.float32)
            return batch

        return collate

    return factory


unpaired_collator = _unpaired(_rows(padded_batch))
unpaired_collator.__doc__ = """Collate rows with ``prompt_ids``, ``completion_ids``, ``label`` (and optionally
``kl_completion_ids``).

Returns ``input_ids``, ``attention_mask``, ``completion_mask`` ``[B, T]``, ``label`` (bool
``[B]``), ``kl_input_ids``, ``kl_attention_mask``, ``kl_completion_mask`` for the mismatched
pairs (with ``B = 1`` and no ``kl_completion_ids`` the pair is the row itself), and each
column of ``passthrough`` that every row has (cached reference log-probs) as a float ``[B]``.
"""

unpaired_padding_free_collator = _unpaired(_rows(flat_batch))
unpaired_padding_free_collator.__doc__ = """The rows ``collator.unpaired`` takes, each side (the rows and their
mismatched pairs, ``kl_``) back to back in one row without padding: ``input_ids``, ``position_ids``
``[1, N]``, ``seq_lengths`` and ``completion_mask`` as :func:`plait.engine.layout.flat_batch`
lays them out; ``label`` and passthrough columns as in ``collator.unpaired``.
"""

unpaired_prefix_shared_collator = _unpaired(_prompt_shared, with_both=True)
unpaired_prefix_shared_collator.__doc__ = """``collator.unpaired_padding_free`` with each distinct prompt of a side
computed once (:func:`plait.engine.layout.prompt_shared_batch`, ``seq_index`` saying where each row's
tokens sit), plus ``both_``: the rows then their mismatched pairs in one row, each row's prompt held once
for it and its pair, which is what a reference forward that scores both sides reads. Needs attention that
reads branches (:func:`plait.engine.attention.shares_prefixes`).
"""


@hookimpl
def register_collators(register):
    register("collator.unpaired", unpaired_collator, doc="KTO batches plus mismatched prompt/completion pairs for the KL estimate.")
    register("collator.unpaired_padding_free", unpaired_padding_free_collator,
             doc="KTO batches and their mismatched pairs, each side back to back in one row, no padding.")
    register("collator.unpaired_prefix_shared", unpaired_prefix_shared_collator,
             doc="Padding-free KTO batches, each prompt computed once; both_: rows and mismatched pairs together.")
