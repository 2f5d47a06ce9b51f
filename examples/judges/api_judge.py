"""A judge behind a chat-completions API, as a third-party plait plugin (an example: not installed).

plait's own judges run locally (``judge.reward_model``, ``judge.rules``, ``judge.pairwise``); a
judge that calls a hosted model is a plugin of the same ``register_judges`` hook, in its own
package. This module is one: it registers ``judge.api_pairwise``, which sends the pairwise
template of :mod:`plait.plugins.judges.pairwise` to any OpenAI-compatible ``/chat/completions``
endpoint and reads "0" or "1" from the answer (anything else: a tie, -1). To ship it, put it in a
package and declare it in that package's ``pyproject.toml``::

    [project.entry-points.plait]
    api_judge = "my_judges.api_judge"

then name it in a recipe (the key is read from the environment, never from the recipe)::

    training:
      judge: {name: api_pairwise, base_url: "https://api.example.com/v1", model: judge-large}

Only the standard library is used (``urllib``); the request body and the parsing of an answer
are plain functions, which is what its tests exercise without any network.
"""

from __future__ import annotations

import json
import os
import random
import urllib.request
from typing import Any, Sequence

import attrs

from plait import PlaitError, hookimpl
from plait.online.scoring import completion_text
from plait.online.chassis import prompt_text
from plait.plugins.judges.pairwise import TEMPLATE, parse_choice


@attrs.define
class ApiJudgeParams:
    base_url: str
    model: str
    api_key_env: str = "OPENAI_API_KEY"  # the environment variable holding the key
    template: str = TEMPLATE
    shuffle_order: bool = True
    seed: int = 0
    timeout: float = 60.0


@attrs.define(eq=False)
class ApiPairwiseJudge:
    params: ApiJudgeParams
    _random: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._random = random.Random(self.params.seed)

    def body(self, prompt: Any, first: Any, second: Any) -> dict:
        """The JSON body asking which of ``first`` (0) and ``second`` (1) answers ``prompt`` better."""
        text = self.params.template.format(prompt=prompt_text(prompt), response0=completion_text(first),
                                           response1=completion_text(second))
        return {"model": self.params.model, "messages": [{"role": "user", "content": text}],
                "max_tokens": 4, "temperature": 0}

    @staticmethod
    def answer(response: dict) -> int:
        """0, 1 or -1 from a chat-completions response."""
        choices = response.get("choices") or [{}]
        return parse_choice((choices[0].get("message") or {}).get("content") or "")

    def post(self, body: dict) -> dict:
        key = os.environ.get(self.params.api_key_env)
        if not key:
            raise PlaitError(f"judge.api_pairwise: the environment variable {self.params.api_key_env} holds no API key; "
                             "export it, or set api_key_env to the variable that does")
        request = urllib.request.Request(self.params.base_url.rstrip("/") + "/chat/completions",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.params.timeout) as reply:
            return json.load(reply)

    def __call__(self, prompts: Sequence[Any], completion_pairs: Sequence[Sequence[Any]]) -> list[int]:
        out = []
        for prompt, (first, second) in zip(prompts, completion_pairs, strict=True):
            swap = self.params.shuffle_order and self._random.random() < 0.5
            choice = self.answer(self.post(self.body(prompt, *((second, first) if swap else (first, second)))))
            out.append(choice if choice < 0 or not swap else 1 - choice)
        return out


def api_judge(params: ApiJudgeParams, plugins=None) -> ApiPairwiseJudge:
    return ApiPairwiseJudge(params)


@hookimpl
def register_judges(register):
    register("judge.api_pairwise", api_judge, params=ApiJudgeParams,
             doc="Asks an OpenAI-compatible chat-completions API which of two answers is better")
