"""math-verify behind one door: the optional import, gold parsing and answer checking.

Not a plugin (the leading underscore): the accuracy-style rewards share it. math-verify is the
``math`` extra; a reward that needs it fails when it is resolved, naming the install command.
"""

from __future__ import annotations

import threading
from typing import Any

from plait.errors import PlaitError


def require_math_verify(reward: str):
    """Import math_verify, or fail with the command that installs it."""
    try:
        import math_verify
    except ImportError as err:
        raise PlaitError(
            f"reward {reward!r} needs math-verify, which is not installed; run: pip install 'plait[math]'"
        ) from err
    return math_verify


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    return 5 if threading.current_thread() is threading.main_thread() else None


def parse_gold(solution: Any, reward: str) -> list:
    """The parsed gold answer; an empty list when math-verify finds no answer in it."""
    mv = require_math_verify(reward)
    return mv.parse(str(solution), extraction_mode="first_match", parsing_timeout=_timeout())


def is_correct(gold: list, text: str, reward: str) -> bool:
    """Does the first answer in ``text`` (a \\boxed{} answer before anything else) equal ``gold``?"""
    mv = require_math_verify(reward)
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    answer = mv.parse(text, extraction_config=config, extraction_mode="first_match", parsing_timeout=_timeout())
    return bool(mv.verify(gold, answer, timeout_seconds=_timeout()))


def column_of(kwargs: dict, column: str, reward: str) -> list:
    """The dataset column a reward reads (``solution``), or a one-line error naming it."""
    if column not in kwargs:
        extra = sorted(k for k in kwargs if k not in ("prompts", "completions", "completion_ids", "trainer_state"))
        raise PlaitError(
            f"reward {reward!r} needs a dataset column {column!r} with the gold answers (columns given: "
            f"{extra}); add it, or name the column with {{name: {reward}, column: ...}}"
        )
    return kwargs[column]


def accuracy_of(solution: Any, text: str, reward: str) -> float | None:
    """1.0 / 0.0 for a correct / wrong answer; None when the gold solution has no parsable answer."""
    gold = parse_gold(solution, reward)
    if not gold:
        return None
    return 1.0 if is_correct(gold, text, reward) else 0.0
