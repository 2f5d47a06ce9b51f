"""math-verify behind one door: the optional import, gold parsing and answer checking.

Not a plugin (the leading underscore): the accuracy-style rewards share it. math-verify is the
``math`` extra; a reward that needs it fails when it is resolved, naming the install command.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import attrs

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


def parse_gold(solution: Any, reward: str, latex_only: bool = False) -> list:
    """The parsed gold answer; an empty list when math-verify finds no answer in it.

    ``latex_only`` parses as TRL 1.16 does (math-verify's defaults, every match), plait's own
    rule takes the first answer found."""
    mv = require_math_verify(reward)
    mode = "any_match" if latex_only else "first_match"
    return mv.parse(str(solution), extraction_mode=mode, parsing_timeout=_timeout())


def parse_answer(text: str, reward: str, latex_only: bool = False) -> list:
    """The first answer in ``text``: a ``\\boxed{}`` answer before anything else.

    plait accepts LaTeX or a plain expression ("the answer is 7"). ``latex_only`` is TRL 1.16's
    rule: only a boxed or anchored LaTeX answer counts, with units normalised away."""
    mv = require_math_verify(reward)
    if latex_only:
        from latex2sympy2_extended import NormalizationConfig

        config = [mv.LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                           boxed_match_priority=0, try_extract_without_anchor=False)]
    else:
        config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return mv.parse(text, extraction_config=config, extraction_mode="first_match", parsing_timeout=_timeout())


def judge(solution: Any, text: str, reward: str, latex_only: bool = False) -> tuple[float | None, str, str]:
    """(score, gold as parsed, answer as parsed): the score is 1.0 / 0.0 for a correct / wrong
    answer and None when the gold solution has no parsable answer; the parsed texts are what
    TRL's ``log_extra`` shows beside each completion."""
    gold = parse_gold(solution, reward, latex_only)
    if not gold:
        return None, "[unparseable]", "[skipped]"
    answer = parse_answer(text, reward, latex_only)
    mv = require_math_verify(reward)
    score = 1.0 if mv.verify(gold, answer, timeout_seconds=_timeout()) else 0.0
    return score, str(gold), str(answer) if answer else "[unparseable]"


def column_of(kwargs: dict, column: str, reward: str) -> list:
    """The dataset column a reward reads (``solution``), or a one-line error naming it."""
    if column not in kwargs:
        from plait.online.scoring import RESERVED

        extra = sorted(k for k in kwargs if k not in RESERVED)
        raise PlaitError(
            f"reward {reward!r} needs a dataset column {column!r} with the gold answers (columns given: "
            f"{extra}); add it, or name the column with {{name: {reward}, column: ...}}"
        )
    return kwargs[column]


def accuracy_of(solution: Any, text: str, reward: str, latex_only: bool = False) -> float | None:
    """1.0 / 0.0 for a correct / wrong answer; None when the gold solution has no parsable answer."""
    return judge(solution, text, reward, latex_only)[0]


def log_judgements(log_extra, solution: list, judgements: list[tuple[float | None, str, str]]) -> None:
    """Hand TRL's ``log_extra`` the columns its completions table shows beside each completion."""
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", [gold for _, gold, _ in judgements])
        log_extra("answer_parsed", [answer for _, _, answer in judgements])


@attrs.frozen
class NoParameters:
    """The parameters of a TRL-named reward function registered by name: none."""


def checked_when_resolved(fn: Callable, name: str) -> Callable[[NoParameters], Callable]:
    """A factory for registering ``fn`` under ``name`` that checks math-verify when the run is
    configured (``plait grpo --check``), not at the first reward call."""

    def make(params: NoParameters) -> Callable:
        require_math_verify(name)
        return fn

    return make
