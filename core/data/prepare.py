"""The data engine: recognise a dataset's format, tokenise it once for a task, pack it.

Formats are plugins (``register_data_formats`` + ``detect_data_format``); this module names
none of them. Every format converts its rows to one of five canonical *kinds*, whose fields
hold either standard strings or conversations (lists of messages)::

    language_modeling    {text}
    prompt_only          {prompt}
    prompt_completion    {prompt, completion}
    preference           {prompt, chosen, rejected}
    unpaired_preference  {prompt, completion, label}

A *task* is what a method consumes, and says which kinds it accepts:

=====================  ======================================================  ==============
task                   output columns (plain int lists; extra columns kept)    accepts
=====================  ======================================================  ==============
``language_modeling``  input_ids, completion_mask (1 = token is trained on)    LM, prompt-completion
``preference``         prompt_ids, chosen_ids, rejected_ids                    preference
``unpaired``           prompt_ids, completion_ids, label (bool)                unpaired, preference (split)
``prompt_only``        prompt_ids, prompt (raw)                                any kind with a prompt
=====================  ======================================================  ==============

Completions of standard (string) data get the EOS token appended; conversations end as the
chat template ends a turn. See :mod:`plait.data.chat` for how templates are applied.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs

from plait.errors import PlaitError

from . import chat, vision

logger = logging.getLogger("plait")

KINDS: dict[str, tuple[str, ...]] = {
    "language_modeling": ("text",),
    "prompt_only": ("prompt",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "unpaired_preference": ("prompt", "completion", "label"),
}
# Canonical fields holding text (a string or a conversation); the rest (label) are scalars.
TEXT_FIELDS = ("text", "prompt", "completion", "chosen", "rejected")
# Fields that are what an example is about: they must not be empty.
_NON_EMPTY = ("text", "completion", "chosen", "rejected")

TRUNCATION_MODES = ("keep_start", "keep_end")
OVERLONG_POLICIES = ("drop", "error")


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------


def _shape_text(shape: Sequence[str]) -> str:
    return "{" + ", ".join(shape) + "}"


@attrs.frozen
class DataFormat:
    """One dataset shape: the column sets it is recognised by and how a row becomes canonical.

    ``shapes`` lists alternative column sets (``(("text",), ("messages",))``); a row matches
    when it has every column of one of them. ``convert(row) -> dict`` returns the canonical
    fields of ``kind`` (default: copy them by name); columns outside the matched shape are kept.
    """

    name: str
    kind: str = attrs.field(validator=attrs.validators.in_(tuple(KINDS)))
    shapes: tuple[tuple[str, ...], ...] = attrs.field(converter=lambda s: tuple(tuple(x) for x in s))
    convert: Callable[[dict], dict] | None = None
    doc: str = ""
    # rows carry images (an ``images`` field of PIL images) for a vision-language model's processor;
    # message contents may then be lists of {"type": "image"} / {"type": "text"} parts
    multimodal: bool = False

    def matching_shapes(self, columns: Iterable[str]) -> list[tuple[str, ...]]:
        present = set(columns)
        return [shape for shape in self.shapes if set(shape) <= present]

    def detect(self, columns: Iterable[str]) -> str | None:
        """This format's name when ``columns`` contain one of its shapes (for detect_data_format)."""
        return self.name if self.matching_shapes(columns) else None

    def describe(self) -> str:
        return " or ".join(_shape_text(shape) for shape in self.shapes)

    def to_canonical(self, example: Mapping[str, Any]) -> dict:
        """The canonical fields of ``kind`` plus every column outside the matched shape, validated."""
        consumed = {column for shape in self.matching_shapes(example) for column in shape}
        fields = self.convert(dict(example)) if self.convert else {f: example.get(f) for f in KINDS[self.kind]}
        missing = [f for f in KINDS[self.kind] if f not in fields]
        if missing:
            raise PlaitError(f"{self.name} produced no {missing[0]!r} field; its convert() must return {list(KINDS[self.kind])}")
        canonical = {k: v for k, v in example.items() if k not in consumed}
        canonical.update(fields)
        return validate_canonical(canonical, self.kind, parts=self.multimodal)


def token_ids(value: Any) -> bool:
    """Is ``value`` a list of token ids (a text field of pre-tokenised data, e.g. ``format.tokenised_preference``)?"""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def is_tokenised(example: Mapping[str, Any], kind: str) -> bool:
    """Does the canonical row hold token ids instead of text (one non-empty id list is enough: a prompt may be [])?"""
    return any(token_ids(example.get(f)) and example.get(f) for f in KINDS[kind] if f in TEXT_FIELDS)


def validate_canonical(example: dict, kind: str, *, parts: bool = False) -> dict:
    """Check one canonical row (types, None, emptiness, one variant); return it with clean messages."""
    variants = set()
    tokenised = is_tokenised(example, kind)
    for field in KINDS[kind]:
        value = example.get(field)
        if value is None:
            raise PlaitError(f"column {field!r} is None; drop or fill such rows first (dataset.filter)")
        if field == "label":
            if not isinstance(value, bool):
                raise PlaitError(
                    f"column 'label' is {value!r} ({type(value).__name__}); labels must be booleans "
                    "(True = desirable, False = undesirable): cast with dataset.cast_column('label', Value('bool'))"
                )
            continue
        if isinstance(value, str):
            variants.add("standard")
        elif tokenised and token_ids(value):
            variants.add("token ids")
        elif chat.is_conversational(value):
            variants.add("conversational")
            example[field] = chat.check_messages(value, field, parts=parts)
        else:
            raise PlaitError(
                f"column {field!r} holds {type(value).__name__}; it must be a string or a list of "
                "{'role', 'content'} messages"
            )
        if field in _NON_EMPTY and len(value) == 0:
            raise PlaitError(f"column {field!r} is empty; every {field} needs at least one token (drop such rows)")
    if len(variants) > 1:
        raise PlaitError(
            f"fields {list(KINDS[kind])} mix strings and conversations within one row; use lists of messages "
            "for all of them or strings for all of them"
        )
    return example


def is_conversational_example(example: Mapping[str, Any], kind: str) -> bool:
    texts = [example.get(f) for f in KINDS[kind] if f in TEXT_FIELDS]
    return not is_tokenised(example, kind) and any(chat.is_conversational(value) for value in texts)


def is_stream(dataset: Any) -> bool:
    """Is ``dataset`` a stream (``datasets.IterableDataset``: no length, read row by row)?"""
    import datasets

    return isinstance(dataset, datasets.IterableDataset)


def columns_of(dataset: Any) -> list[str]:
    """A dataset's column names; a stream that does not know them yet (``features`` unset) shows its first row's."""
    if isinstance(dataset, list):
        return list(dataset[0]) if dataset else []
    if dataset.column_names is not None:
        return list(dataset.column_names)
    return list(next(iter(dataset.take(1)), {}))


def _rows(data: Any, limit: int | None) -> tuple[list[str], list[dict]]:
    if isinstance(data, Mapping):
        return list(data), [dict(data)]
    if isinstance(data, list):
        if not data:
            raise PlaitError("the dataset is empty; give it at least one row")
        columns = list(data[0])
        for index, row in enumerate(data):
            if set(row) != set(columns):
                raise PlaitError(
                    f"row {index} has columns {sorted(row)} but row 0 has {sorted(columns)}; rows must share one shape"
                )
        return columns, data if limit is None else data[:limit]
    if is_stream(data):  # only the head of a stream is read: format detection looks at its first rows
        head = list(data.take(limit or 100))
        if not head:
            raise PlaitError("the dataset stream is empty; give it at least one row")
        return columns_of(data), head
    if len(data) == 0:
        raise PlaitError("the dataset is empty; give it at least one row")
    columns = list(data.column_names)
    head = data[: limit or len(data)]
    return columns, [dict(zip(head, values)) for values in zip(*head.values())]


def detect_format(data: Any, plugins: Any = None, *, sample: int | None = 100, kinds: Iterable[str] | None = None):
    """The registered format (a :class:`plait.registry.Component`) of a dataset, row list or row.

    Asks the ``detect_data_format`` hook about the first row, then checks that no other format
    also claims these columns (an ambiguous shape) and that the first ``sample`` rows (every row
    of a list) agree on standard vs conversational. ``kinds`` (a task's) narrows the shapes an
    unrecognised dataset is told about to the formats of those kinds.
    """
    plugins = plugins or _default_plugins()
    columns, rows = _rows(data, None if isinstance(data, list) else sample)
    name = plugins.hook.detect_data_format(example=rows[0], columns=columns)
    formats = plugins.data_formats
    if name is None:
        told = [c for c in formats if kinds is None or c.obj.kind in kinds]
        accepted = "; ".join(f"{c.obj.describe()} ({c.name})" for c in told) or "none: no format plugin is installed"
        raise PlaitError(
            f"cannot recognise the dataset from its columns {sorted(columns)}; accepted shapes: {accepted}; "
            "rename columns to one of these (dataset.rename_column)"
        )
    component = formats.get(name)
    _check_unambiguous(component, columns, formats)
    _check_rows_agree(component.obj, rows)
    return component


def _check_unambiguous(component, columns: list[str], formats) -> None:
    matched = component.obj.matching_shapes(columns)
    if len(matched) > 1:
        raise PlaitError(
            f"columns {sorted(columns)} match {component.name} twice ({' and '.join(map(_shape_text, matched))}); "
            "keep only one of them"
        )
    for other in formats:
        for shape in other.obj.matching_shapes(columns) if other.name != component.name else ():
            if not set(shape) <= set(matched[0]):
                raise PlaitError(
                    f"columns {sorted(columns)} are ambiguous: they hold {_shape_text(matched[0])} ({component.name}) "
                    f"and {_shape_text(shape)} ({other.name}); remove or rename the columns you do not mean"
                )


def _check_rows_agree(fmt: DataFormat, rows: list[dict]) -> None:
    first = None
    for index, row in enumerate(rows):
        canonical = _canonical(fmt, row, index)
        variant = is_conversational_example(canonical, fmt.kind)
        if first is None:
            first = variant
        elif variant != first:
            kinds = ("standard strings", "conversations")
            raise PlaitError(
                f"row {index} holds {kinds[variant]} but row 0 holds {kinds[first]}; a dataset must be "
                "all conversational or all standard"
            )


def _canonical(fmt: DataFormat, row: Mapping[str, Any], index: int) -> dict:
    try:
        return fmt.to_canonical(row)
    except PlaitError as err:
        raise PlaitError(f"dataset row {index} ({fmt.name}): {err}") from None


def _default_plugins():
    from plait.manager import default_plugins

    return default_plugins()


# ---------------------------------------------------------------------------------------------
# Tokenisation
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Encoder:
    """Tokenises canonical rows for one run: the tokenizer plus the length and loss-mask policy."""

    processing_class: Any
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    chat_template_kwargs: dict | None = None  # template variables for rendering conversations (chat_inputs)

    @property
    def eos(self) -> list[int]:
        eos = chat.tokenizer_of(self.processing_class).eos_token_id
        return [] if eos is None else [eos]

    def with_eos(self, ids: list[int]) -> list[int]:
        return ids if ids[-1:] == self.eos else ids + self.eos

    def chat_inputs(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """What rendering a row's conversation is given, as TRL's trainers give it: the row's ``tools`` (a JSON
        string, the form tabular files store them in, read as JSON) and the template variables (the run's
        ``chat_template_kwargs``, updated by the row's own ``chat_template_kwargs`` column)."""
        tools = row.get("tools")
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as err:
                raise PlaitError(f"column 'tools' holds {tools!r:.60}, which is not JSON ({err.msg}); give a list of "
                                 "JSON schemas, or their JSON text") from None
        own = {k: v for k, v in (row.get("chat_template_kwargs") or {}).items() if v is not None}  # None: Arrow's fill
        template_kwargs = {**(self.chat_template_kwargs or {}), **own} or None
        if self.assistant_only_loss:  # the masks' training template (if one applies) renders prompts too
            template_kwargs = chat.with_training_template(self.processing_class, template_kwargs)
        return {"tools": tools, "template_kwargs": template_kwargs}

    def pair(self, row: Mapping[str, Any], completion: Any) -> tuple[list[int], list[int]]:
        """Token ids of the row's prompt and of ``completion`` after it (pre-tokenised rows: as given)."""
        prompt = row["prompt"]
        if token_ids(prompt) and token_ids(completion):
            return list(prompt), list(completion)
        prompt_ids, completion_ids = chat.encode_prompt_completion(self.processing_class, prompt, completion,
                                                                   images=row.get("images"), **self.chat_inputs(row))
        if not chat.is_conversational(prompt):
            completion_ids = self.with_eos(completion_ids)
        return prompt_ids, completion_ids

    def fit(self, prompt_len: int, completion_lens: list[int]) -> tuple[slice, list[slice], bool]:
        """Slices that truncate a prompt and its completions to ``max_length`` tokens each.

        ``keep_start`` cuts completion ends; ``keep_end`` cuts the prompt's start first. The
        example is *overlong* when truncation would leave its prompt or a completion empty.
        """
        limit, longest = self.max_length, max(completion_lens)
        whole = [slice(0, n) for n in completion_lens]
        if limit is None or prompt_len + longest <= limit:
            return slice(0, prompt_len), whole, False
        if self.truncation_mode == "keep_start":
            room = limit - prompt_len
            return slice(0, prompt_len), [slice(0, min(n, room)) for n in completion_lens], room < 1
        if longest >= limit:  # keep_end: not even one prompt token fits
            return slice(prompt_len, prompt_len), [slice(max(0, n - limit), n) for n in completion_lens], prompt_len > 0
        return slice(prompt_len - (limit - longest), prompt_len), whole, False


def _removed(prompt: slice, prompt_len: int, completions: list[slice], lens: list[int]) -> int:
    kept = (prompt.stop - prompt.start) + sum(s.stop - s.start for s in completions)
    return prompt_len + sum(lens) - kept


@attrs.frozen
class Encoded:
    """One tokenised example and what tokenising it cost.

    ``removed`` counts tokens truncation cut; ``overlong`` is the prompt's length when it leaves
    no room under ``max_length`` (0 otherwise); ``untrained`` says why the example keeps no
    trained token (empty when it keeps one) and ``detail`` what in the example shows it;
    ``identical`` marks a preference pair whose chosen and rejected tokens are the same.
    """

    tokens: dict
    removed: int = 0
    overlong: int = 0
    untrained: str = ""
    detail: str = ""
    identical: bool = False


def _trained(mask: Sequence[int]) -> int:
    """Tokens a row trains on: marked ones, except the first, which nothing predicts."""
    return sum(mask[1:])


def _roles(value: Any) -> str:
    """The message roles of a conversation, for naming a misspelled one ('' for a string)."""
    if not chat.is_conversational(value):
        return ""
    return "roles " + ", ".join(repr(r) for r in dict.fromkeys(m["role"] for m in value))


def _cut_off(enc: Encoder) -> str:
    return (f"truncation to max_length={enc.max_length} ({enc.truncation_mode}) cut off every trained token "
            "(raise max_length or change truncation_mode)")


def _completion_untrained(enc: Encoder, side: str, prompt: list[int], before: int, kept: list[int],
                          value: Any) -> tuple[str, str]:
    """Why a completion of a preference or unpaired example trains nothing ('' when it trains)."""
    trained = len(kept) - (not prompt)  # with no prompt, nothing predicts the completion's first token
    if trained > 0:
        return "", ""
    if before > (not prompt):
        return _cut_off(enc), ""
    return (f"the {side} completion renders to no token after the prompt: the chat template drops it or the "
            "prompt already ends with it (check its roles and content)", _roles(value))


def _encode_language_modeling(row: dict, enc: Encoder, kind: str) -> Encoded:
    images, rendering = row.get("images"), enc.chat_inputs(row)
    if kind == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        prompt_ids, completion_ids = enc.pair(row, completion)
        ids = prompt_ids + completion_ids
        completion_only = True if enc.completion_only_loss is None else enc.completion_only_loss
        mask = [int(not completion_only)] * len(prompt_ids) + [1] * len(completion_ids)
        if enc.assistant_only_loss:
            full_ids, assistant = chat.encode_with_assistant_mask(enc.processing_class, chat.join(prompt, completion),
                                                                  images=images, **rendering)
            if full_ids != ids:
                raise PlaitError("assistant_only_loss: the template renders the conversation differently from prompt + completion; set assistant_only_loss=False")
            mask = [m & a for m, a in zip(mask, assistant)]
        p, (c,), overlong = enc.fit(len(prompt_ids), [len(completion_ids)])
        # p always ends at the prompt's end, and c starts at 0 unless p is empty: one contiguous window.
        window = slice(p.start + c.start, len(prompt_ids) + c.stop)
        removed = _removed(p, len(prompt_ids), [c], [len(completion_ids)])
        tokens = {"input_ids": ids[window], "completion_mask": mask[window]}
        why, detail = _lm_untrained(enc, mask, tokens["completion_mask"], chat.join(prompt, completion)
                                    if chat.is_conversational(prompt) else completion)
        return Encoded(tokens, removed, len(prompt_ids) if overlong else 0, why, detail)
    text = row["text"]
    if chat.is_conversational(text):
        ids, mask = chat.encode_conversation(enc.processing_class, text, assistant_only=enc.assistant_only_loss,
                                             images=images, **rendering)
    else:
        ids = enc.with_eos(chat.encode(enc.processing_class, text, special_tokens=True, images=images))
        mask = [1] * len(ids)
    _, (window,), _ = enc.fit(0, [len(ids)])
    tokens = {"input_ids": ids[window], "completion_mask": mask[window]}
    why, detail = _lm_untrained(enc, mask, tokens["completion_mask"], text)
    return Encoded(tokens, len(ids) - (window.stop - window.start), 0, why, detail)


def _lm_untrained(enc: Encoder, mask: list[int], kept: list[int], value: Any) -> tuple[str, str]:
    """Why a language-modelling row trains nothing ('' when it trains): its mask before and after truncation."""
    if _trained(kept) > 0:
        return "", ""
    if _trained(mask) > 0:
        return _cut_off(enc), ""
    if enc.assistant_only_loss:
        return ("no assistant token: assistant_only_loss=True trains only messages whose role is 'assistant' "
                "(fix misspelled roles or set assistant_only_loss=False)", _roles(value))
    return ("no token to train on: the completion renders to nothing or the text is a single token "
            "(check the data, or set completion_only_loss=False)", _roles(value))


def _encode_preference(row: dict, enc: Encoder, kind: str) -> Encoded:
    prompt_c, chosen = enc.pair(row, row["chosen"])
    prompt_r, rejected = enc.pair(row, row["rejected"])
    # Both boundaries are prefixes of the same rendered prompt: share the shorter one.
    n = min(len(prompt_c), len(prompt_r))
    prompt_ids, chosen, rejected = prompt_c[:n], prompt_c[n:] + chosen, prompt_r[n:] + rejected
    lens = [len(chosen), len(rejected)]
    p, (c, r), overlong = enc.fit(n, lens)
    out = {"prompt_ids": prompt_ids[p], "chosen_ids": chosen[c], "rejected_ids": rejected[r]}
    why, detail = "", ""
    for side, before in zip(("chosen", "rejected"), lens):
        why, detail = _completion_untrained(enc, side, out["prompt_ids"], before, out[f"{side}_ids"], row[side])
        if why:
            break
    identical = out["chosen_ids"] == out["rejected_ids"]
    return Encoded(out, _removed(p, n, [c, r], lens), n if overlong else 0, why, detail, identical)


def _encode_unpaired(row: dict, enc: Encoder, kind: str) -> Encoded:
    prompt_ids, completion_ids = enc.pair(row, row["completion"])
    p, (c,), overlong = enc.fit(len(prompt_ids), [len(completion_ids)])
    out = {"prompt_ids": prompt_ids[p], "completion_ids": completion_ids[c], "label": row["label"]}
    why, detail = _completion_untrained(enc, "completion", out["prompt_ids"], len(completion_ids),
                                        out["completion_ids"], row["completion"])
    removed = _removed(p, len(prompt_ids), [c], [len(completion_ids)])
    return Encoded(out, removed, len(prompt_ids) if overlong else 0, why, detail)


def _encode_prompt_only(row: dict, enc: Encoder, kind: str) -> Encoded:
    prompt = row["prompt"]
    if chat.is_conversational(prompt):
        text = chat.render_prompt(enc.processing_class, prompt, **enc.chat_inputs(row))
        ids = chat.encode(enc.processing_class, text, special_tokens=False, images=row.get("images"))
    else:
        ids = chat.encode(enc.processing_class, prompt, special_tokens=True, images=row.get("images"))
    overlong = enc.max_length is not None and len(ids) > enc.max_length
    return Encoded({"prompt_ids": ids, "prompt": prompt}, overlong=len(ids) if overlong else 0)


def _paired_to_unpaired(row: dict) -> list[dict]:
    """KTO from preference pairs: the chosen completion is desirable, the rejected one is not."""
    base = {k: v for k, v in row.items() if k not in ("chosen", "rejected")}
    return [{**base, "completion": row["chosen"], "label": True}, {**base, "completion": row["rejected"], "label": False}]


@attrs.frozen
class Task:
    """What a method consumes: which canonical kinds it accepts and how a row is tokenised."""

    name: str
    accepts: Mapping[str, Callable[[dict], list[dict]] | None]  # kind -> row expansion (None: as is)
    encode: Callable[[dict, Encoder, str], Encoded]
    consumes: tuple[str, ...]  # canonical fields replaced by token columns; other columns are kept
    columns: tuple[str, ...]
    purpose: str


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("language_modeling", {"language_modeling": None, "prompt_completion": None}, _encode_language_modeling,
             ("text", "prompt", "completion"), ("input_ids", "completion_mask"), "SFT"),
        Task("preference", {"preference": None}, _encode_preference,
             ("prompt", "chosen", "rejected"), ("prompt_ids", "chosen_ids", "rejected_ids"), "DPO and reward models"),
        Task("unpaired", {"unpaired_preference": None, "preference": _paired_to_unpaired}, _encode_unpaired,
             ("prompt", "completion", "label"), ("prompt_ids", "completion_ids", "label"), "KTO"),
        Task("prompt_only", {k: None for k in ("prompt_only", "prompt_completion", "preference", "unpaired_preference")},
             _encode_prompt_only, ("prompt",), ("prompt_ids", "prompt"), "GRPO, RLOO and online methods"),
    )
}


class FormatDecided(Exception):
    """What :func:`prepare_dataset` raises under :func:`deciding_format`, once it has decided the format
    of a dataset for a task and checked what it can check before tokenising: ``plait <method> --check``
    runs a method's own ``prepare`` on a dataset's first rows this way, so check and run decide alike."""

    def __init__(self, format_name: str, task: str, columns: list[str]):
        super().__init__(f"{format_name} for task {task!r}")
        self.format_name, self.task, self.columns = format_name, task, columns


_DECIDING_FORMAT = contextvars.ContextVar("plait_deciding_format", default=False)


@contextlib.contextmanager
def deciding_format():
    """Within it, :func:`prepare_dataset` stops with :class:`FormatDecided` instead of tokenising."""
    token = _DECIDING_FORMAT.set(True)
    try:
        yield
    finally:
        _DECIDING_FORMAT.reset(token)


def _choice(name: str, value: Any, options: Sequence[str]) -> None:
    if value not in options:
        raise PlaitError(f"{name}={value!r} is not valid; use one of {list(options)}")


def prepare_dataset(
    dataset: Any,
    processing_class: Any,
    task: str,
    *,
    plugins: Any = None,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    on_overlong: str = "drop",
    chat_template_path: str | None = None,
    num_proc: int | None = None,
    chat_template_kwargs: dict | None = None,
    text_field: str = "text",
):
    """Detect the format of ``dataset`` and tokenise it once for ``task`` (see the module table).

    ``dataset`` is a ``datasets.Dataset`` or a list of row dicts. Rows whose prompt leaves no room
    under ``max_length`` are dropped with a count (``on_overlong="drop"``) or refused
    (``"error"``); other long rows are truncated per ``truncation_mode`` and reported.
    ``completion_only_loss=None`` trains on completions only for prompt-completion data;
    ``assistant_only_loss`` trains only on assistant turns of conversations. ``chat_template_kwargs``
    are template variables for rendering conversations, updated by a row's own ``chat_template_kwargs``
    column (:meth:`Encoder.chat_inputs`).
    ``text_field`` names the column read as language-modelling text (TRL's ``dataset_text_field``).
    """
    import datasets

    _choice("task", task, list(TASKS))
    _choice("truncation_mode", truncation_mode, TRUNCATION_MODES)
    _choice("on_overlong", on_overlong, OVERLONG_POLICIES)
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise PlaitError(f"max_length={max_length!r} must be a positive integer or None")
    spec = TASKS[task]
    if assistant_only_loss and task != "language_modeling":
        raise PlaitError(f"assistant_only_loss=True applies to task 'language_modeling', not {task!r}; remove it")
    if chat_template_path is not None:
        chat.load_chat_template(processing_class, chat_template_path)
    plugins = plugins or _default_plugins()
    dataset = read_text_from(dataset, text_field, plugins)

    component = detect_format(dataset, plugins, kinds=spec.accepts)
    fmt: DataFormat = component.obj
    if isinstance(dataset, list):
        dataset = datasets.Dataset.from_list(dataset)
    columns = columns_of(dataset)
    if fmt.kind not in spec.accepts:
        raise PlaitError(_wrong_kind(task, spec, component, columns, plugins))

    if fmt.multimodal:
        vision.require_processor(processing_class, component.name)
    stream = is_stream(dataset)
    first = fmt.to_canonical(_rows(dataset, 1)[1][0] if stream else dataset[0])
    conversational = is_conversational_example(first, fmt.kind)
    text_fields = [f for f in KINDS[fmt.kind] if f in TEXT_FIELDS]
    if conversational:
        chat.require_chat_template(processing_class, text_fields[0])
    else:
        if assistant_only_loss:
            raise PlaitError("assistant_only_loss=True needs conversational data (lists of messages); this dataset holds strings")
        _, sample = _rows(dataset, 100)
        if not is_tokenised(first, fmt.kind):
            chat.warn_if_templated(processing_class, [fmt.to_canonical(row) for row in sample], text_fields)
    if _DECIDING_FORMAT.get():
        raise FormatDecided(component.name, task, columns)

    encoder = Encoder(processing_class, max_length, truncation_mode, completion_only_loss, assistant_only_loss,
                      chat_template_kwargs)
    expand = spec.accepts[fmt.kind] or (lambda row: [row])
    keep = task == "prompt_only"

    def process(batch: dict, indices: list[int]) -> dict:
        out: dict[str, list] = {}
        for index, values in zip(indices, zip(*batch.values())):
            row = _canonical(fmt, dict(zip(batch, values)), index)
            if is_conversational_example(row, fmt.kind) != conversational:
                raise PlaitError(f"dataset row {index} mixes standard and conversational rows with row 0; use one variant throughout")
            for item in expand(row):
                try:
                    encoded = spec.encode(item, encoder, fmt.kind)
                except PlaitError as err:
                    raise PlaitError(f"dataset row {index}: {err}") from None
                cut = vision.mask_and_count(processing_class, encoded.tokens, item.get("images")) if fmt.multimodal else 0
                extras = {k: v for k, v in item.items() if keep or k not in spec.consumes}
                record = {**extras, **encoded.tokens, "_plait_row": index, "_plait_removed": encoded.removed,
                          "_plait_overlong": encoded.overlong, "_plait_untrained": encoded.untrained,
                          "_plait_detail": encoded.detail, "_plait_identical": encoded.identical,
                          "_plait_images_cut": cut}
                for key, value in record.items():
                    out.setdefault(key, []).append(value)
        return out

    if stream:  # tokenised lazily, row by row as training reads them
        processed = dataset.map(process, batched=True, with_indices=True, remove_columns=columns)
        return _stream_row_policies(processed, max_length, on_overlong, truncation_mode)
    processed = dataset.map(
        process, batched=True, with_indices=True, remove_columns=columns, num_proc=num_proc,
        desc=f"plait: tokenising {component.name} for {task}",
    )
    if fmt.multimodal and "images" in processed.column_names:  # encoded PIL images: decode them when read again
        processed = processed.cast_column("images", datasets.List(datasets.Image()))
    return _apply_row_policies(processed, len(dataset), max_length, on_overlong, truncation_mode)


def read_text_from(dataset: Any, text_field: str, plugins: Any):
    """``dataset`` with its column ``text_field`` as the language-modelling ``text`` column.

    As in TRL, only that column is read as text (a ``text`` column beside it is dropped), and
    datasets of another shape (prompt-completion, conversations) do not read it at all.
    """
    if not isinstance(text_field, str) or not text_field:
        raise PlaitError(f"dataset_text_field={text_field!r} must be a column name")
    if text_field == "text":
        return dataset
    import datasets

    if isinstance(dataset, list):
        _rows(dataset, None)  # rows of one shape, checked before they become columns
        dataset = datasets.Dataset.from_list(dataset)
    columns = columns_of(dataset)
    if text_field in columns:
        return dataset.remove_columns([c for c in columns if c == "text"]).rename_column(text_field, "text")
    missing = f"dataset_text_field={text_field!r} is not a column of the dataset (columns {sorted(columns)})"
    if "text" in columns:
        raise PlaitError(f"{missing}; name the column that holds the text, e.g. dataset_text_field='text'")
    try:
        detect_format(dataset, plugins)
    except PlaitError as err:
        raise PlaitError(f"{missing}, and no other shape fits: {err}") from None
    return dataset


def _wrong_kind(task: str, spec: Task, component, columns: list[str], plugins) -> str:
    wanted = [c for c in plugins.data_formats if c.obj.kind in spec.accepts]
    shapes = "; ".join(f"{c.obj.describe()} ({c.name})" for c in wanted)
    missing = ""
    if wanted:
        best = min((set(s) - set(columns) for c in wanted for s in c.obj.shapes), key=len)
        missing = f"missing column(s) {sorted(best)}; "
    return (
        f"task {task!r} ({spec.purpose}) cannot use {component.name} data (columns {sorted(columns)}): "
        f"{missing}it accepts {shapes}"
    )


def _apply_row_policies(processed, n_rows: int, max_length: int | None, on_overlong: str, mode: str):
    """Drop (or refuse) overlong examples, drop examples that keep no trained token, report the rest."""
    processed = _drop_cut_images(processed, max_length, on_overlong)
    overlong = processed["_plait_overlong"]
    bad = [i for i, n in enumerate(overlong) if n]
    if bad:
        rows = processed["_plait_row"]
        if on_overlong == "error":
            raise PlaitError(
                f"dataset row {rows[bad[0]]}: its prompt ({overlong[bad[0]]} tokens) leaves no room under "
                f"max_length={max_length} ({mode}); raise max_length, or set on_overlong='drop' to skip "
                f"such rows ({len(bad)} of {len(processed)})"
            )
        logger.warning(
            "plait: dropped %d of %d examples whose prompt leaves no room under max_length=%s (%s); "
            "raise max_length to keep them", len(bad), len(processed), max_length, mode,
        )
        bad_set = set(bad)
        processed = processed.select([i for i in range(len(processed)) if i not in bad_set])
    if len(processed) == 0:
        raise PlaitError(f"every one of the {n_rows} examples was dropped as overlong under max_length={max_length}; raise max_length")
    processed = _drop_untrained(processed)
    removed = [n for n in processed["_plait_removed"] if n]
    if removed:
        logger.warning(
            "plait: truncated %d of %d examples to max_length=%s (%s): %d tokens removed, mean %.1f, max %d per example",
            len(removed), len(processed), max_length, mode, sum(removed), sum(removed) / len(removed), max(removed),
        )
    identical = [i for i, same in enumerate(processed["_plait_identical"]) if same]
    if identical:
        logger.warning(
            "plait: %d of %d preference pairs have identical chosen and rejected tokens after templating and "
            "truncation (e.g. dataset row %d); they carry no preference signal: fix or drop them",
            len(identical), len(processed), processed["_plait_row"][identical[0]],
        )
    return processed.remove_columns(list(_BOOKKEEPING))


_BOOKKEEPING = ("_plait_row", "_plait_removed", "_plait_overlong", "_plait_untrained", "_plait_detail",
                "_plait_identical", "_plait_images_cut")


def _stream_row_policies(processed, max_length: int | None, on_overlong: str, mode: str):
    """The row policies of :func:`_apply_row_policies` applied lazily to a stream, one row as it is read:
    overlong rows (or rows whose cut would split an image) are refused or skipped, rows that keep no trained
    token are skipped. A stream has no end to count to, so each skipped row is logged at debug level only,
    and a stream that skips every row ends training early (transformers warns that it ran out of data)."""

    def keep(row: dict) -> bool:
        cut = row["_plait_overlong"] or row["_plait_images_cut"]
        if cut and on_overlong == "error":
            what = f"its prompt ({row['_plait_overlong']} tokens) leaves no room" if row["_plait_overlong"] else (
                f"its {row['_plait_images_cut']} image tokens would be cut")
            raise PlaitError(f"dataset row {row['_plait_row']}: {what} under max_length={max_length} ({mode}); raise "
                             "max_length, or set on_overlong='drop' to skip such rows")
        if cut or row["_plait_untrained"]:
            logger.debug("plait: skipped stream row %d (%s)", row["_plait_row"],
                         row["_plait_untrained"] or f"overlong under max_length={max_length}")
            return False
        return True

    return processed.filter(keep).remove_columns(list(_BOOKKEEPING))


def _drop_cut_images(processed, max_length: int | None, on_overlong: str):
    """Drop (or refuse) examples whose truncation to ``max_length`` would cut into an image's tokens."""
    cut = processed["_plait_images_cut"]
    bad = [i for i, n in enumerate(cut) if n]
    if not bad:
        return processed
    row = processed["_plait_row"][bad[0]]
    if on_overlong == "error" or len(bad) == len(processed):
        fix = ", or set on_overlong='drop' to skip such rows" if on_overlong == "error" else " (no row would be left)"
        raise PlaitError(f"dataset row {row}: max_length={max_length} would cut into its {cut[bad[0]]} image tokens "
                         f"({len(bad)} of {len(processed)} rows); raise max_length or use smaller images{fix}")
    logger.warning("plait: dropped %d of %d examples whose truncation to max_length=%s would cut an image's tokens "
                   "(e.g. dataset row %d); raise max_length or use smaller images to keep them",
                   len(bad), len(processed), max_length, row)
    bad_set = set(bad)
    return processed.select([i for i in range(len(processed)) if i not in bad_set])


def _drop_untrained(processed):
    """Drop examples that keep no trained token (a loss over no tokens is 0/0); refuse when none remain."""
    reasons = processed["_plait_untrained"]
    bad = [i for i, why in enumerate(reasons) if why]
    if not bad:
        return processed
    rows, details = processed["_plait_row"], processed["_plait_detail"]
    groups: dict[str, list[int]] = {}
    for i in bad:
        groups.setdefault(reasons[i], []).append(i)
    summary = "; ".join(
        f"{len(members)}: {why} - e.g. dataset row {rows[members[0]]}"
        + (f" ({details[members[0]]})" if details[members[0]] else "")
        for why, members in groups.items()
    )
    if len(bad) == len(processed):
        raise PlaitError(
            f"none of the {len(processed)} examples keeps a trained token after templating, masking and truncation; {summary}"
        )
    logger.warning(
        "plait: dropped %d of %d examples that keep no trained token after templating, masking and truncation; %s",
        len(bad), len(processed), summary,
    )
    bad_set = set(bad)
    return processed.select([i for i in range(len(processed)) if i not in bad_set])


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------

PACKED_COLUMNS = ("input_ids", "completion_mask")


def packing_efficiency(lengths: Sequence[int], rows: int, max_length: int) -> float:
    """Fraction of the ``rows × max_length`` token slots that hold real tokens."""
    return sum(lengths) / (rows * max_length) if rows else 0.0


def check_bins(bins: list[list[tuple[int, int, int]]], lengths: Sequence[int], max_length: int, strategy: str) -> None:
    for b in bins:
        size = sum(end - start for _, start, end in b)
        if size > max_length or any(not 0 <= start < end <= lengths[i] for i, start, end in b):
            raise PlaitError(f"packing strategy {strategy!r} produced an invalid bin {b[:4]}... (size {size} > {max_length}?); report it to its author")


def pack_dataset(dataset: Any, strategy: str = "bfd", max_length: int = 1024, plugins: Any = None, *,
                 stream_window: int = 1000):
    """Pack a tokenised language-modelling dataset into rows of at most ``max_length`` tokens.

    Output columns: ``input_ids``, ``completion_mask`` (when present) and ``seq_lengths``, the
    lengths of the document pieces in each row (for padding-free attention and position ids).
    Strategies registered with ``padding_free=True`` (bfd) must be collated padding-free.
    A stream (``IterableDataset``) is packed lazily, ``stream_window`` rows at a time (as TRL packs
    a stream: each window's rows into bins of their own).
    """
    import datasets

    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise PlaitError(f"max_length={max_length!r} must be a positive integer for packing")
    plugins = plugins or _default_plugins()
    component = plugins.packing_strategies.get(strategy, family="packing")
    given = columns_of(dataset)
    if "input_ids" not in given:
        raise PlaitError(f"pack_dataset needs a tokenised dataset with 'input_ids'; got columns {given}; run prepare_dataset first")
    columns = [c for c in PACKED_COLUMNS if c in given]
    if is_stream(dataset):
        return dataset.map(lambda window: _pack(component, window, columns, max_length), batched=True,
                           batch_size=stream_window, remove_columns=given)
    packed = _pack(component, {c: dataset[c] for c in columns}, columns, max_length)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    kept, rows = sum(map(len, packed["input_ids"])), len(packed["input_ids"])
    logger.info(
        "plait: %s packed %d sequences (%d tokens) into %d rows of %d: efficiency %.1f%%, %.1f%% of tokens kept",
        component.name, len(lengths), sum(lengths), rows, max_length,
        100 * packing_efficiency([kept], rows, max_length), 100 * kept / max(1, sum(lengths)),
    )
    return datasets.Dataset.from_dict(packed)


def _pack(component, data: Mapping[str, list], columns: list[str], max_length: int) -> dict[str, list]:
    """The rows of ``data`` (columns of token lists) packed into the bins ``component`` chooses."""
    lengths = [len(ids) for ids in data["input_ids"]]
    bins = component.obj(lengths, max_length)
    check_bins(bins, lengths, max_length, component.name)
    packed: dict[str, list] = {c: [] for c in (*columns, "seq_lengths")}
    for b in bins:
        for c in columns:
            packed[c].append([t for i, start, end in b for t in data[c][i][start:end]])
        packed["seq_lengths"].append([end - start for _, start, end in b])
    return packed
