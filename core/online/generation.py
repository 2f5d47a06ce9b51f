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
import functools
import logging
from typing import Any, ClassVar, Mapping, Sequence

import attrs

from plait.data.chat import encode, is_conversational, render_prompt, tokenizer_of
from plait.errors import PlaitError
from plait.params import in_range, one_of, positive

__all__ = ["GenerationBackend", "GenerationChoice", "Generations", "SamplingParams", "encode_prompts"]

logger = logging.getLogger("plait")


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
    completions of prompt 0, then prompt 1, ... ``structured_outputs_regex`` constrains every
    completion to match the regex (guided decoding; backends that cannot honour it refuse it).
    ``generation_kwargs`` go to the backend as they are (for options this class does not name).
    """

    max_completion_length: int = attrs.field(default=256, validator=_positive_int)
    temperature: float = attrs.field(default=1.0, validator=in_range(0.0, float("inf"), high_open=True))
    top_p: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))
    top_k: int | None = attrs.field(default=None, validator=_optional(_non_negative_int))
    min_p: float | None = attrs.field(default=None, validator=_optional(in_range(0.0, 1.0)))
    repetition_penalty: float = attrs.field(default=1.0, validator=positive)
    num_generations: int = attrs.field(default=1, validator=_positive_int)
    structured_outputs_regex: str | None = None
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


# ---------------------------------------------------------------------------------------------
# The generation fields of a method's config
# ---------------------------------------------------------------------------------------------

# TRL names the backend with use_vllm and vllm_mode: its mode -> the registered backend it means
TRL_VLLM_MODES = {"colocate": "vllm_colocate", "server": "vllm_server"}
SAMPLING = "sampling"  # the role of the backend used when a config chooses none


def _optional_int_at_least(low: int):
    def check(instance, attribute, value) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{attribute.name}={value!r} must be an integer >= {low} or None")

    return check


def _optional_text(instance, attribute, value) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{attribute.name}={value!r} must be a non-empty string or None")


def _optional_dict(instance, attribute, value) -> None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{attribute.name}={value!r} must be a mapping (e.g. {{enable_thinking: false}}) or None")


def _padding_multiple_value(value):
    """TRL's accepted spellings: "auto", an integer (also as text, as a command line gives it), or None ("none")."""
    if isinstance(value, str) and value != "auto":
        if value.strip().lower() in ("none", "null"):
            return None
        if value.strip().isdigit():
            return int(value)
    return value


def _padding_multiple(instance, attribute, value) -> None:
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name}={value!r} must be an integer >= 1, 'auto' or None")




@functools.cache
def _warn_hub_repo_once(repo: str) -> None:
    logger.warning("plait: log_completions_hub_repo=%r is kept but nothing is pushed to the Hub (plait runs offline); "
                   "the completions table is printed and sent to wandb when report_to includes it", repo)


@attrs.define(slots=False)  # a mixin beside LossChoice/RewardChoice: two slotted bases cannot mix
class GenerationChoice:
    """How a method that learns from its own samples generates them (GRPO, RLOO, distillation, PPO),
    and how it logs them; TRL 1.16's names, meanings and defaults (GRPOConfig, RLOOConfig,
    DistillationConfig) unless docs/trl-differences.md says otherwise.

    The backend is one registered ``generation.<name>`` plugin, chosen by :meth:`backend_name`:
    ``generation_backend`` (plait's general name) when given, else TRL's ``use_vllm`` with
    ``vllm_mode`` ("colocate" → ``generation.vllm_colocate``, "server" → ``generation.vllm_server``),
    else the backend registered as the default for ``sampling`` (plait's: ``generation.transformers``). Each backend reads the fields it honours from the config and
    refuses, when the trainer is validated (before any model loads), those it cannot honour:

    * sampling (every backend): ``top_p``, ``top_k`` (0 = no top-k), ``min_p``, ``repetition_penalty``,
      ``generation_kwargs``, ``vllm_structured_outputs_regex`` (guided decoding);
    * prompts: ``chat_template_kwargs`` reach ``apply_chat_template`` when conversational prompts
      are rendered (e.g. ``{"enable_thinking": False}``); ``pad_to_multiple_of`` pads prompts (left)
      and completions (right) to a multiple, in generation and in training tensors ("auto": 128 on
      AWS Neuron, none elsewhere);
    * each backend's own fields, declared by its options class and added to the Config from there
      (:attr:`plugin_options_group`): the transformers backend's ``cache_implementation``,
      ``use_transformers_continuous_batching`` ... (``TransformersGenerationParams``), the vLLM backends'
      ``vllm_*`` engine and server fields (``VLLMColocateParams``, ``VLLMServerParams``; docs/vllm.md).
      A third-party backend's options become Config fields, YAML keys and flags the same way;
    * ``max_tool_calling_iterations``: how many times generation continues after tool results
      (:mod:`plait.online.rollouts`; None: until the length budget ends);
    * completion logs: ``log_completions`` prints (and sends to wandb) a table of each rollout's
      completions, ``num_completions_to_print`` rows of it, one row per prompt with
      ``log_unique_prompts``; ``log_multimodal`` and ``log_completions_hub_repo`` are kept (plait's
      methods are text-only, and the Hub is not written to: a warning says so).
    """

    # Fields of one backend (vllm_gpu_memory_utilization, vllm_server_port ...) are that backend's: its options
    # class, published under this entry-point group, adds them to every Config (plait.engine.config.contributed_fields).
    plugin_options_group: ClassVar[str] = "plait.generation_options"
    field_help: ClassVar[dict[str, str]] = {
        "top_p": "nucleus sampling: keep the smallest set of tokens whose probabilities sum to top_p",
        "top_k": "sample among the k most likely tokens (0 or null: no top-k filter)",
        "min_p": "drop tokens less likely than min_p times the most likely one (null: off)",
        "repetition_penalty": "divide the logits of tokens already present by this (1.0: off)",
        "generation_kwargs": "extra options handed as they are to the generation backend",
        "vllm_structured_outputs_regex": "guided decoding: every completion matches this regex",
        "chat_template_kwargs": "keyword arguments for apply_chat_template, e.g. {enable_thinking: false}",
        "pad_to_multiple_of": "pad prompts and completions to a multiple of this ('auto': 128 on AWS Neuron only)",
        "generation_backend": "the registered backend that samples (transformers, vllm_colocate, vllm_server, ...)",
        "use_vllm": "sample with vLLM (TRL's switch; vllm_mode picks the engine's place)",
        "vllm_mode": "with use_vllm: 'colocate' (an engine in this process) or 'server' (plait vllm-serve)",
        "max_tool_calling_iterations": "times generation resumes after tool results (null: until the length budget ends)",
        "log_completions": "print (and send to wandb) a table of each rollout's completions",
        "num_completions_to_print": "rows of the completions table printed (null: all)",
        "log_unique_prompts": "one row per prompt in the completions table",
        "log_multimodal": "kept for TRL's configs (plait's completion tables are text)",
        "log_completions_hub_repo": "kept for TRL's configs; nothing is pushed to the Hub",
    }
    # sampling
    top_p: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))
    top_k: int | None = attrs.field(default=0, validator=_optional_int_at_least(0))
    min_p: float | None = attrs.field(default=None, validator=attrs.validators.optional(in_range(0.0, 1.0)))
    repetition_penalty: float = attrs.field(default=1.0, validator=positive)
    generation_kwargs: dict | None = attrs.field(default=None, validator=_optional_dict)
    # guided decoding, honoured by every backend that can (TRL's name: vLLM was its only backend with it)
    vllm_structured_outputs_regex: str | None = attrs.field(default=None, validator=_optional_text)
    # prompts
    chat_template_kwargs: dict | None = attrs.field(default=None, validator=_optional_dict)
    pad_to_multiple_of: int | str | None = attrs.field(default="auto", converter=_padding_multiple_value,
                                                       validator=_padding_multiple)
    # the backend
    generation_backend: str | None = attrs.field(default=None, validator=_optional_text)
    use_vllm: bool = False
    vllm_mode: str = attrs.field(default="colocate", validator=one_of(tuple(TRL_VLLM_MODES)))
    # tool calling
    max_tool_calling_iterations: int | None = attrs.field(default=None, validator=_optional_int_at_least(1))
    # completion logs
    log_completions: bool = False
    num_completions_to_print: int | None = attrs.field(default=None, validator=_optional_int_at_least(1))
    log_unique_prompts: bool = False
    log_multimodal: bool = True
    log_completions_hub_repo: str | None = attrs.field(default=None, validator=_optional_text)

    def __attrs_post_init__(self) -> None:
        backend = self.generation_backend
        if self.use_vllm and backend is not None and _short(backend) != TRL_VLLM_MODES[self.vllm_mode]:
            raise PlaitError(f"generation_backend={backend!r} conflicts with use_vllm=True (vllm_mode={self.vllm_mode!r} "
                             f"means {TRL_VLLM_MODES[self.vllm_mode]!r}); give generation_backend or use_vllm, not both")
        if self.log_completions_hub_repo is not None:
            if not self.log_completions:
                raise PlaitError(f"log_completions_hub_repo={self.log_completions_hub_repo!r} is set but log_completions "
                                 "is False; set log_completions=True or drop log_completions_hub_repo")
            _warn_hub_repo_once(self.log_completions_hub_repo)
        after = getattr(super(), "__attrs_post_init__", None)
        if after is not None:
            after()

    def backend_name(self) -> str | None:
        """The registered generation backend these fields choose (the one place they are resolved);
        None when they choose none: :func:`resolve_backend` then takes the default for ``sampling``."""
        if self.generation_backend is not None:
            return self.generation_backend
        return TRL_VLLM_MODES[self.vllm_mode] if self.use_vllm else None

    def sampling(self, max_completion_length: int | None = None, temperature: float | None = None) -> SamplingParams:
        """The :class:`SamplingParams` of one rollout; the length and temperature default to the
        params' own ``max_completion_length`` and ``temperature``."""
        return SamplingParams(
            max_completion_length=self.max_completion_length if max_completion_length is None else max_completion_length,
            temperature=self.temperature if temperature is None else temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            structured_outputs_regex=self.vllm_structured_outputs_regex,
            generation_kwargs=dict(self.generation_kwargs or {}),
        )


def _short(name: str) -> str:
    return name.removeprefix("generation.")


def resolve_backend(plugins, args):
    """The registered backend a method config chooses, with its own check of the config run now
    (before any model loads): a backend's ``check(args)`` option refuses what it cannot honour.
    A config that names no backend gets the one a plugin registered with ``default_for="sampling"``."""
    name, backends = args.params.backend_name(), plugins.generation_backends
    component = (backends.default(SAMPLING, "sampling completions when a config names no backend") if name is None
                 else backends.get(name, family="generation"))
    if component.options.check is not None:
        component.options.check(args)
    return component


def backend_options(params_class, args, who: str):
    """A backend's attrs options from a method config's ``<prefix><option>`` fields (the class's
    ``config_prefix``, e.g. ``vllm_``: ``vllm_gpu_memory_utilization`` -> ``gpu_memory_utilization``);
    fields the config lacks, or leaves None, keep the class's defaults. Errors name the backend."""
    prefix = getattr(params_class, "config_prefix", "")
    source = getattr(args, "params", args)
    values = {}
    for field in attrs.fields(params_class):
        for holder in (source, args):
            value = getattr(holder, f"{prefix}{field.name}", None)
            if value is not None:
                values[field.name] = value
                break
    try:
        return params_class(**values)
    except (TypeError, ValueError) as err:
        raise PlaitError(f"{who}: {err}") from None
