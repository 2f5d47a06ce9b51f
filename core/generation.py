"""The generation-backend hook: how online methods (GRPO, RLOO) sample completions.

A backend turns prompts (token ids, or conversations it renders with the chat template) and
:class:`SamplingParams` into :class:`Generations`: completion token ids without padding, their
texts, and per-token log-probs where the backend computes them anyway (vLLM does; a backend
that samples with the trainer's own weights need not). Backends holding their own copy of the
weights (an inference engine) receive the policy after every optimizer step through
``load_weights``; all backends share a start / sleep / wake / close lifecycle so a method can
free an engine's memory while it trains.

Backends register under ``register_generation_backends`` with a factory
``(model, processing_class, args) -> GenerationBackend``; a method picks one by name
(``generation.transformers``, ``generation.vllm_colocate``) and never imports it.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping, Sequence

import attrs

from .chat import encode, is_conversational, render_prompt, tokenizer_of
from .errors import PlaitError
from .params import in_range, positive

__all__ = ["GenerationBackend", "Generations", "SamplingParams", "encode_prompts"]


def _optional(validator):
    return attrs.validators.optional(validator)


def _non_negative_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name}={value!r} must be an integer >= 0 (0 disables it)")


def _positive_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name}={value!r} must be an integer >= 1")


@attrs.frozen
class SamplingParams:
    """How to sample; names follow TRL's GRPOConfig.

    ``temperature`` 0 means greedy decoding. ``top_k`` 0 or None and ``min_p`` None disable those
    filters. ``num_generations`` completions are drawn per prompt and returned grouped: all
    completions of prompt 0, then prompt 1, ... ``generation_kwargs`` go to the backend as they
    are (for options this class does not name).
    """

    max_completion_length: int = attrs.field(default=256, validator=_positive_int)
    temperature: float = attrs.field(default=1.0, validator=in_range(0.0, float("inf"), high_open=True))
    top_p: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))
    top_k: int | None = attrs.field(default=None, validator=_optional(_non_negative_int))
    min_p: float | None = attrs.field(default=None, validator=_optional(in_range(0.0, 1.0)))
    repetition_penalty: float = attrs.field(default=1.0, validator=positive)
    num_generations: int = attrs.field(default=1, validator=_positive_int)
    generation_kwargs: dict = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class Generations:
    """Completions of N = len(prompts) × num_generations rows, grouped by prompt.

    ``prompt_ids[i]`` is the prompt row i was sampled from (as the backend tokenised it);
    ``completion_ids[i]`` holds the sampled tokens without padding, ending with the EOS token when
    the model stopped on its own (``finished[i]``) and cut at ``max_completion_length`` otherwise.
    ``logprobs[i][t]`` is the sampler's log-prob of ``completion_ids[i][t]``, or ``logprobs`` is
    None when the backend does not report them.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    finished: list[bool]
    logprobs: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)


class GenerationBackend(abc.ABC):
    """Samples completions for an online method. Subclasses implement :meth:`generate`.

    ``shares_weights`` is True for backends that sample with the training model itself (nothing to
    push after an optimizer step); engines that hold a copy set it False and implement
    :meth:`load_weights`. The lifecycle methods are no-ops by default.
    """

    shares_weights: bool = True

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[Sequence[Mapping[str, Any]]],
                 sampling: SamplingParams) -> Generations:
        """Sample ``sampling.num_generations`` completions for each prompt (token ids or messages)."""

    def load_weights(self, model) -> None:
        """Copy the policy's current weights into the backend (engines with their own copy)."""

    def start(self) -> None:
        """Acquire resources (start an engine, connect to a server)."""

    def sleep(self) -> None:
        """Release memory between rollouts (the policy trains meanwhile)."""

    def wake(self) -> None:
        """Undo :meth:`sleep` before the next :meth:`generate`."""

    def close(self) -> None:
        """Release everything; the backend is not used again."""

    def __enter__(self) -> "GenerationBackend":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def encode_prompts(processing_class, prompts: Sequence[Any]) -> list[list[int]]:
    """Token ids of each prompt: ids pass through, strings are tokenised (with the tokenizer's
    own special tokens, e.g. BOS), conversations are rendered with the generation prompt."""
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(encode(processing_class, prompt, special_tokens=True))
        elif is_conversational(prompt) and prompt and isinstance(prompt[0], Mapping):
            out.append(encode(processing_class, render_prompt(processing_class, list(prompt)), special_tokens=False))
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            out.append(list(prompt))
        else:
            raise PlaitError(f"prompt {i} is a {type(prompt).__name__}; pass token ids, a string or a list of "
                             "{'role', 'content'} messages")
        if not out[-1]:
            raise PlaitError(f"prompt {i} is empty after tokenisation; every prompt needs at least one token")
    return out


def eos_token_ids(processing_class, model=None) -> set[int]:
    """Every token id that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = set()
    eos = getattr(tokenizer_of(processing_class), "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, (list, tuple)):
        ids.update(int(i) for i in config_eos)
    return ids
