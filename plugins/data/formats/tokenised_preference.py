"""Pre-tokenised preference data: ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` or ``{"chosen_ids",
"rejected_ids"}`` (TRL 1.16's reward-model rows: whole sequences), lists of token ids used as given.

With no ``prompt_ids`` the prompt is the ids the two sequences begin with alike, each completion keeping
at least its last token, as :mod:`.implicit_preference` reads text rows: a reward model scores the same
whole sequences, and the tokens both share cancel in a DPO margin. Ids are used as given: no chat template,
no EOS appended; ``max_length`` still truncates them.
"""

from plait.data.prepare import DataFormat

from ._hooks import format_hooks


def _shared_start(chosen: list[int], rejected: list[int]) -> int:
    n, most = 0, min(len(chosen), len(rejected)) - 1
    while n < most and chosen[n] == rejected[n]:
        n += 1
    return max(n, 0)


def _canonical(row: dict) -> dict:
    chosen, rejected = list(row["chosen_ids"] or []), list(row["rejected_ids"] or [])
    if "prompt_ids" in row:
        return {"prompt": list(row["prompt_ids"] or []), "chosen": chosen, "rejected": rejected}
    n = _shared_start(chosen, rejected)
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


FORMAT = DataFormat(
    name="format.tokenised_preference",
    kind="preference",
    shapes=(("chosen_ids", "rejected_ids"),),  # prompt_ids beside them: read by _canonical
    convert=_canonical,
    doc="Pre-tokenised preference: {prompt_ids, chosen_ids, rejected_ids} or whole sequences {chosen_ids, rejected_ids}.",
)

register_data_formats, detect_data_format = format_hooks(FORMAT, tryfirst=True)
