"""Token-classification batches (process reward models): right padding, labels -100 on padding."""

from plait import hookimpl
from plait.engine.layout import check_multiple, pad, pad_token_id


def token_classification_collator(processing_class, *, pad_to_multiple_of=None):
    """Collate rows with ``input_ids`` and per-token ``labels`` (-100 where nothing is predicted).

    Returns ``input_ids``, ``attention_mask`` and ``labels``, all ``[B, T]``, right padded (labels
    with -100).
    """
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        ids = [list(ex["input_ids"]) for ex in examples]
        return {
            "input_ids": pad(ids, pad_id, multiple=multiple),
            "attention_mask": pad([[1] * len(r) for r in ids], 0, multiple=multiple),
            "labels": pad([list(ex["labels"]) for ex in examples], -100, multiple=multiple),
        }

    return collate


@hookimpl
def register_collators(register):
    register("collator.token_classification", token_classification_collator,
             doc="Right-padded token-classification batches with labels -100 on padding (PRM).")
