"""Images for vision-language models: loading them, expanding their tokens, per-row model inputs.

A VLM's processor (``AutoProcessor``) turns each image placeholder of the rendered text (e.g.
``<image>``) into as many image tokens as the vision tower yields for that image, and turns the
images into the extra model inputs (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...).
plait tokenises once, when the dataset is prepared: :func:`encode` returns the expanded ids, and
:func:`carry_mask` maps a per-token mask of the unexpanded ids onto them (inserted tokens get 0,
so image tokens are never trained on). Collators call the image processor per batch and carry the
result as :class:`RowInputs` under :data:`KEY`; every forward passes :func:`model_inputs` of its
batch (or of some of its rows) to the model.
"""

from __future__ import annotations

import io
import weakref
from typing import Any, Sequence

import attrs
import torch

from plait.errors import PlaitError

from .pretrained import pretrained_kwargs
from .versions import returns_mm_token_type_ids

KEY = "model_inputs"  # the batch key of a RowInputs


def image_processor_of(processing_class: Any) -> Any:
    """The image processor of a multimodal processor, or None for a text tokenizer."""
    return getattr(processing_class, "image_processor", None)


def is_vision_language(config: Any) -> bool:
    """Whether a model config is an image-text-to-text model that no causal-LM class loads."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", None)
    return kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def vision_language_source(source: Any) -> bool:
    """Whether ``source`` (a folder or id) holds a vision-language model (False when it has no readable config)."""
    from transformers import AutoConfig
    try:
        return is_vision_language(AutoConfig.from_pretrained(source, **pretrained_kwargs()))
    except (OSError, ValueError, KeyError):
        return False


def load_image(value: Any, column: str = "images"):
    """A PIL RGB image from a PIL image, a file path, or datasets' undecoded Image value ({bytes, path})."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB") if value.mode != "RGB" else value
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        value = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
    if isinstance(value, (str, io.BytesIO)) or hasattr(value, "__fspath__"):
        try:
            return Image.open(value).convert("RGB")
        except (OSError, ValueError) as err:
            raise PlaitError(f"column {column!r}: image {str(value)[:80]!r} cannot be opened ({err}); give PIL images, "
                             "image file paths or a datasets Image feature") from None
    raise PlaitError(f"column {column!r} holds a {type(value).__name__}; an image must be a PIL image, a file path "
                     "or a datasets Image value")


def load_images(value: Any, column: str = "images") -> list:
    """A row's images as a list of PIL images (one image or a list of them)."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [load_image(item, column) for item in items]


def image_token_ids(processing_class: Any) -> set[int]:
    """Ids of the processor's image tokens (the ones it repeats per image)."""
    ids = set()
    for name in ("image_token_id", "image_token_index"):
        value = getattr(processing_class, name, None)
        if isinstance(value, int):
            ids.add(value)
    token = getattr(processing_class, "image_token", None)
    tokenizer = getattr(processing_class, "tokenizer", None)
    if isinstance(token, str) and tokenizer is not None:
        value = tokenizer.convert_tokens_to_ids(token)
        if isinstance(value, int) and value != tokenizer.unk_token_id:
            ids.add(value)
    return ids


def encode(processing_class: Any, text: str, images: Sequence, *, special_tokens: bool) -> list[int]:
    """Token ids of ``text`` with every image placeholder expanded by the processor for ``images``."""
    placeholder = getattr(processing_class, "image_token", None)

    def unpaired(reason: str) -> PlaitError:
        return PlaitError(f"the processor cannot pair the text with its {len(images)} image(s) ({reason}); each image "
                          f"needs one {{'type': 'image'}} part (or {placeholder or 'the image token'!r} in a string)")

    # said here, not left to the processor: transformers 5.19's Qwen2-VL processor expands no image and raises nothing
    if isinstance(placeholder, str) and text.count(placeholder) != len(images):
        raise unpaired(f"{text.count(placeholder)} {placeholder!r} in the text")
    try:
        out = processing_class(text=[text], images=[list(images)], add_special_tokens=special_tokens)
    except (ValueError, TypeError) as err:
        raise unpaired(str(err).splitlines()[0]) from None
    return [int(t) for t in out["input_ids"][0]]


_counts: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def image_tokens(processing_class: Any, images: Sequence) -> int:
    """How many image tokens ``images`` expand to (so truncation can tell when it would cut one);
    remembered per processor and image sizes, which is all the count depends on."""
    placeholder = getattr(processing_class, "image_token", None)
    if not images or not isinstance(placeholder, str):
        return 0
    known = _counts.setdefault(processing_class, {})
    key = tuple(getattr(im, "size", None) for im in images)
    if key not in known:
        ids = encode(processing_class, placeholder * len(images), images, special_tokens=False)
        wanted = image_token_ids(processing_class)
        known[key] = sum(t in wanted for t in ids)
    return known[key]


def limit_pixels(processing_class: Any, max_pixels: int | None) -> None:
    """Give the image processor a pixel budget per image (``max_pixels``), where it has that option."""
    if max_pixels is None:
        return
    image_processor = image_processor_of(processing_class)
    options = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {})
    if image_processor is None or "max_pixels" not in options:
        what = "no image processor" if image_processor is None else f"a {type(image_processor).__name__}"
        raise PlaitError(f"max_pixels={max_pixels}: the processing class has {what}, which takes no max_pixels "
                         "(it sizes images itself); remove max_pixels")
    size = image_processor.size
    shortest = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
    image_processor.size = {"shortest_edge": min(shortest or max_pixels, max_pixels), "longest_edge": max_pixels}
    if hasattr(image_processor, "max_pixels"):  # older transformers read the attributes
        image_processor.max_pixels = max_pixels


def require_processor(processing_class: Any, data_format: str) -> None:
    """Refuse image-bearing data when the processing class has no image processor."""
    if image_processor_of(processing_class) is None:
        raise PlaitError(f"the dataset holds images ({data_format}) but the processing class is a "
                         f"{type(processing_class).__name__} without an image processor; train a vision-language "
                         "model and pass its AutoProcessor (plait loads it for a VLM folder), or drop the 'images' column")


def mask_and_count(processing_class: Any, tokens: dict, images: Sequence | None) -> int:
    """Untrain the image tokens of a tokenised row (``completion_mask`` 0 there) and return how many
    image tokens its images need when truncation cut any of them (0 when all are kept)."""
    if not images:
        return 0
    wanted = image_token_ids(processing_class)
    ids = tokens.get("input_ids")
    if ids is not None and tokens.get("completion_mask") is not None:
        tokens["completion_mask"] = [0 if t in wanted else m for t, m in zip(ids, tokens["completion_mask"])]
    kept = sum(t in wanted for key in ("input_ids", "prompt_ids", "completion_ids") for t in tokens.get(key) or ())
    needed = image_tokens(processing_class, images)
    return needed if kept < needed else 0


def carry_mask(short: Sequence[int], expanded: Sequence[int], mask: Sequence[int]) -> list[int]:
    """``mask`` of the unexpanded ids ``short`` laid over ``expanded`` (``short`` with image tokens
    inserted): matched tokens keep their value, inserted ones get 0."""
    out, j = [], 0
    for token in expanded:
        if j < len(short) and short[j] == token:
            out.append(int(mask[j]))
            j += 1
        else:
            out.append(0)
    if j != len(short):
        raise PlaitError("the processor changed the text's tokens while expanding image placeholders, so the "
                         "assistant/completion mask cannot be carried over; report the processor")
    return out


@attrs.frozen(eq=False)
class RowInputs:
    """Extra model inputs of each row of a batch (the image processor's output for the row's images).

    Every tensor of a row has images (or image patches) on dim 0, so rows concatenate into one
    forward's keyword arguments; ``select`` keeps, repeats or reorders rows like the batch's tensors.
    ``marked`` holds the image token ids of a model that also reads which tokens are image tokens
    (``mm_token_type_ids``, e.g. Qwen2-VL's multimodal RoPE): that tensor is derived from the
    ``input_ids`` of each forward, so it follows any padding, trimming or appended completion.
    """

    rows: tuple[dict, ...]
    marked: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, index) -> "RowInputs":
        if isinstance(index, slice):
            return attrs.evolve(self, rows=self.rows[index])
        index = index.tolist() if torch.is_tensor(index) else list(index)
        return attrs.evolve(self, rows=tuple(self.rows[i] for i in index))

    def tile(self, times: int) -> "RowInputs":
        return attrs.evolve(self, rows=self.rows * times)

    def kwargs(self, device=None, input_ids: torch.Tensor | None = None) -> dict:
        keys = dict.fromkeys(k for row in self.rows for k in row)
        out = {}
        for key in keys:
            parts = [row[key] for row in self.rows if key in row]
            out[key] = torch.cat(parts).to(device) if device is not None else torch.cat(parts)
        if self.marked and input_ids is not None:
            out["mm_token_type_ids"] = torch.isin(input_ids, torch.tensor(self.marked, device=input_ids.device)).long()
        return out


def model_inputs(batch: dict, rows=None, prefix: str = "") -> dict:
    """The extra model inputs of ``batch`` (all rows, or ``rows``), on the device of its ``input_ids``
    (``prefix``: of the sequences under ``<prefix>input_ids``, e.g. KTO's ``kl_`` rows, which share
    each row's prompt and so its images)."""
    inputs = batch.get(KEY)
    if inputs is None:
        return {}
    ids = batch.get(f"{prefix}input_ids")
    if rows is not None:
        inputs, ids = inputs.select(rows), ids[rows]
    return inputs.kwargs(ids.device, ids) if torch.is_tensor(ids) else inputs.kwargs()


def holds_images(dataset: Any) -> bool:
    """Whether a dataset (or list of rows) has an ``images`` column with any image in its first row."""
    if dataset is None:
        return False
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        first = dataset[0] if isinstance(dataset, list) and dataset else {}
        columns = list(first) if isinstance(first, dict) else []
    return isinstance(columns, list) and "images" in columns and bool(dataset[0]["images"])


def image_inputs(processing_class: Any, images: Sequence) -> dict:
    """The image processor's tensors for one row's ``images`` ({} for a row without images)."""
    if not images:
        return {}
    out = image_processor_of(processing_class)(images=list(images), return_tensors="pt")
    return {k: v for k, v in out.items() if torch.is_tensor(v)}


def marked_tokens(processing_class: Any) -> tuple[int, ...]:
    """The image token ids to mark as ``mm_token_type_ids`` when the processor returns that tensor, else ()."""
    return tuple(sorted(image_token_ids(processing_class))) if returns_mm_token_type_ids(processing_class) else ()


def describe(images: Sequence) -> str:
    """``image 32x32`` (or ``2 images 32x32, 64x48``) for a completions table."""
    sizes = ", ".join(f"{getattr(im, 'width', '?')}x{getattr(im, 'height', '?')}" for im in images)
    return f"image {sizes}" if len(images) == 1 else f"{len(images)} images {sizes}"
