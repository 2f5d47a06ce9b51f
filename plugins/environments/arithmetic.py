"""``env.arithmetic``: a multi-turn arithmetic task with the calculator tool.

Each dataset row has a ``prompt`` (the question) and an ``answer`` column. The model may call the
calculator (its results are inserted as tool turns); a turn without a tool call is an attempt:
the last number in it is compared with the answer. A wrong attempt gets a user reply ("not
right, try again") while ``attempts`` remain. The episode's reward is 1 for a right first
attempt, 1/k for a right k-th attempt, 0 otherwise.
"""

from __future__ import annotations

import re

import attrs

from plait import hookimpl
from plait.online.rollouts import Step, ToolEnvironment
from plait.online.tools import resolve_tools

from .calculator import calculator

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


@attrs.define
class ArithmeticParams:
    attempts: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))


class ArithmeticEnvironment(ToolEnvironment):
    def __init__(self, params: ArithmeticParams):
        super().__init__(resolve_tools([calculator]), params.timeout)
        self.attempts_left = params.attempts
        self.attempt = 0
        self.solved_at: int | None = None
        self.answer: float | None = None

    def reset(self, row):
        if "answer" not in row:
            raise KeyError("env.arithmetic needs an 'answer' column beside the prompt")
        self.answer = float(row["answer"])
        return row["prompt"]

    def step(self, text, calls):
        if calls:
            return super().step(text, calls)
        self.attempt += 1
        guess = last_number(text)
        if guess is not None and abs(guess - self.answer) < 1e-6:
            self.solved_at = self.attempt
            return Step(done=True)
        if self.attempt >= self.attempts_left:
            return Step(done=True)
        return Step([{"role": "user", "content": "That is not right, try again."}], done=False)

    def reward(self) -> float:
        return 0.0 if self.solved_at is None else 1.0 / self.solved_at


@hookimpl
def register_environments(register):
    register("env.arithmetic", ArithmeticEnvironment, params=ArithmeticParams,
             doc="Arithmetic questions with the calculator tool; reward 1/k for a right k-th attempt")


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """A reward for tool-using episodes: 1.0 when the last number of the final answer equals the
    ``answer`` column, else 0.0 (give it by import path, ``plait.plugins.environments.arithmetic:correct_answer``)."""
    from plait.online.scoring import completion_text

    out = []
    for completion, gold in zip(completions, answer):
        guess = last_number(completion_text(completion))
        out.append(float(guess is not None and abs(guess - float(gold)) < 1e-6))
    return out
