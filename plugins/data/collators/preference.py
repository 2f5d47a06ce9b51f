"""Preference batches (DPO, reward models): chosen rows then rejected rows.

``collator.preference`` pads the ``2B`` sequences to one width; ``collator.preference_padding_free``
puts them back to back in one row without padding. Either way one forward gives both sides'
log-probs, and the per-row tensors (``completion_mask``, and the log-probs once
:func:`plait.engine.layout.row_token_logprobs` maps them back) have ``2B`` rows, so
``batch[k].chunk(2)`` splits any of them into its chosen and rejected halves.
"""

import torch

from plait import hookimpl
from plait.engine.layout import check_multiple, flat_batch, pad_token_id, padded_batch, prompt_shared_batch, sequences

PASSTHROUGH = ("ref_chosen_logps", "ref_rejected_logps", "margin")


def _sequences(examples: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """prompt+chosen rows then prompt+rejected rows, and their completion masks."""
    prompts = [ex["prompt_ids"] for ex in examples] * 2
    completions = [ex["chosen_ids"] for ex in examples] + [ex["rejected_ids"] for ex in examples]
    return sequences(prompts, completions)


def _add_passthrough(batch: dict, examples: list[dict], passthrough) -> dict:
    for key in passthrough:
        if all(ex.get(key) is not None for ex in examples):
            batch[key] = torch.tensor([float(ex[key]) for ex in examples], dtype=torch.float32)
    return batch


def preference_collator_name(padding_free: bool, prefix_sharing: bool) -> str:
    """The preference collator for a run's batch layout."""
    if prefix_sharing:
        return "collator.preference_prefix_shared"
    return "collator.preference_padding_free" if padding_free else "collator.preference"


def preference_collator(processing_class, *, pad_to_multiple_of=None, passthrough=PASSTHROUGH):
    """Collate rows with ``prompt_ids``, ``chosen_ids``, ``rejected_ids``.

    Returns ``input_ids``, ``attention_mask``, ``completion_mask`` of shape ``[2B, T]`` (rows
    ``0..B-1`` prompt+chosen, ``B..2B-1`` prompt+rejected, right padded), and each column of
    ``passthrough`` that every row has (cached reference log-probs, reward margins) as a float
    tensor ``[B]``.
    """
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        return _add_passthrough(padded_batch(*_sequences(examples), pad_id, multiple), examples, passthrough)

    return collate


def preference_padding_free_collator(processing_class, *, pad_to_multiple_of=None, passthrough=PASSTHROUGH):
    """Collate the rows ``collator.preference`` takes into one row without padding.

    Returns ``input_ids`` and ``position_ids`` ``[1, N]``: the ``2B`` sequences (prompt+chosen
    ones, then prompt+rejected ones) back to back, positions restarting at 0 for each, so
    attention stays within a sequence; ``pad_to_multiple_of`` rounds ``N``. ``seq_lengths``
    ``[2B]`` and ``completion_mask`` ``[2B, T]`` describe the rows as ``collator.preference``
    lays them out (right padded to the longest, no rounding), which is where
    :func:`~plait.engine.layout.row_token_logprobs` puts each token's log-prob back.
    Passthrough columns as in ``collator.preference``.
    """
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        return _add_passthrough(flat_batch(*_sequences(examples), pad_id, multiple), examples, passthrough)

    return collate


def prefix_shared_batch(examples: list[dict], pad_id: int, multiple: int | None) -> dict:
    """The ``2B`` rows in one row, each distinct prompt computed once (:func:`plait.engine.attention.prompt_shared_layout`):
    a pair is its chosen sequence, then its rejected completion as a branch of it. ``seq_index``
    ``[2B, T]`` says where each token of each row (the padded layout's rows) has its hidden state in the
    flat row: the rejected row's prompt, in its chosen sequence."""
    return prompt_shared_batch(*_sequences(examples), [len(ex["prompt_ids"]) for ex in examples] * 2, pad_id, multiple)


def preference_prefix_shared_collator(processing_class, *, pad_to_multiple_of=None, passthrough=PASSTHROUGH):
    """``collator.preference_padding_free`` with each pair's prompt computed once (Wang & Hegde 2024,
    "Accelerating Direct Preference Optimization with Prefix Sharing"): needs attention that reads
    branches (:func:`plait.engine.attention.shares_prefixes`). Returns ``input_ids`` and ``position_ids``
    ``[1, N]``, and ``seq_lengths``, ``seq_index`` and ``completion_mask`` describing the ``2B`` rows as
    ``collator.preference`` lays them out (:func:`prefix_shared_batch`)."""
    pad_id, multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def collate(examples):
        return _add_passthrough(prefix_shared_batch(examples, pad_id, multiple), examples, passthrough)

    return collate


@hookimpl
def register_collators(register):
    register("collator.preference", preference_collator, doc="2B rows [chosen; rejected] with shared padding and completion_mask.")
    register("collator.preference_padding_free", preference_padding_free_collator,
             doc="2B sequences [chosen; rejected] back to back in one row, position_ids restart per sequence, no padding.")
    register("collator.preference_prefix_shared", preference_prefix_shared_collator,
             doc="Padding-free pairs, each prompt computed once: the rejected completion a branch of the chosen sequence.")
