"""Padding helpers shared by the collator plugins (not a plugin itself)."""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from plait.data.chat import tokenizer_of
from plait.data.vision import model_inputs
from plait.errors import PlaitError


def pad_token_id(processing_class: Any) -> int:
    tokenizer = tokenizer_of(processing_class)
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if value is not None:
            return int(value)
    raise PlaitError("the tokenizer has neither pad_token nor eos_token; set tokenizer.pad_token before training")


# Devices that compile once per input shape: "auto" pads their batches to this multiple so a run
# compiles for a few widths instead of one per batch (TRL 1.16: 128 on AWS Neuron, no padding elsewhere).
SHAPE_COMPILING_DEVICES = {"neuron": 128}


def check_multiple(pad_to_multiple_of: int | str | None, device_type: str | None = None) -> int | None:
    """The multiple a collator pads to: a positive integer, None (no rounding) or ``"auto"``,
    which is :data:`SHAPE_COMPILING_DEVICES`' value for the accelerator in use (``device_type``,
    default the current one) and None elsewhere."""
    if pad_to_multiple_of == "auto":
        if device_type is None:
            accelerator = torch.accelerator.current_accelerator()
            device_type = accelerator.type if accelerator is not None else "cpu"
        return SHAPE_COMPILING_DEVICES.get(device_type)
    if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
        raise PlaitError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be a positive integer, None or 'auto'")
    return pad_to_multiple_of


def pad_multiple_field():
    """The ``pad_to_multiple_of`` field of a method's params: TRL 1.16's default ``"auto"``, checked
    when the config is built."""

    def validate(instance, attribute, value) -> None:
        try:
            check_multiple(value, device_type="cpu")
        except PlaitError as err:
            raise ValueError(str(err)) from None

    return attrs.field(default="auto", validator=validate)


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


def row_tensor(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.long)


def flat_documents(docs: Sequence[Sequence[int]], pad_id: int, multiple: int | None) -> tuple[dict, int]:
    """Every document back to back in one row: ``input_ids`` and ``position_ids`` ``[1, N]``, the
    positions restarting at 0 for each document, which is how transformers' attention tells the
    documents apart (no ``attention_mask``). Padding up to ``multiple`` forms one extra document;
    its length is returned too, for the caller's per-token columns."""
    ids = [t for doc in docs for t in doc]
    positions = [p for doc in docs for p in range(len(doc))]
    extra = padded_length(len(ids), multiple) - len(ids)
    return {"input_ids": row_tensor(ids + [pad_id] * extra), "position_ids": row_tensor(positions + list(range(extra)))}, extra


def flat_batch(ids: list[list[int]], masks: list[list[int]], pad_id: int, multiple: int | None, prefix: str = "") -> dict:
    """The rows :func:`padded_batch` lays out, back to back in one row without padding: ``input_ids``
    and ``position_ids`` ``[1, N]`` (:func:`flat_documents`), with ``seq_lengths`` ``[rows]`` and
    ``completion_mask`` ``[rows, T]`` as the padded layout has it (right padded, no rounding), which is
    where :func:`row_token_logprobs` puts each token's log-prob back (keys optionally prefixed)."""
    batch, _ = flat_documents(ids, pad_id, multiple)
    batch["seq_lengths"] = torch.tensor([len(row) for row in ids], dtype=torch.long)
    batch["completion_mask"] = pad(masks, 0)
    return {f"{prefix}{key}": value for key, value in batch.items()}


def prompt_shared_batch(ids: list[list[int]], masks: list[list[int]], prompt_lengths: Sequence[int], pad_id: int,
                        multiple: int | None, prefix: str = "") -> dict:
    """The rows :func:`flat_batch` lays out, each distinct prompt computed once
    (:func:`plait.engine.attention.prompt_shared_layout`): ``input_ids`` and ``position_ids`` ``[1, N]``,
    ``seq_lengths`` and ``completion_mask`` as in :func:`flat_batch`, and ``seq_index`` ``[rows, T]``:
    where each row's tokens have their hidden states (a later row's prompt: in the first row with it)."""
    from .attention import prompt_shared_layout

    flat, positions, index = prompt_shared_layout(ids, prompt_lengths, pad_id)
    extra = padded_length(len(flat), multiple) - len(flat)
    batch = {"input_ids": row_tensor(flat + [pad_id] * extra), "position_ids": row_tensor(positions + list(range(extra))),
             "seq_lengths": torch.tensor([len(row) for row in ids], dtype=torch.long),
             "seq_index": pad(index, 0), "completion_mask": pad(masks, 0)}
    return {f"{prefix}{key}": value for key, value in batch.items()}


def trained_mask(example: dict) -> list[int]:
    """Which tokens of a tokenised language-modelling row are trained on: its ``completion_mask``;
    else its ``labels``, -100 where not trained (a dataset tokenised elsewhere, e.g. for TRL with
    ``skip_prepare_dataset``; the targets are ``input_ids``); else every token."""
    if example.get("completion_mask") is not None:
        return list(example["completion_mask"])
    if example.get("labels") is not None:
        return [int(label != -100) for label in example["labels"]]
    return [1] * len(example["input_ids"])


def within_lengths(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]`` bool: True at each row's first ``lengths[row]`` columns (its tokens, right padded)."""
    return torch.arange(width, device=lengths.device) < lengths[:, None]


def contiguous_index(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]``: where each token of each row sits in a padding-free row holding the rows back
    to back in order (padding points at the row's own start)."""
    starts = lengths.cumsum(0) - lengths
    inside = within_lengths(lengths, width)
    return torch.where(inside, starts[:, None] + torch.arange(width, device=lengths.device), starts[:, None])


def rows_from_flat(values: torch.Tensor, lengths: torch.Tensor, width: int, fill: float = 0,
                   index: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token values of a padding-free row ``[1, N, ...]`` laid out as right-padded rows
    ``[len(lengths), width, ...]``, ``fill`` in the padding. ``index`` ``[rows, ≥width]`` says where each
    row's tokens sit in the flat row (a prefix-shared batch's ``seq_index``); default, the rows back to
    back in order (a rounding tail beyond ``lengths.sum()`` is dropped). Gradients flow back to ``values``."""
    lengths = lengths.to(values.device)
    index = contiguous_index(lengths, width) if index is None else index[:, :width].to(values.device)
    inside = within_lengths(lengths, width)
    inside = inside.reshape(*inside.shape, *[1] * (values.dim() - 2))
    return values[0][index].masked_fill(~inside, fill)


def flat_index(batch: dict, prefix: str = "") -> torch.Tensor:
    """Where each token of each row of a padding-free batch sits in its flat row, ``[rows, T]``."""
    if f"{prefix}seq_index" in batch:
        return batch[f"{prefix}seq_index"]
    return contiguous_index(batch[f"{prefix}seq_lengths"], batch[f"{prefix}completion_mask"].shape[1])


def rows_attended(batch: dict) -> torch.Tensor:
    """The ``attention_mask`` ``[rows, T]`` of a collated batch's rows in the padded layout, whatever
    its layout (a padding-free batch's rows are ``seq_lengths`` long, right padded to ``T``)."""
    if "attention_mask" in batch:
        return batch["attention_mask"]
    mask = batch["completion_mask"]
    return within_lengths(batch["seq_lengths"].to(mask.device), mask.shape[1]).to(mask.dtype)


def row_token_logprobs(token_logprobs, model, batch: dict, prefix: str = "", completion_only: bool = False, **kwargs):
    """``token_logprobs(model, ...)`` for the rows of a collated batch, ``[rows, T]`` aligned with its
    ``completion_mask``, whatever its layout: padded (``input_ids``, ``attention_mask``) or
    padding-free (``input_ids``, ``position_ids`` ``[1, N]`` and ``seq_lengths``; one forward over
    the flat row, each statistic put back in its row). ``prefix`` selects keys (``"kl_"``).
    ``completion_only`` computes the statistics of completion tokens only (the rest are 0): the
    output layer then projects only the positions that predict them."""
    ids = batch[f"{prefix}input_ids"]
    mask = batch[f"{prefix}completion_mask"]
    if f"{prefix}position_ids" not in batch:
        extra = model_inputs(batch, prefix=prefix)  # a VLM's pixel_values etc. (plait.data.vision)
        select = mask if completion_only else None
        return token_logprobs(model, ids, batch[f"{prefix}attention_mask"], select=select, **extra, **kwargs)
    index = flat_index(batch, prefix)
    select = None
    if completion_only:
        select = torch.zeros_like(ids, dtype=torch.bool)
        select[0, index.to(ids.device)[mask.bool()]] = True
    out = token_logprobs(model, ids, position_ids=batch[f"{prefix}position_ids"], select=select, **kwargs)
    lengths, width = batch[f"{prefix}seq_lengths"], mask.shape[1]
    per_row = {name: rows_from_flat(value, lengths, width, index=index)
               for name, value in attrs.asdict(out, recurse=False).items() if value is not None}
    return attrs.evolve(out, **per_row)


class RegisteredCollator:
    """A registered collator as a data loader holds it: built from its registry entry on first use, and
    pickled as that entry's name and arguments. Collator factories return closures, which pickle cannot
    carry to data-loader workers started by spawn or forkserver (``dataloader_num_workers`` > 0 on macOS,
    on Python 3.14, or with ``dataloader_multiprocessing_context="spawn"``); a worker rebuilds the closure
    from the installed plugins instead."""

    def __init__(self, plugins: Any, name: str, *args: Any, **options: Any):
        self.plugins, self.name, self.args, self.options = plugins, name, args, options
        self._collate = None

    def __call__(self, examples):
        if self._collate is None:
            if self.plugins is None:  # unpickled in a worker process: the installed plugins
                from plait.manager import default_plugins

                self.plugins = default_plugins()
            self._collate = self.plugins.collators.get(self.name).obj(*self.args, **self.options)
        return self._collate(examples)

    def __getstate__(self) -> dict:
        return {**vars(self), "plugins": None, "_collate": None}

    def __repr__(self) -> str:
        return f"RegisteredCollator({self.name!r})"
