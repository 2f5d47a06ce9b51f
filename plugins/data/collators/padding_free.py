"""Padding-free batches: every document of the batch in one row, positions restarting per document.

Without padding no compute is spent on pad tokens; attention stays within documents because
transformers' attention implementations read document boundaries from the restarting
``position_ids`` (so no ``attention_mask`` is returned). Rows that were packed carry
``seq_lengths``; each piece is its own document.
"""

from plait import hookimpl
from plait.engine.layout import check_multiple, flat_documents, pad_token_id, row_tensor, trained_mask


def padding_free_collator(processing_class, *, pad_to_multiple_of=None):
    """Return ``input_ids``, ``position_ids``, ``labels``, ``completion_mask`` of shape ``[1, N]``.

    ``labels`` are -100 at each document's first token (no document predicts the next one's
    start) and wherever ``completion_mask`` is 0. Padding up to ``pad_to_multiple_of`` forms one
    extra document with no loss.
    """
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        docs, labels, masks = [], [], []
        for ex in examples:
            row, mask = list(ex["input_ids"]), trained_mask(ex)
            start = 0
            for length in ex.get("seq_lengths") or [len(row)]:
                doc_ids, doc_mask = row[start:start + length], mask[start:start + length]
                docs.append(doc_ids)
                masks += doc_mask
                labels += [-100] + [t if m else -100 for t, m in zip(doc_ids[1:], doc_mask[1:])]
                start += length
        batch, extra = flat_documents(docs, pad_id, multiple)
        batch["labels"] = row_tensor(labels + [-100] * extra)
        batch["completion_mask"] = row_tensor(masks + [0] * extra)
        return batch

    return collate


@hookimpl
def register_collators(register):
    register("collator.padding_free", padding_free_collator, doc="Flattened batch, position_ids restart per document, no padding.")
