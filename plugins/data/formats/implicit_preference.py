"""Preference data with an implicit prompt: ``{"chosen", "rejected"}`` sharing a common beginning.

The prompt is the longest common prefix of the two: whole leading messages for conversations;
for strings, cut at a word boundary so the completions keep their leading space (byte-level
BPE tokenisers spell " blue" as one token, and the policy would generate it that way).
"""

from plait.data.chat import is_conversational
from plait.data.prepare import DataFormat

from ._hooks import format_hooks


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _inside_word(text: str, n: int) -> bool:
    return 0 < n < len(text) and not text[n - 1].isspace() and not text[n].isspace()


def extract_prompt(row: dict) -> dict:
    chosen, rejected = row["chosen"], row["rejected"]
    if is_conversational(chosen) and is_conversational(rejected):
        n = _common_prefix(chosen, rejected)
        return {"prompt": list(chosen[:n]), "chosen": list(chosen[n:]), "rejected": list(rejected[n:])}
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = _common_prefix(chosen, rejected)
        while n > 0 and (_inside_word(chosen, n) or _inside_word(rejected, n)):
            n -= 1
        while n > 0 and chosen[n - 1].isspace():
            n -= 1
        return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}
    return {"prompt": "", "chosen": chosen, "rejected": rejected}  # validation names the problem


FORMAT = DataFormat(
    name="format.implicit_preference",
    kind="preference",
    shapes=(("chosen", "rejected"),),
    convert=extract_prompt,
    doc="Preference with implicit prompt: {chosen, rejected}; the common prefix becomes the prompt.",
)


register_data_formats, detect_data_format = format_hooks(FORMAT)
