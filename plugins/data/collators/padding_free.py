"""Padding-free batches: every document of the batch in one row, positions restarting per document.

Without padding no compute is spent on pad tokens; attention stays within documents because
transformers' attention implementations read document boundaries from the restarting
``position_ids`` (so no ``attention_mask`` is returned). Rows that were packed carry
``seq_lengths``; each piece is its own document.
"""

import torch

from plait import hookimpl

from .._collate import check_multiple, pad_token_id, padded_length


def padding_free_collator(processing_class, *, pad_to_multiple_of=None):
    """Return ``input_ids``, ``position_ids``, ``labels``, ``completion_mask`` of shape ``[1, N]``.

    ``labels`` are -100 at each document's first token (no document predicts the next one's
    start) and wherever ``completion_mask`` is 0. Padding up to ``pad_to_multiple_of`` forms one
    extra document with no loss.
    """
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        ids, positions, labels, masks = [], [], [], []
        for ex in examples:
            row = list(ex["input_ids"])
            mask = list(ex.get("completion_mask") or [1] * len(row))
            start = 0
            for length in ex.get("seq_lengths") or [len(row)]:
                doc_ids, doc_mask = row[start:start + length], mask[start:start + length]
                ids += doc_ids
                masks += doc_mask
                positions += range(length)
                labels += [-100] + [t if m else -100 for t, m in zip(doc_ids[1:], doc_mask[1:])]
                start += length
        extra = padded_length(len(ids), multiple) - len(ids)
        ids += [pad_id] * extra
        positions += range(extra)
        labels += [-100] * extra
        masks += [0] * extra

        def row(values):
            return torch.tensor([values], dtype=torch.long)

        return {"input_ids": row(ids), "position_ids": row(positions), "labels": row(labels), "completion_mask": row(masks)}

    return collate


@hookimpl
def register_collators(register):
    register("collator.padding_free", padding_free_collator, doc="Flattened batch, position_ids restart per document, no padding.")
