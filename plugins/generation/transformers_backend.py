"""``generation.transformers``: sample with the training model itself through ``model.generate``.

No second copy of the weights and nothing to push after an optimizer step: the backend holds
the trainer's model and unwraps it at each call (DDP/accelerate wrappers share their module's
parameters; a PEFT model generates with its adapters on). Prompts are left-padded into one
batch (to a multiple of ``pad_to_multiple_of`` when set); each row stops at an EOS token, and the
tokens sampled after it (padding) are cut off, so completion ids come back without padding.
Dropout is off while sampling and the model's training mode is restored afterwards.

Its own Config fields (:class:`TransformersGenerationParams`): ``generation_max_batch_size``
(rows per ``generate`` call), ``cache_implementation`` (the KV cache ``generate`` builds, e.g.
"static"), ``pad_to_multiple_of``, and ``use_transformers_continuous_batching`` (or TRL's older
``use_transformers_paged``): then every prompt goes to transformers' continuous-batching engine
(``model.generate_batch``, a paged KV cache) with ``transformers_continuous_batching_config``; it also reads the
shared ``pad_to_multiple_of`` (:class:`plait.online.generation.GenerationChoice`). That
engine drops logits processors it does not support, so a ``repetition_penalty`` other than 1 is
refused with it; on CPU, where transformers would size its cache from the machine's whole memory,
the cache is sized for the call unless the config sizes it. Guided decoding
(``vllm_structured_outputs_regex``) is refused: ``generate`` has no regex constraint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import ClassVar

import attrs
import torch
from accelerate.utils import extract_model_from_parallel
from transformers import GenerationConfig

from plait import hookimpl
from plait.data.chat import tokenizer_of
from plait.data.vision import RowInputs, image_token_ids
from plait.engine.attention import SEQUENCE_SDPA
from plait.engine.layout import check_multiple, padded_length
from plait.errors import PlaitError
from plait.online.generation import (
    SAMPLING,
    GenerationBackend,
    Generations,
    SamplingParams,
    backend_options,
    encode_prompts,
    eos_token_ids,
)
from plait.params import int_at_least

NAME = "generation.transformers"


def _optional(validator):
    return attrs.validators.optional(validator)


@attrs.frozen
class TransformersGenerationParams:
    """This backend's options; each is a field of every online method's Config under its own name (TRL's),
    published under the ``plait.generation_options`` entry-point group. ``generation_max_batch_size`` bounds
    the rows of one ``generate`` call; ``cache_implementation`` is ``generate``'s KV cache (e.g. "static");
    ``use_transformers_continuous_batching`` (``use_transformers_paged``: TRL's older name) hands every prompt
    to transformers' continuous-batching engine with ``transformers_continuous_batching_config``;
    ``ds3_gather_for_generation`` is accepted for TRL's configs (DeepSpeed ZeRO-3 only)."""

    config_prefix: ClassVar[str] = ""
    field_help: ClassVar[dict[str, str]] = {
        "generation_max_batch_size": "most rows in one generate call (null: every row at once)",
        "cache_implementation": "the KV cache generate builds, e.g. 'static'",
        "use_transformers_continuous_batching": "sample through transformers' continuous-batching engine (paged KV cache)",
        "use_transformers_paged": "TRL's older name of use_transformers_continuous_batching",
        "transformers_continuous_batching_config": "ContinuousBatchingConfig options of that engine",
        "ds3_gather_for_generation": "kept for TRL's configs (DeepSpeed ZeRO-3 only)",
    }
    generation_max_batch_size: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    cache_implementation: str | None = attrs.field(default=None, validator=_optional(attrs.validators.min_len(1)))
    use_transformers_continuous_batching: bool = False
    use_transformers_paged: bool = False
    transformers_continuous_batching_config: dict | None = attrs.field(
        default=None, validator=_optional(attrs.validators.instance_of(dict)))
    ds3_gather_for_generation: bool = True

    @property
    def continuous_batching(self) -> dict | None:
        """The ``ContinuousBatchingConfig`` options when continuous batching is on, else None."""
        if self.use_transformers_continuous_batching or self.use_transformers_paged:
            return dict(self.transformers_continuous_batching_config or {})
        return None
CACHE_SIZE_FIELDS = ("num_blocks", "max_batch_tokens", "max_memory_percent")  # any of them: the user sizes the cache
logger = logging.getLogger("plait")


class TransformersBackend(GenerationBackend):
    """``model.generate`` on the policy; ``max_batch_size`` rows per call bound the KV cache.

    ``cache_implementation`` is passed to ``generate``; ``pad_to_multiple_of`` rounds the padded
    prompt width up; ``continuous_batching`` (a mapping, possibly empty, of
    ``ContinuousBatchingConfig`` options) samples through ``model.generate_batch`` instead.
    """

    shares_weights = True

    def __init__(self, model, processing_class, max_batch_size: int | None = None, *,
                 cache_implementation: str | None = None, pad_to_multiple_of: int | None = None,
                 continuous_batching: dict | None = None):
        self.model = model
        self.processing_class = processing_class
        self.max_batch_size = max_batch_size
        self.cache_implementation = cache_implementation
        self.pad_to_multiple_of = pad_to_multiple_of
        self.continuous_batching = continuous_batching
        tokenizer = tokenizer_of(processing_class)
        self.eos_ids = eos_token_ids(processing_class, extract_model_from_parallel(model))
        if not self.eos_ids:
            raise PlaitError("the tokenizer has no eos_token and the model's generation_config no eos_token_id; "
                             "set tokenizer.eos_token so completions can end")
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)

    def generation_config(self, sampling: SamplingParams, repeated: bool = False,
                          suppress: list[int] | None = None) -> GenerationConfig:
        greedy = sampling.temperature == 0
        options = dict(
            max_new_tokens=sampling.max_completion_length, do_sample=not greedy,
            # greedy decoding cannot return several sequences per row: rows are repeated instead
            num_return_sequences=1 if greedy or repeated else sampling.num_generations,
            repetition_penalty=sampling.repetition_penalty,
            pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids), use_cache=True,
        )
        if self.cache_implementation is not None:
            options["cache_implementation"] = self.cache_implementation
        if suppress:
            options["suppress_tokens"] = suppress
        if not greedy:
            # top_k must be given explicitly: transformers' default would silently apply top-50.
            options.update(temperature=sampling.temperature, top_p=sampling.top_p,
                           top_k=sampling.top_k or 0, min_p=sampling.min_p)
        return GenerationConfig(**{**options, **sampling.generation_kwargs})

    @torch.no_grad()
    def generate(self, prompts, sampling: SamplingParams, images: RowInputs | None = None) -> Generations:
        """``images``: a VLM's per-prompt image inputs (:class:`plait.data.vision.RowInputs`), one row per prompt."""
        if sampling.structured_outputs_regex is not None:
            raise PlaitError(_no_regex(sampling.structured_outputs_regex))
        prompt_ids = encode_prompts(self.processing_class, prompts)
        model = extract_model_from_parallel(self.model)
        rows: list[list[int]] = []
        was_training = model.training
        model.eval()
        try:
            if self.continuous_batching is not None:  # the engine schedules every prompt itself
                if images is not None:
                    raise PlaitError("transformers' continuous batching cannot pass images to the model; set "
                                     "use_transformers_continuous_batching=False for image prompts")
                rows = self._generate_continuous(model, prompt_ids, sampling)
            else:
                size = self.max_batch_size or len(prompt_ids)
                for start in range(0, len(prompt_ids), size):
                    part = None if images is None else images.select(slice(start, start + size))
                    rows.extend(self._generate(model, prompt_ids[start:start + size], sampling, part))
        finally:
            model.train(was_training)
        completions, finished = [], []
        for row in rows:
            end = next((t for t, token in enumerate(row) if token in self.eos_ids), None)
            finished.append(end is not None)
            completions.append(row if end is None else row[: end + 1])
        texts = tokenizer_of(self.processing_class).batch_decode(completions, skip_special_tokens=True)
        repeated = [ids for ids in prompt_ids for _ in range(sampling.num_generations)]
        return Generations(prompt_ids=repeated, completion_ids=completions, texts=texts, finished=finished)

    def _generate(self, model, prompt_ids: list[list[int]], sampling: SamplingParams,
                  images: RowInputs | None = None) -> list[list[int]]:
        # Image rows are repeated here too: generate() would repeat each image, not each row's images.
        repeated = sampling.temperature == 0 or images is not None
        if repeated:
            order = [i for i in range(len(prompt_ids)) for _ in range(sampling.num_generations)]
            prompt_ids = [prompt_ids[i] for i in order]
        device = next(model.parameters()).device
        width = padded_length(max(len(ids) for ids in prompt_ids), self.pad_to_multiple_of)
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompt_ids):  # left padding: every row's next token is at the same column
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        extra, suppress = {}, None
        if images is not None:  # pixel_values etc.; the model never samples an image token itself
            extra, suppress = images.select(order).kwargs(device, input_ids.to(device)), sorted(image_token_ids(self.processing_class))
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=self.generation_config(sampling, repeated, suppress), **extra)
        return out[:, width:].tolist()

    def _generate_continuous(self, model, prompt_ids: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Every prompt through ``model.generate_batch``; rows come back grouped by prompt."""
        from transformers.generation import ContinuousBatchingConfig

        if sampling.temperature == 0:
            prompt_ids = [ids for ids in prompt_ids for _ in range(sampling.num_generations)]
        config = self.generation_config(sampling)
        options = dict(self.continuous_batching)
        device = next(model.parameters()).device
        if device.type == "cpu" and not any(options.get(name) is not None for name in CACHE_SIZE_FIELDS):
            options.update(_cpu_cache_size(prompt_ids, config, options.get("page_size")))
        with _as_the_engine_runs_it(model, device):
            outputs = model.generate_batch(prompt_ids, generation_config=config, progress_bar=False,
                                           continuous_batching_config=ContinuousBatchingConfig(**options))
        expected = len(prompt_ids) * config.num_return_sequences
        failed = [out.error for out in outputs.values() if out.error is not None]
        if failed or len(outputs) != expected:
            raise PlaitError(f"transformers' continuous batching returned {len(outputs) - len(failed)} of {expected} "
                             f"completions ({failed[0] if failed else 'some requests are missing'}); set "
                             "use_transformers_continuous_batching=False or size transformers_continuous_batching_config")
        return [list(out.generated_tokens) for out in outputs.values()]


@contextlib.contextmanager
def _as_the_engine_runs_it(model, device: torch.device):
    """The policy as transformers' continuous-batching engine can run it, for one call: on ``sdpa`` where a
    trainer put it on ``plait_sdpa`` (which is ``sdpa`` for every batch the engine builds, but which the
    engine refuses by name), and in its weights' dtype without autocast: the engine's paged cache takes the
    weights' dtype, and bf16 keys written into a float32 cache fail every request. accelerate's autocast
    wrapper of ``forward`` is set aside for the call and put back, so training keeps its mixed precision."""
    implementation = model.config._attn_implementation
    wrapper = model.__dict__.get("forward") if "_original_forward" in model.__dict__ else None
    if implementation == SEQUENCE_SDPA:
        model.set_attn_implementation("sdpa")
    if wrapper is not None:
        model.forward = model.__dict__["_original_forward"]
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        if wrapper is not None:
            model.forward = wrapper
        if implementation == SEQUENCE_SDPA:
            model.set_attn_implementation(SEQUENCE_SDPA)


def _cpu_cache_size(prompt_ids: list[list[int]], config: GenerationConfig, page_size: int | None) -> dict:
    """A paged cache that holds every request of one call at once (transformers would otherwise
    size it from the machine's whole memory, which takes seconds to allocate on a CPU)."""
    from transformers.generation import ContinuousBatchingConfig

    page = page_size or ContinuousBatchingConfig().page_size
    copies = config.num_return_sequences
    blocks = sum(math.ceil((len(ids) + config.max_new_tokens) / page) for ids in prompt_ids) * copies
    tokens = sum(len(ids) for ids in prompt_ids) * copies
    return {"num_blocks": blocks + 1, "max_batch_tokens": max(page, min(tokens, 4096))}


def _no_regex(regex: str) -> str:
    return (f"vllm_structured_outputs_regex={regex!r}: generation.transformers cannot constrain completions to a "
            "regex; use a vLLM backend (use_vllm=True) or drop vllm_structured_outputs_regex")


def check_config(args) -> TransformersGenerationParams:
    """This backend's options from a method config, refusing, before any model loads, what it cannot honour."""
    options = backend_options(TransformersGenerationParams, args, NAME)
    p = getattr(args, "params", args)
    regex = getattr(p, "vllm_structured_outputs_regex", None)
    if regex is not None:
        raise PlaitError(_no_regex(regex))
    if options.cache_implementation is not None:
        try:
            GenerationConfig(cache_implementation=options.cache_implementation)
        except ValueError as err:
            raise PlaitError(f"cache_implementation={options.cache_implementation!r}: {str(err).splitlines()[0]}") from None
    if options.continuous_batching is not None:
        from transformers.generation import ContinuousBatchingConfig

        if getattr(p, "repetition_penalty", 1.0) != 1.0:
            raise PlaitError(f"repetition_penalty={p.repetition_penalty} is not applied by transformers' continuous "
                             "batching (it drops that logits processor); set repetition_penalty=1.0 or "
                             "use_transformers_continuous_batching=False")
        try:
            ContinuousBatchingConfig(**options.continuous_batching)
        except (TypeError, ValueError) as err:
            raise PlaitError(f"transformers_continuous_batching_config={options.transformers_continuous_batching_config!r}: "
                             f"{str(err).splitlines()[0]}") from None
    if options.use_transformers_paged:
        _warn_paged_once()
    return options


@functools.cache
def _warn_paged_once() -> None:
    logger.warning("plait: use_transformers_paged is TRL's deprecated name for use_transformers_continuous_batching; "
                   "continuous batching is on")


def transformers_backend(model, processing_class, args=None) -> TransformersBackend:
    """Factory registered as ``generation.transformers``; options from the config's fields when given."""
    if args is None:
        return TransformersBackend(model, processing_class)
    options = check_config(args)
    device = next(extract_model_from_parallel(model).parameters()).device
    return TransformersBackend(
        model, processing_class, options.generation_max_batch_size, cache_implementation=options.cache_implementation,
        pad_to_multiple_of=check_multiple(getattr(getattr(args, "params", args), "pad_to_multiple_of", None), device.type),
        continuous_batching=options.continuous_batching,
    )


transformers_backend.default_for = SAMPLING  # a config naming no backend gets this one (resolve_backend)


@hookimpl
def register_generation_backends(register):
    register(NAME, transformers_backend, params=TransformersGenerationParams, check=check_config, images=True,
             doc="Sample with the policy itself via model.generate (no weight copies)")
