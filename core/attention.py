"""Padding-free batches at the cost of their tokens: scaled-dot-product attention per packed sequence.

A padding-free batch is one row holding several sequences back to back, ``position_ids``
restarting at 0 for each (:mod:`plait.plugins.data.collators.padding_free`,
``collator.preference_padding_free``). transformers' ``sdpa`` keeps those sequences apart with an
``N × N`` block-diagonal mask and computes attention over all N² query-key pairs: for 8 sequences of
512 tokens that is 8× the attention work of the padded batch, and the mask costs N² bytes. Flash
attention's variable-length kernels (CUDA) compute only Σ Lᵢ² pairs; ``plait_sdpa`` does the same
with torch's SDPA, one causal call per sequence (sequences of one length batched together), and is
``sdpa`` unchanged for every other batch (padded rows, generation with a cache). So dropping the
padding never costs more than keeping it.

:func:`packs_per_sequence` puts a model on ``plait_sdpa`` and checks, on a few tokens, that a packed
row gives each sequence exactly what it gets alone; a model whose attention does not follow
``position_ids`` (one that never passes them to its attention layers) fails that check and stays on
what it had.
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

logger = logging.getLogger("plait")

SEQUENCE_SDPA = "plait_sdpa"
# implementations whose kernels already attend within each packed sequence at its own cost
VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def sequence_starts(position_ids: torch.Tensor | None, length: int) -> list[int] | None:
    """Where each packed sequence of a ``[1, length]`` row begins (a position that does not follow
    the one before it, as transformers reads packing), or None when the row is one sequence."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length):
        return None
    positions = position_ids[0]
    starts = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    return [0, *starts] if starts else None


def sequence_sdpa_attention(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """``sdpa``, but a packed row without a mask is attended one sequence at a time (causal within each;
    sequences of one length together, as a batch)."""
    length = query.shape[2]
    starts = sequence_starts(position_ids, length) if attention_mask is None and key.shape[2] == length else None
    if starts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    sizes = [b - a for a, b in zip(starts, [*starts[1:], length])]
    # split, not slices: a slice's backward writes its gradient into a zeroed tensor of the whole
    # row, once per sequence (k sequences, k full-row tensors per q, k and v); split's backward is one cat
    pieces = list(zip(*(t.split(sizes, dim=2) for t in (query, key, value)), strict=True))
    by_size: dict[int, list[int]] = {}
    for index, size in enumerate(sizes):
        by_size.setdefault(size, []).append(index)
    outputs: list[torch.Tensor | None] = [None] * len(sizes)
    for members in by_size.values():  # sequences of one length attend in one batched call (~1.3x faster than one by one)
        q, k, v = (torch.cat([pieces[i][part] for i in members]) if len(members) > 1 else pieces[members[0]][part]
                   for part in range(3))
        attended = sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]  # [len(members), size, heads, dim]
        for index, output in zip(members, attended.split(1), strict=True):
            outputs[index] = output
    return torch.cat(outputs, dim=1), None


def sequence_sdpa_mask(*, attention_mask=None, q_length, kv_length, q_offset=0, kv_offset=0, config=None, **kwargs):
    """No mask where the attention above needs none: no padding, no cache, no sliding window or
    attention chunks (whose patterns only a mask carries). Everywhere else ``sdpa``'s mask."""
    fresh = attention_mask is None and q_length == kv_length and not q_offset and not kv_offset
    local = getattr(config, "sliding_window", None) is not None or getattr(config, "attention_chunk_size", None) is not None
    if fresh and not local:
        return None
    return sdpa_mask(attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, config=config, **kwargs)


AttentionInterface.register(SEQUENCE_SDPA, sequence_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SEQUENCE_SDPA, sequence_sdpa_mask)


def _attends_within_sequences(model) -> bool:
    """Does a packed row [a b c | d e] give each sequence the outputs it gets alone?"""
    vocab = model.get_input_embeddings().num_embeddings
    first, second = torch.tensor([[1, 2, 3]]) % vocab, torch.tensor([[4, 5]]) % vocab
    device = next(model.parameters()).device
    packed = torch.cat([first, second], dim=1).to(device)
    positions = torch.tensor([[0, 1, 2, 0, 1]], device=device)
    backbone = getattr(model, model.base_model_prefix, model)  # a causal LM's or a classifier's, alike
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            together = backbone(input_ids=packed, position_ids=positions, use_cache=False).last_hidden_state.float()
            alone = torch.cat([backbone(input_ids=ids.to(device), use_cache=False).last_hidden_state.float()
                               for ids in (first, second)], dim=1)
    finally:
        model.train(was_training)
    return torch.allclose(together, alone, rtol=1e-3, atol=1e-3)  # rounding; a leak between sequences is O(1)


def packs_per_sequence(model) -> bool:
    """Put ``model`` on attention that costs a packed row no more than its sequences padded, and say
    whether it did: True on a variable-length flash kernel or on ``plait_sdpa`` (from ``sdpa``, once a
    packed probe matches the sequences run alone); False otherwise, the model left as it was."""
    current = model.config._attn_implementation
    if current in VARLEN_KERNELS or current == SEQUENCE_SDPA:
        return True
    if current != "sdpa" or not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return False
    model.set_attn_implementation(SEQUENCE_SDPA)
    if _attends_within_sequences(model):
        return True
    model.set_attn_implementation(current)
    logger.info("%s does not pass position_ids to its attention: padding-free batches use sdpa's block mask "
                "(correct, but attention costs the whole row squared)", type(model).__name__)
    return False
