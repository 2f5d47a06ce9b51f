"""Stepwise-supervision rows as token ids: what a process reward model reads, and where each step is scored.

Not a plugin (underscore): shared by the PRM method (``plugins/methods/prm.py``, training rows) and
the PRM reward source (``plugins/reward_sources/process_reward_models.py``, scoring completions),
so a PRM is scored on exactly the layout it was trained on. The layout is TRL's PRMTrainer's:

    [bos] + prompt + step_1 + separator + step_2 + separator + … + step_K + separator

each piece tokenised on its own (no special tokens; a conversational prompt is rendered with the
chat template and its generation prompt, and gets no extra bos). Step k is read at the last token
of the separator that follows it. Truncation, as TRL: the prompt keeps its last
``max_prompt_length`` tokens, the steps their first ``max_completion_length``, then the whole
sequence its first ``max_length``; a step whose separator is cut off has no position.
"""

from __future__ import annotations

from typing import Any, Sequence

from plait.errors import PlaitError

from .chat import is_conversational, tokenizer_of


def separator_ids(processing_class: Any, separator: str) -> list[int]:
    ids = tokenizer_of(processing_class)(separator, add_special_tokens=False)["input_ids"]
    if not ids:
        raise PlaitError(f"step_separator={separator!r} tokenises to no tokens; use a separator the tokenizer "
                         "keeps, e.g. '\\n'")
    return ids


def prompt_ids(processing_class: Any, prompt: Any) -> list[int]:
    tokenizer = tokenizer_of(processing_class)
    if is_conversational(prompt):
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def encode_steps(processing_class: Any, prompt: Any, steps: Sequence[str], separator: str, *,
                 max_prompt_length: int | None = None, max_completion_length: int | None = None,
                 max_length: int | None = None) -> tuple[list[int], list[int | None]]:
    """``(input_ids, positions)``: ``positions[k]`` indexes the last separator token after step k in
    ``input_ids``, or is None when truncation removed it."""
    tokenizer = tokenizer_of(processing_class)
    sep = separator_ids(processing_class, separator)
    head = prompt_ids(processing_class, prompt)
    if max_prompt_length is not None:
        head = head[-max_prompt_length:]
    tail: list[int] = []
    ends: list[int] = []
    for step in steps:
        tail += tokenizer(step, add_special_tokens=False)["input_ids"] + sep
        ends.append(len(tail) - 1)
    if max_completion_length is not None:
        tail = tail[:max_completion_length]
    ids = head + tail
    if max_length is not None:
        ids = ids[:max_length]
    positions = [len(head) + end if len(head) + end < len(ids) else None for end in ends]
    return ids, positions


def split_steps(text: str, separator: str) -> list[str]:
    """A completion's steps: the text between separators, empty pieces dropped."""
    return [step for step in text.split(separator) if step.strip()]
