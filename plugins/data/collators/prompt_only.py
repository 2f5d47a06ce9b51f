"""Prompt batches for generation (GRPO, RLOO, online methods): left padding, extras passed through."""

from plait import hookimpl
from plait.engine.layout import check_multiple, pad, pad_token_id

TENSOR_KEYS = ("prompt_ids",)


def prompt_only_collator(processing_class, *, pad_to_multiple_of=None):
    """Collate rows with ``prompt_ids``.

    Returns ``input_ids`` and ``attention_mask`` ``[B, T]``, LEFT padded so every prompt ends at
    the last column where generation begins, plus every other column (the raw ``prompt``,
    reward-function inputs such as ``solution``) as a Python list.
    """
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        ids = [ex["prompt_ids"] for ex in examples]
        batch = {
            "input_ids": pad(ids, pad_id, side="left", multiple=multiple),
            "attention_mask": pad([[1] * len(r) for r in ids], 0, side="left", multiple=multiple),
        }
        for key in examples[0]:
            if key not in TENSOR_KEYS:
                batch[key] = [ex[key] for ex in examples]
        return batch

    return collate


@hookimpl
def register_collators(register):
    register("collator.prompt_only", prompt_only_collator, doc="Left-padded prompts for generation; other columns as lists.")
