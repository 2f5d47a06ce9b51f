"""Process reward models (``plait prm`` folders) as reward functions: per-step scores, aggregated by name.

Answers ``resolve_reward`` for a ``…ForTokenClassification`` with two labels, loaded or as a
folder (checked before the sequence-classifier source, which would refuse it). A completion is
split into steps at the PRM's ``step_separator`` (the one recorded in its config by the PRM
trainer, else ``"\\n"``), laid out as in training (:mod:`plait.data.stepwise`), and each
step's score is the PRM's P(step is correct) at the end of its separator. The per-step scores
become one reward by an aggregation named in :data:`AGGREGATIONS`:

    min    the weakest step (Lightman et al. 2023, "Let's Verify Step by Step", §2.6 uses the product;
           min is the usual variant that does not penalise length, Wang et al. 2024 Math-Shepherd)
    last   the last step's score (how sure the PRM is of the final answer)
    mean   the average step score

A bare folder in ``reward_funcs`` aggregates with ``min``; :func:`process_reward_model` takes the
aggregation (and separator, batch size) as parameters, and the registered reward ``prm``
(``{name: prm, model: PATH, aggregation: last}``) does the same from a recipe. A completion
with no step text scores None.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Callable

import attrs
import torch

from plait import hookimpl
from plait.data.pretrained import pretrained_kwargs
from plait.data.stepwise import encode_steps, split_steps
from plait.errors import PlaitError
from plait.online.scoring import RewardFunction, completion_text

DEFAULT_SEPARATOR = "\n"
AGGREGATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "min": lambda scores: scores.min(),
    "last": lambda scores: scores[-1],
    "mean": lambda scores: scores.mean(),
}


def check_aggregation(name: str) -> str:
    if name not in AGGREGATIONS:
        match = difflib.get_close_matches(str(name), list(AGGREGATIONS), n=1)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise PlaitError(f"aggregation={name!r} is not known{hint}; use one of {', '.join(AGGREGATIONS)}")
    return name


def _check_token_classifier(architectures: list[str], num_labels: int, where: str) -> None:
    if not any(a.endswith("ForTokenClassification") for a in architectures):
        raise PlaitError(f"process reward model {where!r} is a {architectures}, not a …ForTokenClassification; "
                         "train one with `plait prm`")
    if num_labels != 2:
        raise PlaitError(f"process reward model {where!r} has num_labels={num_labels}; a PRM has two (step wrong, "
                         "step right)")


@attrs.define(eq=False)
class ProcessRewardScorer:
    """Scores prompt + completion with a PRM: one P(correct) per step, aggregated to one reward.

    ``path`` loads the model and tokenizer on the first call (``model``/``tokenizer`` given: used as they are)."""

    aggregation: str = attrs.field(default="min", validator=lambda i, a, v: check_aggregation(v))
    path: str | None = None
    model: Any = None
    tokenizer: Any = None
    step_separator: str | None = None
    batch_size: int = 8
    max_length: int | None = None
    _loading: dict = attrs.field(factory=pretrained_kwargs)  # the run's trust_remote_code, for the later load

    def _load(self) -> None:
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        if self.model is None:
            self.model = AutoModelForTokenClassification.from_pretrained(self.path, **self._loading)
        if self.tokenizer is None:
            source = self.path or self.model.config.name_or_path
            self.tokenizer = AutoTokenizer.from_pretrained(source, **self._loading)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.step_separator is None:
            self.step_separator = getattr(self.model.config, "step_separator", None) or DEFAULT_SEPARATOR
        self.model.eval()

    def step_scores(self, prompts: list, completions: list) -> list[torch.Tensor | None]:
        """P(step correct) for every step of every completion ([K_i] each; None without steps)."""
        if self.model is None or self.tokenizer is None:
            self._load()
        rows = []
        for prompt, completion in zip(prompts, completions):
            steps = split_steps(completion_text(completion), self.step_separator)
            rows.append(encode_steps(self.tokenizer, prompt, steps, self.step_separator, max_length=self.max_length)
                        if steps else None)
        scored = [i for i, row in enumerate(rows) if row is not None and any(p is not None for p in row[1])]
        out: list[torch.Tensor | None] = [None] * len(rows)
        device = next(self.model.parameters()).device
        pad_id = self.tokenizer.pad_token_id
        for start in range(0, len(scored), self.batch_size):
            chunk = scored[start:start + self.batch_size]
            width = max(len(rows[i][0]) for i in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, i in enumerate(chunk):
                ids[j, :len(rows[i][0])] = torch.tensor(rows[i][0])
                mask[j, :len(rows[i][0])] = 1
            with torch.inference_mode():
                probs = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().softmax(-1)
            for j, i in enumerate(chunk):
                positions = [p for p in rows[i][1] if p is not None]
                out[i] = probs[j, positions, 1].cpu()
        return out

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float | None]:
        aggregate = AGGREGATIONS[self.aggregation]
        return [None if s is None else float(aggregate(s)) for s in self.step_scores(prompts, completions)]


def _name(where: str) -> str:
    return os.path.basename(str(where).rstrip("/")) or "prm"


def process_reward_model(model: Any, tokenizer: Any = None, *, aggregation: str = "min",
                         step_separator: str | None = None, batch_size: int = 8,
                         max_length: int | None = None) -> RewardFunction:
    """A PRM as a reward function: ``model`` is a loaded token classifier or a folder / hub id
    (its config is checked now, its weights load when it first scores)."""
    check_aggregation(aggregation)
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        path = os.fspath(model)
        try:
            config = AutoConfig.from_pretrained(path, **pretrained_kwargs())
        except Exception as err:  # noqa: BLE001 - any loading failure means the same to the user
            first = (str(err).strip().splitlines() or [""])[0]
            raise PlaitError(f"process reward model {path!r} could not be loaded ({type(err).__name__}: {first}); "
                             "check the path") from err
        _check_token_classifier(config.architectures or [], config.num_labels, path)
        scorer = ProcessRewardScorer(aggregation, path=path, tokenizer=tokenizer, step_separator=step_separator,
                                     batch_size=batch_size, max_length=max_length)
        return RewardFunction(_name(path), scorer)
    where = model.config.name_or_path or type(model).__name__
    _check_token_classifier([type(model).__name__], model.config.num_labels, where)
    scorer = ProcessRewardScorer(aggregation, model=model, tokenizer=tokenizer, step_separator=step_separator,
                                 batch_size=batch_size, max_length=max_length)
    return RewardFunction(_name(where), scorer)


def _is_token_classifier_folder(spec: str) -> bool:
    config = os.path.join(spec, "config.json")
    if not os.path.isfile(config):
        return False
    import json

    with open(config, encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or []
    return any(a.endswith("ForTokenClassification") for a in architectures)


@hookimpl(tryfirst=True)
def resolve_reward(spec, processing_class):
    from transformers import PreTrainedModel

    tokenizer = getattr(processing_class, "tokenizer", None) or processing_class
    if isinstance(spec, PreTrainedModel) and type(spec).__name__.endswith("ForTokenClassification"):
        return process_reward_model(spec, tokenizer)
    if isinstance(spec, (str, os.PathLike)) and _is_token_classifier_folder(os.fspath(spec)):
        return process_reward_model(os.fspath(spec))  # the PRM's own tokenizer, saved with it
    return None
