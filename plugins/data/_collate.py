"""Padding helpers shared by the collator plugins (not a plugin itself)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from plait.chat import tokenizer_of
from plait.errors import PlaitError


def pad_token_id(processing_class: Any) -> int:
    tokenizer = tokenizer_of(processing_class)
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if value is not None:
            return int(value)
    raise PlaitError("the tokenizer has neither pad_token nor eos_token; set tokenizer.pad_token before training")


def check_multiple(pad_to_multiple_of: int | None) -> int | None:
    if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
        raise PlaitError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be a positive integer or None")
    return pad_to_multiple_of


def padded_length(length: int, multiple: int | None) -> int:
    return -(-length // multiple) * multiple if multiple else length


def pad(rows: Sequence[Sequence[int]], value: int, *, side: str = "right", multiple: int | None = None) -> torch.Tensor:
    """A [len(rows), T] long tensor, ``T`` the longest row rounded up to ``multiple``."""
    width = padded_length(max((len(r) for r in rows), default=0), multiple)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            if side == "right":
                out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            else:
                out[i, width - len(row):] = torch.as_tensor(row, dtype=torch.long)
    return out


def sequences(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """prompt + completion token rows and their completion masks."""
    ids = [list(p) + list(c) for p, c in zip(prompts, completions)]
    masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)]
    return ids, masks


def padded_batch(ids: list[list[int]], masks: list[list[int]], pad_id: int, multiple: int | None, prefix: str = "") -> dict:
    """Right-padded input_ids, attention_mask and completion_mask (keys optionally prefixed)."""
    return {
        f"{prefix}input_ids": pad(ids, pad_id, multiple=multiple),
        f"{prefix}attention_mask": pad([[1] * len(r) for r in ids], 0, multiple=multiple),
        f"{prefix}completion_mask": pad(masks, 0, multiple=multiple),
    }
