"""``env.quiz``: questions asked one model turn at a time, each turn rewarded as soon as it is answered.

A dataset row has a ``prompt`` (the first question, messages or text) and ``answers``, one per
question (or a single ``answer``); ``questions`` (optional) are the follow-up questions, asked as
user turns after each answer (``"Next question."`` where missing). A turn is right when the last
word of the model's reply is that question's answer (case and punctuation aside). The episode ends
after the last question.

``per_turn=True`` (the default) rewards each right turn at once with ``Step(reward=1/n)`` for n
questions, and the episode with 0 at its end; ``per_turn=False`` gives the same points only at the
end, as ``reward()`` = (right turns)/n: the same episodes with an end-of-episode reward, for a
turn-level estimator (``advantage.turn_return``) against an episode-level one (``advantage.group``).
"""

from __future__ import annotations

import re

import attrs

from plait import hookimpl
from plait.online.rollouts import Environment, Step

_WORD = re.compile(r"[\w.+-]+")


def last_word(text: str) -> str | None:
    """The last word of a reply, lower-cased and without surrounding punctuation (None: no word)."""
    words = [w.strip(".+-") for w in _WORD.findall(text)]
    words = [w for w in words if w]
    return words[-1].lower() if words else None


def _normal(answer) -> str:
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    return str(answer).strip().strip(".").lower()


@attrs.define
class QuizParams:
    per_turn: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))


class QuizEnvironment(Environment):
    def __init__(self, params: QuizParams):
        self.per_turn = params.per_turn
        self.answers: list[str] = []
        self.questions: list[str] = []
        self.turn, self.right = -1, 0

    def reset(self, row):
        if "answers" not in row and "answer" not in row:
            raise KeyError("env.quiz needs an 'answers' column (one answer per question) beside the prompt")
        answers = row["answers"] if "answers" in row else [row["answer"]]
        self.answers = [_normal(a) for a in answers]
        follow = list(row.get("questions") or [])
        self.questions = [follow[k] if k < len(follow) else "Next question." for k in range(len(answers) - 1)]
        return row["prompt"]

    def step(self, text, calls):
        self.turn += 1
        turn = self.turn
        right = last_word(text) == self.answers[turn]
        self.right += right
        reward = (float(right) / len(self.answers)) if self.per_turn else None
        if turn + 1 >= len(self.answers):
            return Step(done=True, reward=reward)
        return Step([{"role": "user", "content": self.questions[turn]}], done=False, reward=reward)

    def reward(self) -> float:
        return 0.0 if self.per_turn else self.right / len(self.answers)


@hookimpl
def register_environments(register):
    register("env.quiz", QuizEnvironment, params=QuizParams,
             doc="Questions one turn at a time; per-turn rewards for right answers (or one at the end)")
