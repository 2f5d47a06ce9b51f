"""``judge.pairwise``: a local generative model is asked which of two answers is better.

The ``template`` (``{prompt}``, ``{response0}``, ``{response1}``) is filled per pair, sent as one
user message when the judge's tokenizer has a chat template (as plain text otherwise), and the
judge model answers greedily through a registered generation backend (``backend``, by name:
``transformers`` by default). The first non-blank character of its answer decides: "0" for the
first answer, "1" for the second; anything else is a tie (-1). With ``shuffle_order`` each pair is
shown in a random (seeded) order and the answer mapped back, so a judge that always names the same
position does not always favour the same completion::

    judge: {name: pairwise, model: ~/.cache/plait/SmolLM2-135M-Instruct}

The model loads at the first call (on ``device``: None is the first GPU when there is one).
A judge behind an API is a third-party plugin of the same hook; see ``examples/judges/api_judge.py``.
"""

from __future__ import annotations

import os
import random
from typing import Any, Sequence

import attrs

from plait import PlaitError, hookimpl
from plait.data.chat import has_chat_template
from plait.online.generation import SamplingParams, encode_prompts
from plait.online.scoring import completion_text
from plait.online.chassis import prompt_text

TEMPLATE = """Two answers to the same request follow. Decide which one answers it better: more helpful, \
correct and clear. Reply with a single digit, 0 for the first answer or 1 for the second.

Request:
{prompt}

Answer 0:
{response0}

Answer 1:
{response1}

Better answer:"""


def _has_fields(instance, attribute, value) -> None:
    for field in ("{prompt}", "{response0}", "{response1}"):
        if field not in value:
            raise ValueError(f"template lacks {field}; it must hold {{prompt}}, {{response0}} and {{response1}}")


@attrs.define
class PairwiseParams:
    model: Any  # a folder, a hub id, or a loaded causal LM
    processing_class: Any = None  # its tokenizer (None: the one saved with it)
    template: str = attrs.field(default=TEMPLATE, validator=_has_fields)
    backend: str = "transformers"  # a registered generation backend
    max_new_tokens: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    shuffle_order: bool = True
    seed: int = 0
    device: str | None = None


def parse_choice(text: str) -> int:
    """0 or 1 from the judge's answer (its first non-blank character), else -1."""
    first = text.strip()[:1]
    return int(first) if first in ("0", "1") else -1


@attrs.define(eq=False)
class PairwiseJudge:
    params: PairwiseParams
    plugins: Any
    backend_component: Any
    _backend: Any = None
    _tokenizer: Any = None
    _random: random.Random = attrs.field(init=False)
    swaps: list[bool] = attrs.field(init=False, factory=list)  # the last call's order (for inspection)

    def __attrs_post_init__(self) -> None:
        self._random = random.Random(self.params.seed)

    def _start(self) -> None:
        import torch

        from plait.data.tokenizer import load_tokenizer
        from plait.engine.models import load_model

        p = self.params
        source = os.path.expanduser(p.model) if isinstance(p.model, str) else p.model
        model = load_model(source, field="judge.model", default_dtype="auto")  # scores only
        self._tokenizer = load_tokenizer(source, p.processing_class, field="judge.model")
        device = p.device or ("cuda" if torch.cuda.is_available() else None)
        if device is not None:
            model = model.to(device)
        model.eval()
        self._backend = self.backend_component.obj(model, self._tokenizer, None)
        self._backend.start()

    def requests(self, prompts: Sequence[Any], completion_pairs: Sequence[Sequence[Any]]) -> list:
        """The filled template of each pair (in the order shown, see ``swaps``), as messages or text."""
        self.swaps = [self.params.shuffle_order and self._random.random() < 0.5 for _ in completion_pairs]
        chat = has_chat_template(self._tokenizer) if self._tokenizer is not None else False
        out = []
        for prompt, pair, swap in zip(prompts, completion_pairs, self.swaps, strict=True):
            if len(pair) != 2:
                raise PlaitError(f"judge.pairwise compares pairs; got {len(pair)} completions for one prompt")
            first, second = (pair[1], pair[0]) if swap else (pair[0], pair[1])
            text = self.params.template.format(prompt=prompt_text(prompt), response0=completion_text(first),
                                               response1=completion_text(second))
            out.append([{"role": "user", "content": text}] if chat else text)
        return out

    def __call__(self, prompts: Sequence[Any], completion_pairs: Sequence[Sequence[Any]]) -> list[int]:
        if self._backend is None:
            self._start()
        requests = self.requests(prompts, completion_pairs)
        sampling = SamplingParams(max_completion_length=self.params.max_new_tokens, temperature=0.0)
        out = self._backend.generate(encode_prompts(self._tokenizer, requests), sampling)
        choices = [parse_choice(text) for text in out.texts]
        return [c if c < 0 or not swap else 1 - c for c, swap in zip(choices, self.swaps)]


def pairwise_judge(params: PairwiseParams, plugins=None) -> PairwiseJudge:
    if plugins is None:
        from plait.manager import default_plugins

        plugins = default_plugins()
    from plait.data.preflight import model_source

    model_source(params.model, "judge.model")  # a missing folder fails now, before the policy loads
    backend = plugins.generation_backends.get(params.backend, family="generation")  # unknown names fail now
    return PairwiseJudge(params, plugins, backend)


@hookimpl
def register_judges(register):
    register("judge.pairwise", pairwise_judge, params=PairwiseParams,
             doc="Asks a local generative model which of two answers is better (parses '0'/'1'; else tie)")
