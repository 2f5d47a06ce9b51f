"""TRL 1.16's data utilities under TRL's names and signatures, on plait's own data code.

A TRL user's ``from trl import apply_chat_template, pack_dataset, ...`` becomes ``from plait import
...`` and keeps working. Each function is a thin layer over what plait's methods use themselves:
chat rendering (:mod:`plait.data.chat`), the registered data formats (``format.implicit_preference``
extracts an implicit prompt), the KTO unpairing of :mod:`plait.data.prepare` and the registered packing
strategies (``packing.bfd``, ``packing.wrapped``, ...). Where plait's rule differs from TRL's
(the implicit prompt of plain strings is cut at a word boundary) docs/trl-differences.md says so.

The collators TRL exposes from its trainer modules (``DataCollatorForLanguageModeling``, ...) are
here too, as thin classes over the registered collators with TRL's constructor arguments.

This module names the components it is made of (``format.sharegpt``, ``collator.preference``, ...)
rather than asking for a role's default: each TRL name here *is* that one component under TRL's
name, so there is no choice to leave to plugins. Only the name that needs a disabled plugin fails,
when called, with one line naming it and what disabled the plugin (:func:`_registered`).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

from plait.data import chat
from plait.data.prepare import _paired_to_unpaired, check_bins
from plait.data.pretrained import pretrained_kwargs
from plait.errors import PlaitError

# the keys TRL's chat-template functions read, and the example shapes they accept
CONVERSATION_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
SHAPES = [{"messages"}, {"prompt"}, {"prompt", "completion"}, {"prompt", "chosen", "rejected"},
          {"chosen", "rejected"}, {"prompt", "completion", "label"}]


def _plugins():
    from plait.manager import default_plugins

    return default_plugins()


def _registered(kind: str, name: str, user: str, family: str | None = None):
    """Component ``name`` of the ``kind`` registry, which TRL's ``user`` is made of; when its plugin is
    disabled or missing, one line naming both (a PlaitError, not the registry's KeyError)."""
    try:
        return getattr(_plugins(), kind).get(name, family=family)
    except KeyError as err:
        raise PlaitError(f"{user} is plait's {name!r}, which is not available: {err}") from None


def is_conversational(example: dict[str, Any]) -> bool:
    """True when the example's prompt / chosen / rejected / completion / messages hold role/content messages."""
    return any(example.get(key) and chat.is_conversational(example[key]) for key in CONVERSATION_KEYS)


def is_conversational_from_value(example: dict[str, Any]) -> bool:
    """True when the example's ``conversations`` holds ShareGPT ``{"from", "value"}`` turns."""
    turns = example.get("conversations")
    return isinstance(turns, list) and bool(turns) and isinstance(turns[0], dict) and {"from", "value"} <= set(turns[0])


def maybe_convert_to_chatml(example: dict[str, list]) -> dict[str, list]:
    """ShareGPT turns (``from``/``value``) in any conversation column become role/content messages
    through plait's ``format.sharegpt`` (``human`` -> ``user``, ``gpt`` -> ``assistant``, ...), and
    ``conversations`` is renamed ``messages``; other values are left as they are."""
    out = dict(example)
    for key in ("prompt", "completion", "chosen", "rejected", "messages", "conversations"):
        value = out.get(key)
        if isinstance(value, list) and value and all(isinstance(m, dict) and "from" in m for m in value):
            sharegpt = _registered("data_formats", "format.sharegpt", "maybe_convert_to_chatml").obj
            out[key] = sharegpt.convert({"conversations": value})["text"]
    if "conversations" in out:
        out["messages"] = out.pop("conversations")
    return out


def _render(processing_class, messages, tools, template_kwargs: dict, **flags) -> str:
    tokenizer = chat.tokenizer_of(processing_class)
    return tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False, **flags, **template_kwargs)


def apply_chat_template(example: dict[str, list[dict[str, str]]], processing_class: Any,
                        tools: list[dict | Callable] | None = None, **template_kwargs) -> dict[str, str]:
    """Render a conversational example to text, keeping its keys (``messages`` becomes ``text``).

    A prompt ending in a user/system/tool turn gets the generation prompt, one ending in an
    assistant turn is continued. The prompt text is cut at the longest common prefix with every
    prompt+completion rendering, so each completion's text is exactly what follows the prompt.
    An example's own ``chat_template_kwargs`` reach the template along with ``template_kwargs``.
    """
    keys = {key for key in example if key in (*CONVERSATION_KEYS, "label")}
    if keys not in SHAPES:
        raise PlaitError(f"apply_chat_template: example keys {sorted(keys)} are not a known shape; "
                         f"use one of {[sorted(s) for s in SHAPES]}")
    kwargs = {**example.get("chat_template_kwargs", {}), **template_kwargs}
    out: dict[str, Any] = {}
    if "messages" in example:
        out["text"] = _render(processing_class, example["messages"], tools, kwargs)
    completions = [key for key in ("chosen", "rejected", "completion") if key in example]
    if "prompt" in example:
        prompt = example["prompt"]
        continued = prompt[-1]["role"] == "assistant"
        text = _render(processing_class, prompt, tools, kwargs,
                       add_generation_prompt=not continued, continue_final_message=continued)
        full = {key: _render(processing_class, chat.join(list(prompt), list(example[key])), tools, kwargs)
                for key in completions}
        for rendered in full.values():
            text = text[: chat.common_prefix_length(text, rendered)]
        out["prompt"] = text
        out.update({key: rendered[len(text):] for key, rendered in full.items()})
    else:  # implicit prompt: each side rendered whole
        out.update({key: _render(processing_class, example[key], tools, kwargs) for key in completions})
    if "label" in example:
        out["label"] = example["label"]
    return out


def maybe_apply_chat_template(example: dict[str, list[dict[str, str]]], processing_class: Any,
                              tools: list[dict | Callable] | None = None, **template_kwargs: Any) -> dict[str, str]:
    """:func:`apply_chat_template` for a conversational example; any other example as it is."""
    if is_conversational(example):
        return apply_chat_template(example, processing_class, tools, **template_kwargs)
    return example


def prepare_multimodal_messages(messages: list[dict[str, Any]], images: list | None = None) -> list[dict[str, Any]]:
    """Messages in the structured form a vision-language processor's template reads, ``images`` placed in them
    (TRL's helper). A string content becomes one text part, and the first user message whose content is a string
    gets one image part per image before its text; then the image parts that hold no image yet, in order, each
    take the next of ``images``. New message dicts are returned; the given ones are left as they are."""
    images = list(images or [])
    structured, placed = [], False
    for position, message in enumerate(messages):
        role, content = message["role"], message.get("content")
        if role not in ("system", "user", "assistant", "tool"):
            raise PlaitError(f"prepare_multimodal_messages: message {position} has role {role!r}; use 'system', "
                             "'user', 'assistant' or 'tool'")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if role == "user" and not placed:
                parts, placed = [{"type": "image"} for _ in images] + parts, True
            message = {**message, "content": parts}
        structured.append(message)

    def empty(part) -> bool:
        return part["type"] == "image" and "image" not in part

    holders = [m for m in structured if m["role"] != "tool" and m.get("content")]
    slots = sum(empty(part) for m in holders for part in m["content"])
    if slots != len(images):
        raise PlaitError(f"prepare_multimodal_messages: {len(images)} images for {slots} image parts without an image; "
                         "give one image per {'type': 'image'} part")
    remaining = iter(images)
    return [{**m, "content": [{**part, "image": next(remaining)} if empty(part) else part for part in m["content"]]}
            if any(m is h for h in holders) and any(map(empty, m["content"])) else m for m in structured]


def extract_prompt(example: dict[str, Sequence]) -> dict[str, Sequence]:
    """``{chosen, rejected}`` with a shared beginning -> ``{prompt, chosen, rejected}`` (plait's
    ``format.implicit_preference``: whole leading messages, or text cut at a word boundary)."""
    fmt = _registered("data_formats", "format.implicit_preference", "extract_prompt").obj
    return fmt.convert({"chosen": example["chosen"], "rejected": example["rejected"]})


def maybe_extract_prompt(example: dict[str, list]) -> dict[str, list]:
    """:func:`extract_prompt` for a preference example whose prompt is implicit (absent, or of a
    different kind than its completions); any other example as it is."""
    if "chosen" not in example or "rejected" not in example:
        return example
    if "prompt" in example and chat.is_conversational(example["prompt"]) == chat.is_conversational(example["chosen"]):
        return example
    return extract_prompt(example)


def _unpair_batch(batch: dict[str, list]) -> dict[str, list]:
    rows = [_paired_to_unpaired(dict(zip(batch, values))) for values in zip(*batch.values())]
    ordered = [pair[0] for pair in rows] + [pair[1] for pair in rows]  # TRL's order: a batch's chosen rows first
    return {key: [row[key] for row in ordered] for key in (ordered[0] if ordered else {})}


def unpair_preference_dataset(dataset, **map_kwargs):
    """Preference pairs -> unpaired rows ``{prompt?, completion, label}`` (chosen: True, rejected:
    False), extra columns copied to both; ``map_kwargs`` go to ``dataset.map``."""
    from datasets import DatasetDict

    columns = next(iter(dataset.values())).column_names if isinstance(dataset, DatasetDict) else dataset.column_names
    if columns is None:  # an IterableDataset that does not know its columns yet
        columns = list(next(iter(dataset)).keys())
    return dataset.map(_unpair_batch, batched=True, remove_columns=columns, **map_kwargs)


def maybe_unpair_preference_dataset(dataset, num_proc: int | None = None, desc: str | None = None):
    """:func:`unpair_preference_dataset` when the dataset has ``chosen`` and ``rejected``; else it as it is."""
    from datasets import DatasetDict

    columns = next(iter(dataset.values())).column_names if isinstance(dataset, DatasetDict) else dataset.column_names
    if "chosen" in columns and "rejected" in columns:
        return unpair_preference_dataset(dataset, num_proc=num_proc, desc=desc)
    return dataset


def _sequence_columns(dataset) -> list[str]:
    return [name for name, feature in dataset.features.items() if type(feature).__name__ in ("Sequence", "List", "LargeList")]


def pack_dataset(dataset, seq_length: int, strategy: str = "bfd", map_kwargs: dict[str, Any] | None = None):
    """Pack every sequence column into rows of at most ``seq_length`` tokens with a registered
    packing strategy (``bfd``: whole documents, the overflow of a longer one cut off;
    ``bfd_split``: long documents split; ``wrapped``: concatenate and cut). Strategies whose rows
    hold whole documents add ``seq_lengths``, the document lengths of each row, as TRL does.
    ``map_kwargs`` is accepted for TRL's signature; packing runs in one pass."""
    import datasets

    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise PlaitError(f"seq_length={seq_length!r} must be a positive integer")
    component = _plugins().packing_strategies.get(strategy, family="packing")
    columns = _sequence_columns(dataset)
    others = [name for name in dataset.column_names if name not in columns]
    if others or not columns:
        raise PlaitError(f"pack_dataset: columns {others or dataset.column_names} are not token sequences; "
                         "pack a tokenised dataset, without other columns (dataset.remove_columns([...]))")
    data = {column: dataset[column] for column in columns}
    lengths = [len(row) for row in data[columns[0]]]
    bins = component.obj(lengths, seq_length)
    check_bins(bins, lengths, seq_length, component.name)
    packed = {column: [[t for i, start, end in b for t in data[column][i][start:end]] for b in bins] for column in columns}
    if component.options.padding_free:
        packed["seq_lengths"] = [[end - start for _, start, end in b] for b in bins]
    return datasets.Dataset.from_dict(packed)


def truncate_dataset(dataset, max_length: int, map_kwargs: dict[str, Any] | None = None):
    """Every sequence column cut to its first ``max_length`` items (TRL 1.16 keeps this in
    ``trl.experimental.utils``); ``map_kwargs`` go to ``dataset.map``."""
    columns = _sequence_columns(dataset)
    return dataset.map(lambda batch: {c: [row[:max_length] for row in batch[c]] for c in columns},
                       batched=True, **(map_kwargs or {}))


def clone_chat_template(model, tokenizer, source_tokenizer_path: str, resize_to_multiple_of: int | None = 64):
    """Give ``model`` and ``tokenizer`` the chat template of another tokenizer: its template
    , the special tokens the target lacks, its end-of-turn
    token as EOS (in the model's config and generation config too), and embeddings resized to
    the new vocabulary rounded up to ``resize_to_multiple_of``, the rows beyond it given
    ``<extra_id_N>`` tokens so tokenizer and model agree. Returns (model, tokenizer, added tokens).
    """
    from transformers import AddedToken, AutoTokenizer
    source = AutoTokenizer.from_pretrained(source_tokenizer_path, **pretrained_kwargs())
    if not source.chat_template:
        raise PlaitError(f"source_tokenizer_path={source_tokenizer_path!r}: that tokenizer has no chat template; "
                         "point at one that does")
    tokenizer.chat_template = source.chat_template
    added = [token for token in source.added_tokens_decoder.values() if token.content not in tokenizer.get_vocab()]
    tokenizer.add_tokens(added)
    tokenizer.eos_token = source.eos_token
    model.config.get_text_config().eos_token_id = tokenizer.eos_token_id
    if model.can_generate():
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.resize_token_embeddings(new_num_tokens=len(tokenizer), pad_to_multiple_of=resize_to_multiple_of)
    fillers = (AddedToken(f"<extra_id_{i}>") for i in itertools.count())
    while model.get_input_embeddings().weight.shape[0] > len(tokenizer):
        filler = next(fillers)
        if tokenizer.add_tokens([filler]):  # 0 when the tokenizer already has that text
            added.append(filler)
    return model, tokenizer, added


# ---------------------------------------------------------------------------------------------
# Collators: TRL's classes and constructor arguments over plait's registered collators
# ---------------------------------------------------------------------------------------------


class _Registered:
    """A registered collator built for a bare ``pad_token_id``; TRL's ``max_length`` truncation
    (``keep_start``: the first tokens of each sequence, ``keep_end``: the last) applied to its rows."""

    collator: str = ""

    def __init__(self, pad_token_id: int, *, max_length: int | None = None, truncation_mode: str = "keep_start",
                 pad_to_multiple_of: int | None = None, return_tensors: str = "pt", collator: str | None = None):
        from types import SimpleNamespace

        if return_tensors != "pt":
            raise PlaitError(f"{type(self).__name__}: return_tensors={return_tensors!r} is not supported; plait collates to 'pt'")
        if truncation_mode not in ("keep_start", "keep_end"):
            raise PlaitError(f"{type(self).__name__}: truncation_mode={truncation_mode!r}; use 'keep_start' or 'keep_end'")
        self.pad_token_id, self.max_length, self.truncation_mode = pad_token_id, max_length, truncation_mode
        self.pad_to_multiple_of, self.return_tensors = pad_to_multiple_of, return_tensors
        factory = _registered("collators", collator or self.collator, type(self).__name__, family="collator").obj
        self._collate = factory(SimpleNamespace(pad_token_id=pad_token_id), pad_to_multiple_of=pad_to_multiple_of)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self._collate(examples)
        if self.max_length is not None:
            for prefix in ("", "kl_"):
                if f"{prefix}attention_mask" in batch:
                    self._truncate(batch, prefix)
        return batch

    def _truncate(self, batch: dict, prefix: str) -> None:
        import torch

        lengths = batch[f"{prefix}attention_mask"].sum(dim=1).tolist()
        for name, value in (("input_ids", self.pad_token_id), ("attention_mask", 0), ("completion_mask", 0)):
            if f"{prefix}{name}" in batch:
                kept = [row[:n][-self.max_length:] if self.truncation_mode == "keep_end" else row[:min(n, self.max_length)]
                        for row, n in zip(batch[f"{prefix}{name}"], lengths)]
                rows = torch.nn.utils.rnn.pad_sequence(kept, batch_first=True, padding_value=value)
                extra = -rows.shape[1] % self.pad_to_multiple_of if self.pad_to_multiple_of else 0
                batch[f"{prefix}{name}"] = torch.nn.functional.pad(rows, (0, extra), value=value)


class DataCollatorForLanguageModeling(_Registered):
    """TRL's SFT collator: ``collator.language_modeling`` (right-padded, ``labels`` -100 on padding
    and untrained tokens), or with ``padding_free`` ``collator.padding_free`` (one row,
    ``position_ids`` restarting per document). ``return_position_ids`` adds position ids to a
    padded batch."""

    def __init__(self, pad_token_id: int, padding_free: bool = False, return_position_ids: bool = False,
                 pad_to_multiple_of: int | None = None, return_tensors: str = "pt"):
        self.padding_free, self.return_position_ids = padding_free, return_position_ids
        super().__init__(pad_token_id, pad_to_multiple_of=pad_to_multiple_of, return_tensors=return_tensors,
                         collator="collator.padding_free" if padding_free else "collator.language_modeling")

    @staticmethod
    def get_position_ids_from_packed_seq_lengths(batch_seq_lengths: list[list[int]]) -> list:
        """TRL's helper: for each packed row (the lengths of its documents), position ids restarting at 0 at
        each document's start, one 1-D tensor per row."""
        import torch

        return [torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
                for lengths in batch_seq_lengths]

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().__call__(examples)
        batch.pop("completion_mask")  # TRL's batch has the mask only as the -100s of labels
        if self.padding_free:
            batch.update(_sequence_boundaries(batch["position_ids"]))
        elif self.return_position_ids:
            batch["position_ids"] = (batch["attention_mask"].cumsum(dim=1) - 1).clamp(min=0) * batch["attention_mask"]
        return batch


def _sequence_boundaries(position_ids) -> dict[str, Any]:
    """TRL's keys for varlen attention kernels, read from a padding-free row's restarting positions:
    each sequence's start offset (``cu_seq_lens_*``, with the row's end), the longest sequence and
    each token's sequence index."""
    import torch

    starts = (position_ids[0] == 0).nonzero().flatten()
    offsets = torch.cat([starts, torch.tensor([position_ids.shape[1]])]).to(torch.int32)
    lengths = offsets.diff()
    longest = int(lengths.max())
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest,
            "seq_idx": torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)[None]}


class DataCollatorForPreference(_Registered):
    """TRL's DPO collator (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) and, for rows with only
    ``chosen_ids`` and ``rejected_ids``, TRL's reward-model collator: ``collator.preference``,
    ``2B`` rows chosen then rejected, with ``completion_mask``."""

    collator = "collator.preference"

    def __init__(self, pad_token_id: int, max_length: int | None = None, truncation_mode: str = "keep_start",
                 pad_to_multiple_of: int | None = None, return_tensors: str = "pt"):
        super().__init__(pad_token_id, max_length=max_length, truncation_mode=truncation_mode,
                         pad_to_multiple_of=pad_to_multiple_of, return_tensors=return_tensors)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return super().__call__([{"prompt_ids": [], **example} for example in examples])


class DataCollatorForUnpairedPreference(_Registered):
    """TRL's KTO collator: ``collator.unpaired`` (``prompt_ids``, ``completion_ids``, ``label``) under TRL's
    key names. Rows with ``KL_completion_ids`` (the mismatched completions KTO's reference point is
    estimated from) also give ``KL_input_ids``, ``KL_attention_mask`` and ``KL_completion_mask``, and
    ``ref_KL_logps`` passes through; rows without them give no ``KL_*`` keys, as TRL's (plait's own
    collator would pair each row with its batch neighbour's completion)."""

    collator = "collator.unpaired"

    def __init__(self, pad_token_id: int, max_length: int | None = None, pad_to_multiple_of: int | None = None,
                 return_tensors: str = "pt"):
        super().__init__(pad_token_id, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
                         return_tensors=return_tensors)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        mismatched = all("KL_completion_ids" in example for example in examples)
        batch = super().__call__([{_plait_key(key): value for key, value in example.items()} for example in examples])
        return {_trl_key(key): value for key, value in batch.items() if mismatched or not key.startswith("kl_")}


def _plait_key(key: str) -> str:
    """A KTO row's key as plait's collator names it (TRL's ``KL_`` and ``ref_KL_`` are plait's ``kl_``, ``ref_kl_``)."""
    return key.replace("KL_", "kl_", 1) if key.startswith(("KL_", "ref_KL_")) else key


def _trl_key(key: str) -> str:
    return key.replace("kl_", "KL_", 1) if key.startswith(("kl_", "ref_kl_")) else key


class _VisionRows:
    """Raw image rows tokenised when batched, as TRL's vision collators take them: each example's ``images`` (or
    one ``image``), its image placeholders expanded by the processor (:mod:`plait.data.chat`), each sequence cut to
    its first ``max_length`` tokens (never into an image's); the registered ``collator`` inside ``collator.images``
    makes the batch, whose image inputs come back under the image processor's own keys (``pixel_values``, ...)."""

    collator: str = ""

    def __init__(self, processor, max_length: int | None = None, pad_to_multiple_of: int | None = None,
                 return_tensors: str = "pt"):
        from plait.data.vision import image_processor_of, image_token_ids

        name = type(self).__name__
        if return_tensors != "pt":
            raise PlaitError(f"{name}: return_tensors={return_tensors!r} is not supported; plait collates to 'pt'")
        if image_processor_of(processor) is None:
            raise PlaitError(f"{name}: processor is a {type(processor).__name__}, which processes no images; give the "
                             "model's AutoProcessor")
        self.processor, self.max_length = processor, max_length
        self.pad_to_multiple_of, self.return_tensors = pad_to_multiple_of, return_tensors
        rows = _registered("collators", self.collator, name, family="collator").obj
        images = _registered("collators", "collator.images", name, family="collator").obj
        self._collate = images(processor, inner=rows(processor, pad_to_multiple_of=pad_to_multiple_of))
        self._image_tokens = image_token_ids(processor)

    @staticmethod
    def _images(example: dict[str, Any]) -> list:
        return example["images"] if "images" in example else [example["image"]] if "image" in example else []

    def _cut(self, ids: list[int]) -> list[int]:
        """``ids`` cut to ``max_length``; refused where that would cut an image's tokens."""
        if self.max_length is not None and set(ids[self.max_length:]) & self._image_tokens:
            raise PlaitError(f"{type(self).__name__}: max_length={self.max_length} cuts into an example's image tokens "
                             f"({len(ids)} tokens); raise max_length or use smaller images")
        return ids[:self.max_length]

    def _batch(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from plait.data.vision import KEY

        batch = self._collate(rows)
        inputs = batch.pop(KEY, None)
        if inputs is not None:
            batch.update(inputs.kwargs(input_ids=batch["input_ids"]))
        return batch


class DataCollatorForVisionLanguageModeling(_VisionRows):
    """TRL's vision-language SFT collator (``trl.trainer.sft_trainer``): each example holds ``messages`` (string
    contents get their image parts as :func:`prepare_multimodal_messages` places them), text under
    ``dataset_text_field`` with the processor's image token in it, or ``prompt`` and ``completion``, and its images
    (:class:`_VisionRows`; ``collator.language_modeling``). TRL's keys come back: ``input_ids``, ``attention_mask``,
    ``labels`` and the image processor's tensors. ``labels`` are -100 on padding and image tokens, on the prompt
    with ``completion_only_loss``, outside assistant turns with ``assistant_only_loss``."""

    collator = "collator.language_modeling"

    def __init__(self, processor, max_length: int | None = None, completion_only_loss: bool = False,
                 pad_to_multiple_of: int | None = None, dataset_text_field: str = "text",
                 assistant_only_loss: bool = False, chat_template: str | None = None, return_tensors: str = "pt"):
        super().__init__(processor, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
                         return_tensors=return_tensors)
        self.completion_only_loss, self.dataset_text_field = completion_only_loss, dataset_text_field
        self.assistant_only_loss, self.chat_template = assistant_only_loss, chat_template

    def _tokens(self, example: dict[str, Any]) -> dict[str, Any]:
        """One example's ``input_ids`` and ``completion_mask`` (1 where ``labels`` keep the token), and its images."""
        images = self._images(example)
        rendering = {"template_kwargs": {"chat_template": self.chat_template} if self.chat_template else None}
        if self.assistant_only_loss and "messages" not in example:
            raise PlaitError(f"{type(self).__name__}: assistant_only_loss=True needs conversational 'messages' rows")
        if "messages" in example or self.dataset_text_field in example:
            if self.completion_only_loss:
                raise PlaitError(f"{type(self).__name__}: completion_only_loss=True needs prompt-completion rows, "
                                 "not language-modelling ones")
            if "messages" not in example:
                ids = chat.encode(self.processor, example[self.dataset_text_field], special_tokens=False, images=images)
                mask = [1] * len(ids)
            else:
                ids, mask = chat.encode_conversation(self.processor, _image_parts(example["messages"], len(images)),
                                                     assistant_only=self.assistant_only_loss, images=images, **rendering)
        elif "prompt" in example and "completion" in example:
            prompt, completion = example["prompt"], example["completion"]
            if chat.is_conversational(prompt):
                prompt = _image_parts(prompt, len(images))
            prompt_ids, completion_ids = chat.encode_prompt_completion(self.processor, prompt, completion,
                                                                       images=images, **rendering)
            ids = prompt_ids + completion_ids
            mask = [int(not self.completion_only_loss)] * len(prompt_ids) + [1] * len(completion_ids)
        else:
            raise PlaitError(f"{type(self).__name__}: an example has columns {sorted(example)}; give 'messages', "
                             f"{self.dataset_text_field!r}, or 'prompt' and 'completion', with 'images'")
        ids = self._cut(ids)
        return {"input_ids": ids, "completion_mask": mask[:len(ids)], "images": images}

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self._batch([self._tokens(example) for example in examples])
        batch.pop("completion_mask")  # TRL's batch has it only as the -100s of labels
        return batch


def _image_parts(messages: list[dict[str, Any]], images: int) -> list[dict[str, Any]]:
    """Messages whose string contents are text parts, the first user turn given ``images`` image parts (where
    :func:`prepare_multimodal_messages` puts them), the images themselves left in the row's ``images``."""
    if not images:
        return messages
    return [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in prepare_multimodal_messages(messages, [None] * images)]


class _VisionCompletions(_VisionRows):
    """Rows with a prompt and completions (TRL's vision collators for DPO and KTO): each completion tokenised after
    the prompt (:func:`plait.data.chat.encode_prompt_completion`), the prompt's image parts placed as
    :func:`prepare_multimodal_messages` places them, each prompt + completion cut to ``max_length``."""

    def _row(self, example: dict[str, Any], completions: Sequence[str]) -> dict[str, Any]:
        """``prompt_ids`` and ``<completion>_ids`` for each of ``completions``, and the example's images."""
        images, prompt = self._images(example), example["prompt"]
        if chat.is_conversational(prompt):
            prompt = _image_parts(prompt, len(images))
        row: dict[str, Any] = {"images": images}
        for key in completions:
            prompt_ids, ids = chat.encode_prompt_completion(self.processor, prompt, example[key], images=images)
            kept = self._cut(prompt_ids + ids)
            row["prompt_ids"], row[f"{key}_ids"] = kept[:len(prompt_ids)], kept[len(prompt_ids):]
        return row


class DataCollatorForVisionPreference(_VisionCompletions):
    """TRL's vision DPO collator (``trl.trainer.dpo_trainer``): rows with ``prompt``, ``chosen``, ``rejected`` and
    ``images`` (or one ``image``). Returns ``2B`` rows, chosen ones then rejected ones (``collator.preference``):
    ``input_ids``, ``attention_mask``, ``completion_mask`` and each row's image inputs (``pixel_values``, ...)."""

    collator = "collator.preference"

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return self._batch([self._row(example, ("chosen", "rejected")) for example in examples])


class DataCollatorForVisionUnpairedPreference(_VisionCompletions):
    """TRL's vision KTO collator (``trl.trainer.kto_trainer``): rows with ``prompt``, ``completion``, ``label`` and
    ``images`` (or one ``image``). Returns ``input_ids``, ``attention_mask``, ``completion_mask``, ``label`` and the
    image inputs; with ``calculate_kl`` also ``KL_input_ids``, ``KL_attention_mask``, ``KL_completion_mask``: each
    prompt with the previous row's completion (the batch rotated by one, ``collator.unpaired``), as TRL's."""

    collator = "collator.unpaired"

    def __init__(self, processor, max_length: int | None = None, calculate_kl: bool = True,
                 pad_to_multiple_of: int | None = None, return_tensors: str = "pt"):
        super().__init__(processor, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of,
                         return_tensors=return_tensors)
        self.calculate_kl = calculate_kl

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self._batch([{**self._row(example, ("completion",)), "label": example["label"]} for example in examples])
        return {_trl_key(key): value for key, value in batch.items() if self.calculate_kl or not key.startswith("kl_")}
