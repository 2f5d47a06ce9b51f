"""Padded language-modelling batches (SFT): right padding, labels -100 on padding and untrained tokens."""

from plait import hookimpl
from plait.engine.layout import check_multiple, pad_token_id, padded_batch, trained_mask


def language_modeling_collator(processing_class, *, pad_to_multiple_of=None):
    """Collate rows with ``input_ids`` and optional ``completion_mask`` (or ``labels``; default: all ones).

    Returns ``input_ids``, ``attention_mask``, ``completion_mask`` and ``labels`` (``input_ids``
    with -100 wherever ``completion_mask`` is 0, padding included), all ``[B, T]``.
    """
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        ids = [list(ex["input_ids"]) for ex in examples]
        masks = [trained_mask(ex) for ex in examples]
        batch = padded_batch(ids, masks, pad_id, multiple)
        batch["labels"] = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        return batch

    return collate


@hookimpl
def register_collators(register):
    register("collator.language_modeling", language_modeling_collator, doc="Padded LM batches with labels -100 on padding and masked tokens.")
