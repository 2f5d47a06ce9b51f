"""Sequence-classification reward models as reward functions.

Answers ``resolve_reward`` for a loaded ``PreTrainedModel`` whose class is a
``…ForSequenceClassification`` with one label, and for a string naming one: a local folder or a
hub id (``org/name``). ``processing_class``, when given (TRL's ``reward_processing_classes``),
is the reward model's tokenizer; otherwise the one saved with the model is loaded. The model scores the prompt followed by the completion, rendered with its
own tokenizer's chat template when the prompt is a conversation, and its single logit is the
reward. As in Ouyang et al. 2022, "Training language models to follow instructions with human
feedback" (InstructGPT), §3.5: the reward model reads the whole exchange and returns a scalar.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch

from plait import hookimpl
from plait.data.pretrained import pretrained_kwargs
from plait.errors import PlaitError
from plait.online.scoring import RewardFunction, completion_text


def _is_conversation(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in value)


@attrs.frozen(eq=False)
class RewardModelScorer:
    """Calls a sequence classifier on prompt + completion, ``batch_size`` texts at a time."""

    model: Any
    tokenizer: Any
    batch_size: int = 8
    max_length: int | None = None

    @property
    def processing_class(self) -> Any:
        """The tokenizer it scores with (TRL's ``reward_processing_classes`` entry)."""
        return self.tokenizer

    def text(self, prompt: Any, completion: Any) -> tuple[str, bool]:
        """The text to score, and whether it already holds the template's special tokens."""
        if _is_conversation(prompt):
            messages = list(completion) if _is_conversation(completion) else [
                {"role": "assistant", "content": completion_text(completion)}]
            return self.tokenizer.apply_chat_template(list(prompt) + messages, tokenize=False), True
        # The data layer ends a string completion with EOS when a reward model trains: score alike.
        return str(prompt) + completion_text(completion) + (self.tokenizer.eos_token or ""), False

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = texts[start : start + self.batch_size]
            batch = self.tokenizer(
                [t for t, _ in chunk], padding=True, truncation=self.max_length is not None,
                max_length=self.max_length, add_special_tokens=not chunk[0][1], return_tensors="pt",
            ).to(device)
            logits = self.model(**batch).logits
            scores += logits[:, 0].float().tolist()
        return scores


def _check_classifier(architectures: list[str], num_labels: int, where: str, kind: str) -> None:
    """A reward model is a …ForSequenceClassification with one output; ``kind`` names what was found."""
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise PlaitError(f"reward model {where!r} is a {kind}, not a …ForSequenceClassification; "
                         "train one with the reward method or pick a reward-model checkpoint")
    if num_labels != 1:
        raise PlaitError(f"reward model {where!r} has num_labels={num_labels}; a reward model has one "
                         "output (num_labels=1)")


def reward_model_function(model: Any, tokenizer: Any = None, *, batch_size: int = 8) -> RewardFunction:
    """Wrap a loaded sequence classifier (and its tokenizer, else loaded from its folder)."""
    where = model.config.name_or_path or type(model).__name__
    _check_classifier([type(model).__name__], model.config.num_labels, where, type(model).__name__)
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model.config.name_or_path, **pretrained_kwargs())
        except Exception as err:  # noqa: BLE001 - any loading failure means the same to the user
            raise PlaitError(f"reward model {where!r}: no tokenizer could be loaded from its name_or_path "
                             f"({type(err).__name__}); pass the model's folder instead") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:  # the classifier reads the last non-pad token
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    name = os.path.basename(str(where).rstrip("/")) or "reward_model"
    return RewardFunction(name, RewardModelScorer(model, tokenizer, batch_size))


def _looks_like_model(spec: str) -> bool:
    if os.path.isdir(spec):
        return True
    if spec.startswith(("/", "./", "../", "~")):
        raise PlaitError(f"reward model folder {spec!r} does not exist; check the path")
    # a hub id "org/name": registry names and import paths never contain a slash
    return spec.count("/") == 1 and ":" not in spec


@attrs.define(eq=False)
class DeferredRewardModel:
    """A reward-model folder checked now (its config) and loaded when it first scores.

    Resolving a recipe's rewards happens in ``--check`` and before the policy loads, so it reads
    only config.json; the weights and tokenizer load on the first call, which a training run makes
    at its first rollout.
    """

    path: str
    tokenizer: Any = None
    _scorer: RewardModelScorer | None = None
    _loading: dict = attrs.field(factory=pretrained_kwargs)  # the run's trust_remote_code, for the later load

    @property
    def processing_class(self) -> Any:
        """The tokenizer it scores with (TRL's ``reward_processing_classes`` entry): the one given, else its
        folder's, loaded on first use."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.path, **self._loading)
        return self.tokenizer

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        if self._scorer is None:
            from transformers import AutoModelForSequenceClassification

            model = AutoModelForSequenceClassification.from_pretrained(self.path, **self._loading)
            self._scorer = reward_model_function(model, self.processing_class).fn
        return self._scorer(prompts, completions, **kwargs)


def load_reward_model(path: str, tokenizer: Any = None) -> RewardFunction:
    """A sequence-classification reward model (and its tokenizer unless given) from a folder or hub id:
    its config is checked now, its weights load when it first scores (:class:`DeferredRewardModel`)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, **pretrained_kwargs())
    except Exception as err:  # noqa: BLE001 - any loading failure means the same to the user
        first = (str(err).strip().splitlines() or [""])[0]
        raise PlaitError(f"reward model {path!r} could not be loaded ({type(err).__name__}: {first}); check the path") from err
    # a causal-LM checkpoint would load with a randomly initialised score head on top
    architectures = config.architectures or []
    _check_classifier(architectures, config.num_labels, path, f"{architectures or config.model_type} checkpoint")
    name = os.path.basename(path.rstrip("/")) or "reward_model"
    return RewardFunction(name, DeferredRewardModel(path, tokenizer))


@hookimpl
def resolve_reward(spec, processing_class):
    from accelerate.utils import is_peft_model
    from transformers import PreTrainedModel

    tokenizer = getattr(processing_class, "tokenizer", None) or processing_class
    # a PeftModelForSequenceClassification (TRL takes one) scores through its adapters like a plain classifier
    if isinstance(spec, PreTrainedModel) or isinstance(spec, torch.nn.Module) and is_peft_model(spec):
        return reward_model_function(spec, tokenizer)
    if isinstance(spec, (str, os.PathLike)) and _looks_like_model(os.fspath(spec)):
        return load_reward_model(os.fspath(spec), tokenizer)
    return None
