"""Image-bearing rows for vision-language models: any text layout plus an ``images`` column.

TRL's layout: the row's images (PIL images, file paths or a datasets ``Image`` feature; one or
several) in ``images``, and conversations whose message content may be a list of
``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts, one image part per image in
order. Conversations with no image part get them at the start of the first user turn (as TRL
does). Standard strings must hold the processor's image token themselves. The images stay in the
row (loaded as PIL images) for the processor, which expands their tokens when the data is
tokenised and makes ``pixel_values`` when it is batched.

Detection wraps the other formats' answer: a row with an ``images`` column is the vision variant
of whatever shape its other columns have, so no text format claims it first.
"""

from plait import hookimpl
from plait.data.chat import is_conversational
from plait.data.prepare import KINDS, TEXT_FIELDS, DataFormat
from plait.data.vision import load_images

# (name, kind, text shapes): most specific first, as detection tries them
_LAYOUTS = (
    ("format.vision_unpaired_preference", "unpaired_preference", (("prompt", "completion", "label"),)),
    ("format.vision_preference", "preference", (("prompt", "chosen", "rejected"),)),
    ("format.vision_prompt_completion", "prompt_completion", (("prompt", "completion"),)),
    ("format.vision_language_modeling", "language_modeling", (("text",), ("messages",))),
    ("format.vision_prompt_only", "prompt_only", (("prompt",),)),
)


def _has_image_part(messages) -> bool:
    return any(isinstance(m.get("content"), (list, tuple)) and any(
        isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages)


def with_image_parts(messages: list, count: int) -> list:
    """``messages`` with ``count`` image parts opening the first user turn (TRL's placement)."""
    out, placed = [], False
    for message in messages:
        if not placed and message.get("role") == "user":
            content = message.get("content")
            text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            message = {**message, "content": [{"type": "image"} for _ in range(count)] + text}
            placed = True
        out.append(message)
    return out


def _converter(kind: str):
    def convert(row: dict) -> dict:
        fields = {f: row[f] for f in KINDS[kind] if f in row}
        if kind == "language_modeling":
            fields = {"text": row["text"] if "text" in row else row["messages"]}
        images = load_images(row.get("images"))
        conversations = [f for f in fields if f in TEXT_FIELDS and is_conversational(fields[f])]
        if images and conversations and not any(_has_image_part(fields[f]) for f in conversations):
            first = conversations[0]  # the prompt (or the whole conversation): where the user asks
            fields[first] = with_image_parts(fields[first], len(images))
        return {**fields, "images": images}

    return convert


FORMATS = tuple(
    DataFormat(name=name, kind=kind, shapes=tuple((*shape, "images") for shape in shapes), convert=_converter(kind),
               multimodal=True, doc=f"{kind} with images: " + " or ".join(
                   "{" + ", ".join((*s, "images")) + "}" for s in shapes) + " (vision-language models).")
    for name, kind, shapes in _LAYOUTS
)


@hookimpl
def register_data_formats(register):
    for fmt in FORMATS:
        register(fmt.name, fmt, doc=fmt.doc)


@hookimpl(wrapper=True)
def detect_data_format(columns):
    answer = yield
    if "images" not in columns:
        return answer
    return next((fmt.name for fmt in FORMATS if fmt.detect(columns)), answer)
