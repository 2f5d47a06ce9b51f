"""env.guess_number: a multi-turn environment from a third-party package.

The model guesses a secret number (the row's ``secret`` column, 1..100); after each wrong guess
the environment replies "higher" or "lower" as a user turn, for up to ``max_guesses`` guesses.
The reward is 1 for a right guess, shrinking by ``1 / max_guesses`` per extra guess, else 0.
Environments subclass plait.online.rollouts.Environment and register through ``register_environments``.
"""

import re

import attrs

from plait import hookimpl
from plait.online.rollouts import Environment, Step


@attrs.frozen
class GuessParams:
    max_guesses: int = attrs.field(default=3, validator=attrs.validators.ge(1))


class GuessNumber(Environment):
    def __init__(self, params: GuessParams):
        self.max_turns = params.max_guesses
        self.guesses = 0
        self.won = False
        self.secret = 0

    def reset(self, row):
        self.secret = int(row.get("secret", 42))
        return [{"role": "user", "content": "Guess my number between 1 and 100."}]

    def step(self, text, calls):
        self.guesses += 1
        numbers = re.findall(r"\d+", text)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.secret:
            self.won = True
            return Step(done=True)
        hint = "No number there. Guess again." if guess is None else ("Higher." if guess < self.secret else "Lower.")
        return Step([{"role": "user", "content": hint}], done=self.guesses >= self.max_turns)

    def reward(self):
        return 0.0 if not self.won else 1.0 - (self.guesses - 1) / self.max_turns


@hookimpl
def register_environments(register):
    register("env.guess_number", GuessNumber, params=GuessParams,
             doc="Guess a secret number with higher/lower hints (example third-party environment)")
