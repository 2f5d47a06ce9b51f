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

A preference pair's two sequences share their prompt. ``plait_sdpa`` also computes a shared prompt
once (Wang & Hegde 2024, "Accelerating Direct Preference Optimization with Prefix Sharing"): a
segment whose positions begin at p > 0 right after a sequence is a branch of it, attending to that
sequence's first p tokens and then causally to its own (:func:`packed_segments`). Every token sees
exactly the context, and gets exactly the position, it has in its own full sequence.

:func:`packs_per_sequence` puts a model on ``plait_sdpa`` and checks, on a few tokens, that a packed
row gives each sequence exactly what it gets alone; a model whose attention does not follow
``position_ids`` (one that never passes them to its attention layers) fails that check and stays on
what it had.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, sdpa_mask

from .causal_attention import CausalAttention, pays
from .logprobs import sequence_starts

logger = logging.getLogger("plait")

SEQUENCE_SDPA = "plait_sdpa"
# implementations whose kernels already attend within each packed sequence at its own cost
VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def is_varlen_kernel(implementation: str | None) -> bool:
    """A variable-length flash kernel: transformers' own (:data:`VARLEN_KERNELS`), or one loaded from the Hub
    through the ``kernels`` package, named by its repository (``kernels-community/flash-attn3``, with an
    optional ``@revision`` or ``:function``), whose name says flash attention."""
    if not implementation:
        return False
    if implementation in VARLEN_KERNELS:
        return True
    repo = implementation.split(":", 1)[0].split("@", 1)[0]
    return "/" in repo and "flash" in repo.rpartition("/")[2].lower()


class Segment(NamedTuple):
    """One sequence of a packed row: ``size`` tokens from ``start``; a branch (``prefix`` > 0) continues
    the first ``prefix`` tokens of the segment ``root`` (itself where ``prefix`` is 0)."""

    start: int
    size: int
    prefix: int
    root: int


def packed_segments(position_ids: torch.Tensor | None, length: int) -> list[Segment] | None:
    """The sequences of a packed ``[1, length]`` row, or None when the row is one sequence.

    A segment begins where a position does not follow the one before it (as transformers reads
    packing; :func:`plait.engine.logprobs.sequence_starts`). One that begins at position 0 is a sequence of
    its own. One that begins at p > 0 right after such a sequence (or after another branch of it) is
    a branch: it continues that sequence's first p tokens, its prompt, which are computed once for
    all its branches (``collator.preference_prefix_shared``). A branch must begin at a position no
    later than the last one before it (else it reads as that segment going on). A segment that
    begins at p > 0 anywhere else, or past the end of its would-be root, is a sequence of its own."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length):
        return None
    starts = torch.nonzero(sequence_starts(position_ids)[0]).flatten()
    if len(starts) == 1:
        return None
    # one read per forward per layer: cheap beside a layer's work
    starts, firsts = torch.stack([starts, position_ids[0, starts]]).tolist()
    segments: list[Segment] = []
    root = None
    for index, (start, end, first) in enumerate(zip(starts, [*starts[1:], length], firsts)):
        continues = first > 0 and root is not None and first <= segments[root].size
        root = index if first == 0 else root if continues else None
        segments.append(Segment(start, end - start, first if continues else 0, root if continues else index))
    return segments


def prompt_shared_layout(rows: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                         pad_id: int | None = None) -> tuple[list[int], list[int], list[list[int]]]:
    """One packed row holding ``rows`` (token lists, each beginning with a prompt of ``prompt_lengths[i]``
    tokens), every distinct prompt computed once: the first row with a prompt is laid out whole, each
    later row with the same prompt as a branch of it (:func:`packed_segments`) holding the prompt's last
    token and the rest of the row, positions going on from there.

    The branch repeats the prompt's last token so that it holds the position that predicts the row's
    first token past the prompt, and the hidden state a classifier reads where the rest is padding. A
    row whose prompt has one token, or (given ``pad_id``) whose prompt's last token and rest are all
    ``pad_id``, is laid out whole. Returns the row's ``ids`` and ``positions``, and for each row where
    each of its tokens has its hidden state in the packed row (a later row's prompt: in the first's)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (row, length) in enumerate(zip(rows, prompt_lengths, strict=True)):
        groups.setdefault(tuple(row[:length]), []).append(i)
    ids: list[int] = []
    positions: list[int] = []
    index: list[list[int]] = [[] for _ in rows]
    for prompt, (first, *later) in groups.items():
        for i in (first, *later):
            row = list(rows[i])
            readable = pad_id is None or any(t != pad_id for t in row[len(prompt) - 1:])
            shared = len(prompt) - 1 if i != first and len(prompt) > 1 and readable else 0
            start = len(ids)
            ids += row[shared:]
            positions += range(shared, len(row))
            index[i] = index[first][:shared] + list(range(start, len(ids)))
    return ids, positions, index


def branch_mask(size: int, prefix: int, device) -> torch.Tensor:
    """A branch's queries over [its root's prefix; its own keys]: all of the prefix, its own causally."""
    return torch.ones(size, prefix + size, dtype=torch.bool, device=device).tril(diagonal=prefix)[None, None]


def sequence_sdpa_attention(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """``sdpa``, but a packed row without a mask is attended one sequence at a time (causal within each;
    sequences of one length together, as a batch); a branch attends to its root's prefix, then to itself."""
    length = query.shape[2]
    fresh = attention_mask is None and key.shape[2] == length  # no padding, no cache
    segments = packed_segments(position_ids, length) if fresh else None
    if segments is None:
        if fresh and length > 1:  # one sequence a row
            return _attend_causally(module, query, key, value, 0, **kwargs), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # split, not slices: a slice's backward writes its gradient into a zeroed tensor of the whole
    # row, once per sequence (k sequences, k full-row tensors per q, k and v); split's backward is one cat
    pieces = list(zip(*(t.split([s.size for s in segments], dim=2) for t in (query, key, value)), strict=True))
    groups: dict[tuple[int, int], list[int]] = {}
    for index, segment in enumerate(segments):
        groups.setdefault((segment.size, segment.prefix), []).append(index)
    outputs: list[torch.Tensor | None] = [None] * len(segments)
    for (size, prefix), members in groups.items():  # one batched call per shape (~1.3x faster than one by one)

        def batched(part: int) -> torch.Tensor:
            own = [pieces[i][part] for i in members]
            if prefix and part:  # a branch's keys and values: its root's prefix, then its own
                own = [torch.cat([pieces[segments[i].root][part][:, :, :prefix], kv], dim=2) for i, kv in zip(members, own)]
            return torch.cat(own) if len(own) > 1 else own[0]

        attended = _attend_causally(module, batched(0), batched(1), batched(2), prefix, **kwargs)
        for index, output in zip(members, attended.split(1), strict=True):  # [1, size, heads, dim] each
            outputs[index] = output
    return torch.cat(outputs, dim=1), None


def _attend_causally(module, query, key, value, prefix: int, **kwargs) -> torch.Tensor:
    """``sdpa`` over sequences of one length (a branch's queries also over its root's ``prefix``), differentiated
    by :class:`~plait.engine.causal_attention.CausalAttention` where that is faster (bf16 on a CPU)."""
    mask = branch_mask(query.shape[2], prefix, query.device) if prefix else None

    def attend(query, key, value):
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]

    causal = kwargs["is_causal"] if kwargs.get("is_causal") is not None else getattr(module, "is_causal", True)
    plain = causal and not kwargs.get("dropout") and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if plain and pays(query):
        return CausalAttention.apply(query, key, value, kwargs.get("scaling") or query.shape[-1] ** -0.5, attend)
    return attend(query, key, value)


def _right_padded(attention_mask: torch.Tensor) -> bool:
    """Does every row of a 2D padding mask hold its tokens before its padding (as training collators pad)?
    Then causal attention without the mask gives every token what the mask gives it: a token's keys are the
    ones before it, all tokens of its row; only padding positions see padding."""
    if attention_mask.dim() != 2 or torch.compiler.is_compiling():  # reading the values would break a graph
        return False
    kept = attention_mask.bool()
    return bool((kept[:, 1:] <= kept[:, :-1]).all())


def sequence_sdpa_mask(*, attention_mask=None, q_length, kv_length, q_offset=0, kv_offset=0, config=None, **kwargs):
    """No mask where the attention above needs none: no padding (or padding only after each row's tokens, under
    a plain causal mask), no cache, no sliding window or attention chunks (whose patterns only a mask carries).
    Everywhere else ``sdpa``'s mask. A batch padded on the right is then attended causally as if unpadded: the
    same outputs at every token (a padding position's differ, and nothing reads them), in the kernels a
    causal call takes (``is_causal``; a bf16 CPU run's backward in :mod:`plait.engine.causal_attention`)."""
    local = getattr(config, "sliding_window", None) is not None or getattr(config, "attention_chunk_size", None) is not None
    fresh = q_length == kv_length and not q_offset and not kv_offset  # no cache
    if fresh and not local and (attention_mask is None or (kwargs.get("mask_function") is causal_mask_function
                                                            and _right_padded(attention_mask))):
        return None
    return sdpa_mask(attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, config=config, **kwargs)


AttentionInterface.register(SEQUENCE_SDPA, sequence_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SEQUENCE_SDPA, sequence_sdpa_mask)


def _attends_within_sequences(model) -> bool:
    """Does a packed row [a b c | c d | e f], positions [0 1 2 | 2 3 | 0 1], give each token what it gets
    in its own sequence: [a b c], [e f], and, where the attention shares prefixes, the branch [c d]
    continuing [a b] (the sequence [a b c d])? Without that, the row is [a b c | e f]."""
    vocab = model.get_input_embeddings().num_embeddings
    first, branch, last = torch.tensor([[1, 2, 3]]) % vocab, torch.tensor([[3, 6]]) % vocab, torch.tensor([[4, 5]]) % vocab
    with_branch = shares_prefixes(model)
    device = next(model.parameters()).device
    packed = torch.cat([first, branch, last] if with_branch else [first, last], dim=1).to(device)
    positions = torch.tensor([[0, 1, 2, 2, 3, 0, 1] if with_branch else [0, 1, 2, 0, 1]], device=device)
    backbone = getattr(model, model.base_model_prefix, model)  # a causal LM's or a classifier's, alike
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            together = backbone(input_ids=packed, position_ids=positions, use_cache=False).last_hidden_state.float()
            alone = [backbone(input_ids=ids.to(device), use_cache=False).last_hidden_state.float()
                     for ids in (first, torch.cat([first[:, :2], branch], dim=1), last)]
    finally:
        model.train(was_training)
    expected = torch.cat([alone[0], alone[1][:, 2:], alone[2]] if with_branch else [alone[0], alone[2]], dim=1)
    return torch.allclose(together, expected, rtol=1e-3, atol=1e-3)  # rounding; a leak between sequences is O(1)


def shares_prefixes(model) -> bool:
    """Does ``model``'s attention compute a branch over its root's prefix (:func:`packed_segments`)?
    ``plait_sdpa`` does, where no sliding window or attention chunk makes it fall back to a mask (which
    keeps each segment to itself); variable-length flash kernels start a sequence only at position 0."""
    config = model.config
    local = getattr(config, "sliding_window", None) is not None or getattr(config, "attention_chunk_size", None) is not None
    return config._attn_implementation == SEQUENCE_SDPA and not local


def packs_per_sequence(model) -> bool:
    """Put ``model`` on attention that costs a packed row no more than its sequences padded, and say
    whether it did: True on a variable-length flash kernel or on ``plait_sdpa`` (from ``sdpa``, once a
    packed probe matches the sequences run alone); False otherwise, the model left as it was."""
    current = model.config._attn_implementation
    if is_varlen_kernel(current) or current == SEQUENCE_SDPA:
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
