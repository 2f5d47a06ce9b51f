"""Chat templates, applied exactly once: rendering, prompt/completion boundaries, assistant masks.

Conversational values are lists of ``{"role", "content"}`` messages (assistant messages may
carry ``tool_calls`` instead of content); standard values are plain strings used as they are.

* A prompt that ends in a user, system or tool turn is rendered with the generation prompt; one
  that ends in an assistant turn is continued (``continue_final_message``).
* The prompt/completion boundary is the longest common token prefix of the rendered prompt and
  the rendered prompt+completion, so templates that rewrite the end of a prompt (a generation
  header the full conversation renders differently) cannot shift completion tokens into the
  prompt or the other way round.
* Assistant-only masks come from ``{% generation %}`` markers when the template has them, and
  otherwise are derived by rendering growing prefixes of the conversation: the span of an
  assistant turn runs from the end of the generation prompt before it to its end-of-sequence
  token (what the model emits when it stops). That is sound only for prefix-preserving
  templates, which is checked on every example. A template that rewrites earlier turns (e.g. drops
  past reasoning) is replaced, for the masks, by a registered training template that recognises it
  (``register_chat_templates``: Qwen3, DeepSeek-R1-Distill; said once in the log), and is refused with a
  clear error when none does. A run may also name one (``chat_template_path: qwen3``).
"""

from __future__ import annotations

import logging
import pathlib
import re
import warnings
from typing import Any, Mapping, Sequence

from plait.errors import PlaitError

from .pretrained import pretrained_kwargs

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SENTINEL = "PLAITSENTINEL"
logger = logging.getLogger("plait")
_announced: set[str] = set()  # training templates already said to be in use


def tokenizer_of(processing_class: Any) -> Any:
    """The text tokenizer of a tokenizer or a multimodal processor."""
    return getattr(processing_class, "tokenizer", None) or processing_class


# -- what a value is -------------------------------------------------------------------------


def is_conversational(value: Any) -> bool:
    """True for a list of role/content messages (an empty list counts: a conversation with no turns)."""
    return isinstance(value, (list, tuple)) and all(isinstance(m, Mapping) and "role" in m for m in value)


def check_messages(messages: Sequence[Mapping[str, Any]], column: str, *, parts: bool = False) -> list[dict]:
    """Validate messages and return clean copies (keys that Arrow filled with None removed).

    With ``parts`` (image-bearing data for a vision-language model) a content may also be a list of
    ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts."""
    clean = []
    for position, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise PlaitError(f"column {column!r} message {position} has role {role!r}; every message needs a string 'role'")
        content = message.get("content")
        tool_calls = message.get("tool_calls")
        if content is None and not tool_calls:
            raise PlaitError(
                f"column {column!r} message {position} ({role}) has content None; give it a string "
                "(only assistant messages with tool_calls may omit content)"
            )
        if parts and isinstance(content, (list, tuple)):
            content = check_parts(content, column, position, role)
            message = {**message, "content": content}
        elif content is not None and not isinstance(content, str):
            raise PlaitError(
                f"column {column!r} message {position} ({role}) has non-string content of type "
                f"{type(content).__name__}; plait's text methods need 'content' to be a string"
                + ("; content parts are for vision-language data: add an 'images' column holding the row's images"
                   if isinstance(content, (list, tuple)) else "")
            )
        clean.append({k: v for k, v in message.items() if v is not None or k == "content"})
    return clean


def check_parts(content: Sequence[Any], column: str, position: int, role: str) -> list[dict]:
    """A message's content parts, each ``{"type": "image"}`` or ``{"type": "text", "text": str}``
    (Arrow's None-filled keys removed)."""
    clean = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            clean.append({"type": "text", "text": part["text"]})
        elif kind == "image" and all(part.get(k) is None for k in ("image", "url", "path")):
            clean.append({"type": "image"})
        elif kind == "image":
            raise PlaitError(f"column {column!r} message {position} ({role}) has an image inside its content part; put the "
                             "row's images in an 'images' column, in order, and leave {'type': 'image'} in the message")
        else:
            raise PlaitError(f"column {column!r} message {position} ({role}) has a content part {part!r}; parts must be "
                             "{'type': 'image'} or {'type': 'text', 'text': str}")
    return clean


def text_of(content: Any, image: str = "") -> str:
    """The text of a message content: the string, or its parts joined (each image part as ``image``)."""
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join((p.get("text") or "") if p.get("type") == "text" else image for p in content if isinstance(p, Mapping))


# -- templates ---------------------------------------------------------------------------------


def has_chat_template(processing_class: Any) -> bool:
    return bool(getattr(tokenizer_of(processing_class), "chat_template", None))


def marks_generation(template: Any) -> bool:
    """Whether a chat template (a Jinja string) carries ``{% generation %}`` markers."""
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def has_generation_markers(processing_class: Any) -> bool:
    return marks_generation(getattr(tokenizer_of(processing_class), "chat_template", None))


def require_chat_template(processing_class: Any, column: str) -> None:
    if not has_chat_template(processing_class):
        raise PlaitError(
            f"column {column!r} holds conversations but the tokenizer has no chat template; set "
            "chat_template_path to a Jinja template file (or a model folder whose tokenizer has one)"
        )


def _chat_templates(plugins: Any = None) -> Any:
    from plait.manager import default_plugins  # deferred: the registry loads every plugin

    return (plugins or default_plugins()).chat_templates


def load_chat_template(processing_class: Any, path: str | pathlib.Path, plugins: Any = None) -> None:
    """Set the tokenizer's chat template from a Jinja file, a model/tokenizer folder, or a registered training
    template named by its family (``qwen3`` or ``template.qwen3``) when no such path exists."""
    name, path = str(path), pathlib.Path(path)
    tokenizer = tokenizer_of(processing_class)
    if not path.exists() and re.fullmatch(r"[a-z0-9_.]+", name):
        try:
            tokenizer.chat_template = _chat_templates(plugins).get(name, family="template").obj
        except PlaitError as err:  # unknown (did you mean ...): say which field named it
            raise PlaitError(f"chat_template_path={name!r} is no file or folder, and {err}") from None
    elif path.is_file():
        tokenizer.chat_template = path.read_text()
    elif path.is_dir():
        from transformers import AutoTokenizer
        template = AutoTokenizer.from_pretrained(path, **pretrained_kwargs()).chat_template
        if not template:
            raise PlaitError(f"chat_template_path={str(path)!r}: that tokenizer has no chat template; point at one that does")
        tokenizer.chat_template = template
    else:
        raise PlaitError(f"chat_template_path={str(path)!r} does not exist; give a .jinja file, a model folder or the "
                         "name of a training chat template (plait list templates)")


def training_template(processing_class: Any, plugins: Any = None) -> str | None:
    """The registered training template that recognises the tokenizer's own chat template, when that template lacks
    ``{% generation %}`` markers (None when it has them or no registered template recognises it)."""
    template = getattr(tokenizer_of(processing_class), "chat_template", None)
    if not isinstance(template, str) or marks_generation(template):
        return None
    for component in _chat_templates(plugins):
        if component.options.recognise(template):
            if component.name not in _announced:
                _announced.add(component.name)
                # a warning, not info: earlier turns are trained as written, not as the model's template renders them
                logger.warning("plait: the tokenizer's chat template is %s's, which has no {%% generation %%} markers; "
                               "assistant-only masks use the training template %r (earlier turns rendered as written, "
                               "the last one as the model's own template renders it)",
                               component.name.split(".", 1)[1], component.name)
            return component.obj
    return None


def with_training_template(processing_class: Any,
                           template_kwargs: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``template_kwargs`` rendering with the :func:`training_template` that applies, if one does (as TRL's
    ``chat_template=``), so a prompt, its completion and their assistant masks all render with it."""
    training = training_template(processing_class)
    return template_kwargs if training is None else {**(template_kwargs or {}), "chat_template": training}


def render(
    processing_class: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Any = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The template's text for ``messages`` (an empty conversation renders as the empty string);
    ``template_kwargs`` are variables the template reads (e.g. ``enable_thinking``)."""
    if not messages:
        return ""
    tokenizer = tokenizer_of(processing_class)
    return tokenizer.apply_chat_template(
        list(messages), tools=tools or None, tokenize=False,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        **(template_kwargs or {}),
    )


def render_prompt(processing_class: Any, prompt: Sequence[Mapping[str, Any]], *, tools: Any = None,
                  template_kwargs: Mapping[str, Any] | None = None) -> str:
    """Render a prompt for generation: continue a final assistant turn, else open a new one."""
    continued = bool(prompt) and prompt[-1]["role"] == "assistant"
    if not prompt:
        return _assistant_header(processing_class, tools, template_kwargs)
    return render(processing_class, prompt, tools=tools, add_generation_prompt=not continued,
                  continue_final_message=continued, template_kwargs=template_kwargs)


def encode(processing_class: Any, text: str, *, special_tokens: bool, images: Sequence | None = None) -> list[int]:
    """Token ids of ``text``; with ``images``, their placeholders expanded by the processor (:mod:`plait.data.vision`)."""
    if images:
        from . import vision

        return vision.encode(processing_class, text, images, special_tokens=special_tokens)
    return list(tokenizer_of(processing_class)(text, add_special_tokens=special_tokens)["input_ids"])


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def join(prompt: list[dict], completion: list[dict]) -> list[dict]:
    """prompt + completion; a completion that starts in the assistant turn the prompt ends with continues it."""
    if prompt and completion and prompt[-1]["role"] == "assistant" and completion[0]["role"] == "assistant":
        merged = dict(prompt[-1])
        head, tail = prompt[-1].get("content") or "", completion[0].get("content") or ""
        if isinstance(head, list) or isinstance(tail, list):  # content parts (vision-language data)
            head, tail = (c if isinstance(c, list) else [{"type": "text", "text": c}] if c else [] for c in (head, tail))
        merged["content"] = head + tail
        if completion[0].get("tool_calls"):
            merged["tool_calls"] = completion[0]["tool_calls"]
        return [*prompt[:-1], merged, *completion[1:]]
    return [*prompt, *completion]


def encode_prompt_completion(processing_class: Any, prompt: Any, completion: Any, *, tools: Any = None,
                             images: Sequence | None = None,
                             template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the prompt and of the completion, split at their longest common token prefix.

    Standard strings are tokenised as they are (with the tokenizer's own special tokens, e.g. a
    BOS); conversations are rendered once with the chat template (given ``template_kwargs``).
    """
    if is_conversational(prompt):
        prompt_text = render_prompt(processing_class, prompt, tools=tools, template_kwargs=template_kwargs)
        full_text = render(processing_class, join(prompt, completion), tools=tools, template_kwargs=template_kwargs)
        prompt_ids = encode(processing_class, prompt_text, special_tokens=False, images=images)
        full_ids = encode(processing_class, full_text, special_tokens=False, images=images)
    else:
        prompt_ids = encode(processing_class, prompt, special_tokens=True, images=images)
        full_ids = encode(processing_class, prompt + completion, special_tokens=True, images=images)
    k = common_prefix_length(prompt_ids, full_ids)
    return full_ids[:k], full_ids[k:]


# -- assistant masks ---------------------------------------------------------------------------


def _assistant_header(processing_class: Any, tools: Any, template_kwargs: Mapping[str, Any] | None = None) -> str:
    # The text before an assistant's content when it opens the conversation.
    text = render(processing_class, [{"role": "assistant", "content": _SENTINEL}], tools=tools,
                  template_kwargs=template_kwargs)
    return text[: text.index(_SENTINEL)] if _SENTINEL in text else ""


def assistant_spans(processing_class: Any, messages: list[dict], *, tools: Any = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns, by prefix diffing.

    Raises :class:`PlaitError` when the template is not prefix-preserving.
    """
    eos = getattr(tokenizer_of(processing_class), "eos_token", None)
    full = render(processing_class, messages, tools=tools, template_kwargs=template_kwargs)
    spans = []
    for i, message in enumerate(messages):
        upto = render(processing_class, messages[: i + 1], tools=tools, template_kwargs=template_kwargs)
        if not full.startswith(upto):
            raise _not_prefix_preserving(i + 1)
        if message["role"] != "assistant":
            continue
        if i == 0:
            head = _assistant_header(processing_class, tools, template_kwargs)
        else:
            head = render(processing_class, messages[:i], tools=tools, add_generation_prompt=True,
                          template_kwargs=template_kwargs)
        if not upto.startswith(head):
            raise _not_prefix_preserving(i, generation_prompt=True)
        turn = upto[len(head):]
        # The turn ends with the token the model stops on; text after it (a newline) is scaffolding.
        end = len(head) + turn.rindex(eos) + len(eos) if eos and eos in turn else len(upto)
        content = message.get("content")
        if isinstance(content, str) and content and content.strip() not in upto[len(head):end]:
            raise _not_prefix_preserving(i, content=True)
        spans.append((len(head), end))
    return full, spans


def _not_prefix_preserving(n: int, *, generation_prompt: bool = False, content: bool = False) -> PlaitError:
    if content:
        what = f"assistant message {n}'s content does not appear inside its derived turn"
    elif generation_prompt:
        what = f"the first {n} messages rendered with the generation prompt are not a prefix of the conversation"
    else:
        what = f"rendering the first {n} messages is not a prefix of rendering the whole conversation"
    return PlaitError(
        f"assistant_only_loss=True: the chat template is not prefix-preserving ({what}; it rewrites earlier "
        "turns) and no registered training template recognises it (plait list templates), so assistant tokens "
        "cannot be located; name one (chat_template_path: qwen3), give a template with {% generation %} markers "
        "via chat_template_path, or set assistant_only_loss=False"
    )


def encode_with_assistant_mask(processing_class: Any, messages: list[dict], *, tools: Any = None,
                               images: Sequence | None = None,
                               template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a 0/1 mask of its assistant tokens.

    Uses the template's ``{% generation %}`` markers when present, else those of the registered training
    template that recognises it (:func:`training_template`), else :func:`assistant_spans`.
    With ``images`` the ids are the processor's expansion and image tokens are masked out.
    """
    tokenizer = tokenizer_of(processing_class)
    template_kwargs = with_training_template(tokenizer, template_kwargs)
    if "chat_template" in (template_kwargs or {}) or has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            **(template_kwargs or {}),
        )
        ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    else:
        ids, mask = derived_assistant_mask(tokenizer, messages, tools=tools, template_kwargs=template_kwargs)
    if not images:
        return ids, mask
    from . import vision

    text = render(processing_class, messages, tools=tools, template_kwargs=template_kwargs)
    expanded = vision.encode(processing_class, text, images, special_tokens=False)
    return expanded, vision.carry_mask(ids, expanded, mask)


def encode_conversation(processing_class: Any, messages: list[dict], *, assistant_only: bool = False, tools: Any = None,
                        images: Sequence | None = None,
                        template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and the 0/1 mask of the tokens it trains on: its assistant turns with
    ``assistant_only`` (:func:`encode_with_assistant_mask`), else every token."""
    if assistant_only:
        return encode_with_assistant_mask(processing_class, messages, tools=tools, images=images,
                                          template_kwargs=template_kwargs)
    text = render(processing_class, messages, tools=tools, template_kwargs=template_kwargs)
    ids = encode(processing_class, text, special_tokens=False, images=images)
    return ids, [1] * len(ids)


def derived_assistant_mask(processing_class: Any, messages: list[dict], *, tools: Any = None,
                           template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """Assistant mask from prefix diffing, whatever markers the template has (see module docstring)."""
    tokenizer = tokenizer_of(processing_class)
    text, spans = assistant_spans(tokenizer, messages, tools=tools, template_kwargs=template_kwargs)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        int(any(start < span_end and end > span_start for span_start, span_end in spans))
        for start, end in encoding["offset_mapping"]
    ]
    return list(encoding["input_ids"]), mask


# -- the template-applied-twice mistake ---------------------------------------------------------


def role_markers(processing_class: Any) -> list[str]:
    """Text the template puts around turns (e.g. ``<|im_start|>user``), for spotting pre-templated strings."""
    if not has_chat_template(processing_class):
        return []
    user = [{"role": "user", "content": _SENTINEL}]
    try:
        text = render(processing_class, user)
        prompt = render(processing_class, user, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render a lone user turn has no usable markers
        return []
    bos = getattr(tokenizer_of(processing_class), "bos_token", None) or ""
    head = text[: text.index(_SENTINEL)] if _SENTINEL in text else ""
    head = head[len(bos):] if bos and head.startswith(bos) else head
    markers = [head.strip(), prompt[len(text):].strip()]
    return [m for m in dict.fromkeys(markers) if len(m) >= 2]


def warn_if_templated(processing_class: Any, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> bool:
    """Warn (once) when standard strings already contain the template's role markers."""
    markers = role_markers(processing_class)
    for index, row in enumerate(rows):
        for column in columns:
            value = row.get(column)
            for marker in markers:
                if isinstance(value, str) and marker in value:
                    warnings.warn(
                        f"column {column!r} row {index} is a string that already contains the chat template's "
                        f"marker {marker!r}: the template was applied before plait; pass lists of messages and let "
                        "plait apply it once, or remove the markers",
                        UserWarning,
                        stacklevel=3,
                    )
                    return True
    return False
