"""A tiny vision-language model, its processor and a coloured-shapes data set, built offline.

``build_tiny_vlm(directory)`` saves a randomly initialised ``LlavaForConditionalGeneration``
(a 1-layer CLIP vision tower on 32x32 images in 8x8 patches, so 16 image tokens per image, a
linear-GELU projector and the tiny model's 2-layer Llama text model) with a ``LlavaProcessor``:
the tiny BPE tokenizer plus an ``<image>`` token and a locally constructed
``CLIPImageProcessorPil`` (transformers without torchvision has only the PIL processors).
``tiny_qwen2_vl()`` builds a ``Qwen2VLForConditionalGeneration`` and its processor in memory
(patches flattened into ``pixel_values`` plus ``image_grid_thw`` and ``mm_token_type_ids``), to
show that the per-batch model inputs are not Llava-shaped. The chat template renders content lists of
``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts and keeps the tiny model's
``{% generation %}`` markers.

``shapes_dataset(n)`` draws coloured shapes (PIL): rows to train "what colour is the shape?".
"""

from __future__ import annotations

import hashlib
import pathlib
import random

from .tiny_model import BOS, EOS, PAD, _build_tokenizer, cached_build

BUILDER_VERSION = "1"
IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH = 32, 8
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
SHAPES = ("square", "circle", "triangle")


def vlm_chat_template(image: str = IMAGE_TOKEN) -> str:
    """ChatML-like, assistant turns in {% generation %}; a list content renders its parts in order."""
    content = (
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}{{- '" + image + "' -}}"
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
    )
    return (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['role'] == 'assistant' -%}{% generation %}" + content + "{{- '<|im_end|>' -}}{% endgeneration %}"
        "{{- '\\n' -}}"
        "{%- else -%}" + content + "{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


def _tokenizer(extra: list[str], image: str, seed: int):
    tokenizer = _build_tokenizer(seed, generation_markers=True)
    tokenizer.add_tokens(extra, special_tokens=True)
    tokenizer.chat_template = vlm_chat_template(image)
    return tokenizer


def _text_config(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def _save(directory, model, processor, tokenizer) -> pathlib.Path:
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def build_tiny_vlm(directory, *, seed: int = 0) -> pathlib.Path:
    """The tiny Llava (CLIP tower + Llama) and its processor, saved into ``directory``."""
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _tokenizer([IMAGE_TOKEN], IMAGE_TOKEN, seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_text_config(tokenizer)),
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         image_seq_length=(IMAGE_SIZE // PATCH) ** 2, vision_feature_select_strategy="default",
                         vision_feature_layer=-1, tie_word_embeddings=True)
    config.pad_token_id = tokenizer.pad_token_id
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tokenizer.chat_template, image_token=IMAGE_TOKEN)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    return _save(directory, model, processor, tokenizer)


def tiny_qwen2_vl(*, seed: int = 0):
    """A tiny ``Qwen2VLForConditionalGeneration`` and its processor, in memory: patches flattened
    into ``pixel_values`` with ``image_grid_thw`` (16 image tokens per 32x32 image: 8x8 patches, merged
    2x2) and ``mm_token_type_ids`` for its multimodal RoPE. Not saved: ``AutoProcessor`` cannot load a
    Qwen2-VL processor where torchvision is missing (its video processor needs it)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):  # no video processor (it needs torchvision)
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    start, pad, end = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
    tokenizer = _tokenizer([start, pad, end, "<|video_pad|>"], start + pad + end, seed)
    ids = tokenizer.convert_tokens_to_ids
    text = {**_text_config(tokenizer), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "mrope_section": [4, 6, 6]}}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": PATCH // 2, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3},
        image_token_id=ids(pad), video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids(start),
        vision_end_token_id=ids(end), tie_word_embeddings=True,
    )
    image_processor = Qwen2VLImageProcessorPil(patch_size=PATCH // 2, merge_size=2, temporal_patch_size=2,
                                               min_pixels=8 * 8, max_pixels=IMAGE_SIZE * IMAGE_SIZE)
    processor = ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                          chat_template=tokenizer.chat_template)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    return model, processor


def tiny_vlm_path(*, seed: int = 0) -> pathlib.Path:
    """The cached tiny Llava folder (model + processor), built on first use."""
    key = hashlib.sha256(f"{BUILDER_VERSION}|llava|seed={seed}".encode()).hexdigest()[:12]
    return cached_build(f"tiny-vlm-llava-{key}", lambda staging: build_tiny_vlm(staging, seed=seed))


# -- coloured shapes -------------------------------------------------------------------------------


def draw(shape: str, colour: str, size: int = IMAGE_SIZE, rng: random.Random | None = None):
    """A ``size``x``size`` white PIL image with one filled shape of ``colour`` (position jittered by ``rng``)."""
    from PIL import Image, ImageDraw

    rng = rng or random.Random(0)
    image = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    s = rng.randint(size // 2, size - 6)
    x, y = rng.randint(2, size - s - 2), rng.randint(2, size - s - 2)
    fill = COLOURS[colour]
    if shape == "square":
        pen.rectangle([x, y, x + s, y + s], fill=fill)
    elif shape == "circle":
        pen.ellipse([x, y, x + s, y + s], fill=fill)
    else:
        pen.polygon([(x, y + s), (x + s, y + s), (x + s // 2, y)], fill=fill)
    return image


QUESTION = "What colour is the shape?"


def shapes_dataset(n: int, *, seed: int = 0, kind: str = "prompt_completion", colours=tuple(COLOURS),
                   image_dir: str | None = None) -> list[dict]:
    """``n`` rows about one drawn shape each, in TRL's conversational image layout
    (``images`` column, ``{"type": "image"}`` part in the user turn), with ``shape``, ``colour`` and
    ``jitter`` (the seed of its position) columns.

    ``kind``: ``prompt_completion`` (the answer is the colour), ``preference`` (chosen the colour,
    rejected another colour) or ``prompt_only`` (``colour`` is what a reward checks). With
    ``image_dir`` the images are file paths ``image_dir/<kind>-<i>.png`` (see :func:`draw_images`).
    """
    rng = random.Random(seed)

    def answer(text: str) -> list[dict]:  # content parts throughout, so Arrow stores one content type
        return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

    rows = []
    for i in range(n):
        colour, shape, jitter = rng.choice(colours), rng.choice(SHAPES), rng.randrange(2**31)
        image = f"{image_dir}/{kind}-{i}.png" if image_dir else draw(shape, colour, rng=random.Random(jitter))
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        row = {"images": [image], "prompt": prompt, "shape": shape, "colour": colour, "jitter": jitter}
        if kind == "prompt_completion":
            row["completion"] = answer(colour)
        elif kind == "preference":
            other = rng.choice([c for c in colours if c != colour])
            row["chosen"], row["rejected"] = answer(colour), answer(other)
        rows.append(row)
    return rows


def draw_images(jsonl, root=".") -> int:
    """Draw the image files a :func:`shapes_dataset` jsonl (written with ``image_dir``) names, under
    ``root``; returns how many were drawn (existing files are kept)."""
    import json

    drawn = 0
    for line in pathlib.Path(jsonl).read_text().splitlines():
        row = json.loads(line)
        path = pathlib.Path(root) / row["images"][0]
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            draw(row["shape"], row["colour"], rng=random.Random(row["jitter"])).save(path)
            drawn += 1
    return drawn


def said_colour(completions, colour, **kwargs) -> list[float]:
    """Reward: 1 when the completion names the row's ``colour``, else 0 (GRPO on shapes_dataset prompts)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(want in (text if isinstance(text, str) else "")) for want, text in zip(colour, texts)]


__all__ = ["BOS", "EOS", "PAD", "COLOURS", "IMAGE_TOKEN", "QUESTION", "build_tiny_vlm", "draw",
           "said_colour", "shapes_dataset", "tiny_qwen2_vl", "tiny_vlm_path", "vlm_chat_template", "draw_images"]
