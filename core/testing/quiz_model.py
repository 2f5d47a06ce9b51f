"""The tiny model taught the format of ``env.quiz`` episodes, for per-turn reward tests and benchmarks.

``quiz_model_path()`` trains the tiny model (:mod:`plait.testing.tiny_model`) for 80 steps on 32
three-turn quiz conversations (:data:`QUESTIONS`, each answered with a letter drawn at random from
:data:`LETTERS`). It then answers every question with one letter and EOS, each letter about a quarter
of the time: short model turns, so episodes run all their turns, and a policy that is right about a
quarter of the time per turn, which a learning test needs. Built once per cache, atomically, like
the tiny model (a few seconds on one thread).
"""

from __future__ import annotations

import pathlib
import random

from .tiny_model import BUILDER_VERSION, cached_build, tiny_model_path
from .tool_model import teach

VERSION = "1"
LETTERS = ("A", "B", "C", "D")
ANSWERS = ("B", "D", "A")  # the right letter of each turn, for a quiz row (see quiz_row)
QUESTIONS = tuple(f"Question {k + 1}: pick A, B, C or D." for k in range(len(ANSWERS)))


def quiz_row() -> dict:
    """An ``env.quiz`` dataset row: the first question as the prompt, the answers, the follow-up questions."""
    return {"prompt": [{"role": "user", "content": QUESTIONS[0]}], "answers": list(ANSWERS),
            "questions": list(QUESTIONS[1:])}


def build_quiz_model(directory, *, steps: int = 80, seed: int = 0) -> pathlib.Path:
    """Fine-tune the tiny model on quiz conversations with random letters (assistant tokens only) and save it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.data.chat import encode_with_assistant_mask

    base = tiny_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(base), AutoModelForCausalLM.from_pretrained(base)
    rng = random.Random(seed)
    rows = []
    for _ in range(32):
        conversation = []
        for question in QUESTIONS:
            conversation += [{"role": "user", "content": question},
                             {"role": "assistant", "content": rng.choice(LETTERS)}]
        rows.append(encode_with_assistant_mask(tokenizer, conversation))
    return teach(directory, tokenizer, model, rows, steps, seed)


def quiz_model_path() -> pathlib.Path:
    """The cached quiz-taught tiny model, built on first use (atomic, process-safe)."""
    return cached_build(f"tiny-quiz-model-{BUILDER_VERSION}-{VERSION}", build_quiz_model)
