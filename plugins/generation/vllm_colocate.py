"""``generation.vllm_colocate``: a vLLM engine inside the training process.

The engine is built once (at :meth:`start`) from the policy's folder and shares the device with
the trainer under ``gpu_memory_utilization``. Before each rollout that follows an optimizer
step the trainer calls :meth:`load_weights`: the policy's parameters (PEFT adapters merged for
the push, unmerged after; sharded parameters gathered one at a time) stream into the engine by
reference through vLLM's in-place reload, and the prefix cache is reset. Completions come back
with vLLM's per-token log-probs, which the trainer compares with its own to correct for the
engine's numerics (``vllm_importance_sampling_*``).

A plain LoRA policy with ``vllm_lora_sync=True`` (off by default: TRL always merges) instead reaches
an engine built from the frozen base weights with vLLM's LoRA support: each push saves only the
adapter, as a new version that the engine loads and generation then names (docs/vllm.md).

Its options (:class:`VLLMColocateParams`) are fields of every online method's Config as ``vllm_<option>``:
TRL's ``vllm_gpu_memory_utilization``, ``vllm_tensor_parallel_size``, ``vllm_max_model_length``,
``vllm_enable_sleep_mode``, ``vllm_model_impl``, and plait's ``vllm_dtype``, ``vllm_kv_cache_memory_bytes``,
``vllm_enable_prefix_caching``, ``vllm_enforce_eager``, ``vllm_engine_kwargs``, ``vllm_seed``, ``vllm_lora_sync``.
The class is published under the ``plait.generation_options`` entry-point group for that
(:func:`plait.engine.config.contributed_fields`).
``vllm_structured_outputs_regex`` reaches each request's sampling options.

On a CPU the engine runs its model eagerly for a short run and compiled (vLLM's torch.compile) for
a long one (:func:`compiles_on_cpu`): compiling made decoding 1.41x faster for SmolLM2-135M on two
cores (613 against 434 tokens/s, benchmarks/generation_speed.py) and cost 55 s more at start, which
a run planning fewer than :data:`COMPILE_AFTER_DECODE_STEPS` decode steps would not win back.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import ClassVar

import attrs

from plait import hookimpl
from plait.data.chat import tokenizer_of
from plait.errors import PlaitError
from plait.online.generation import (
    GenerationBackend,
    Generations,
    SamplingParams,
    backend_options,
    encode_prompts,
    eos_token_ids,
)
from plait.online.weights import (
    base_parameters,
    lora_rank,
    lora_unservable,
    materialised,
    payload_bytes,
    policy_parameters,
    save_adapter,
)
from plait.params import in_range

from ._vllm import (
    Engine,
    LoRASyncParams,
    lora_engine_options,
    on_cpu,
    refuse_quantized_merge,
    refuse_transformers_options,
)

NAME = "generation.vllm_colocate"
logger = logging.getLogger("plait")
# max_steps x max_completion_length from which a CPU run compiles the engine's model: compiling cost 55 s
# and saved ~11 ms per decode step (SmolLM2-135M, 32 sequences, 2 cores), so it pays after ~5,000 steps
COMPILE_AFTER_DECODE_STEPS = 8192


def _positive_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"vllm_{attribute.name}={value!r} must be an integer >= 1")


@attrs.frozen
class VLLMColocateParams(LoRASyncParams):
    """Engine options. ``dtype`` "auto" is vLLM's choice (bfloat16 for a float32 checkpoint on CPU);
    ``kv_cache_memory_bytes`` sizes the KV cache explicitly (CPU: instead of VLLM_CPU_KVCACHE_SPACE).
    A method config gives each as ``vllm_<name>``; ``lora_sync`` comes from :class:`~._vllm.LoRASyncParams`,
    which ``generation.vllm_server`` shares."""

    config_prefix: ClassVar[str] = "vllm_"
    field_help: ClassVar[dict[str, str]] = {
        "gpu_memory_utilization": "share of the GPU's memory the colocated vLLM engine may take",
        "tensor_parallel_size": "GPUs one vLLM engine spans",
        "max_model_length": "the engine's longest prompt + completion (null: the model's)",
        "dtype": "the engine's dtype ('auto': vLLM's choice)",
        "enable_sleep_mode": "free the engine's memory while the policy trains (GPU only)",
        "model_impl": "'auto', 'vllm' or 'transformers': whose implementation of the architecture vLLM runs",
        "kv_cache_memory_bytes": "size the engine's KV cache in bytes (CPU: instead of VLLM_CPU_KVCACHE_SPACE)",
        "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
        "enforce_eager": "run the engine's model uncompiled: faster start, slower decoding (null: compiled "
                         "on CPU from 8,192 decode steps)",
        "seed": "the engine's sampling seed (null: the run's seed)",
        "engine_kwargs": "more vllm.LLM keyword arguments",
    }
    gpu_memory_utilization: float = attrs.field(default=0.3, validator=in_range(0.0, 1.0, low_open=True))
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive_int)
    max_model_length: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive_int))
    dtype: str = "auto"
    enable_sleep_mode: bool = False
    model_impl: str = "auto"
    kv_cache_memory_bytes: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive_int))
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None  # None: on a CPU, compiles_on_cpu decides; elsewhere vLLM's default
    seed: int | None = None  # None: the run's seed
    engine_kwargs: dict = attrs.field(factory=dict)


class VLLMColocateBackend(GenerationBackend):
    """Samples with an in-process vLLM engine holding its own copy of the policy's weights."""

    shares_weights = False

    def __init__(self, model, processing_class, params: VLLMColocateParams | None = None):
        self.params = params or VLLMColocateParams()
        _check_sleep_mode(self.params)
        self.model, self.processing_class = model, processing_class
        self.eos_ids = eos_token_ids(processing_class, _unwrap(model))
        if not self.eos_ids:
            raise PlaitError("the tokenizer has no eos_token and the model's generation_config no eos_token_id; "
                             "set tokenizer.eos_token so completions can end")
        self.engine: Engine | None = None
        self.asleep = False
        self.push_seconds: list[float] = []  # how long each load_weights took
        self.push_bytes: list[int] = []  # the tensor bytes each load_weights sent
        # adapter-only sync: the engine serves the policy's LoRA adapter over the frozen base weights
        self.lora = self.params.lora_sync and lora_unservable(model) is None
        self.adapter_version = 0
        self.lora_request = None  # the adapter version generation uses
        self._folder: tempfile.TemporaryDirectory | None = None
        self._adapters: tempfile.TemporaryDirectory | None = None

    def start(self) -> None:
        if self.engine is not None:
            return
        if not self.lora:
            refuse_quantized_merge(_unwrap(self.model), "set vllm_lora_sync=True")
        p = self.params
        options = dict(dtype=p.dtype, max_model_len=p.max_model_length, gpu_memory_utilization=p.gpu_memory_utilization,
                       tensor_parallel_size=p.tensor_parallel_size, enable_sleep_mode=p.enable_sleep_mode,
                       model_impl=p.model_impl, enable_prefix_caching=p.enable_prefix_caching, seed=p.seed or 0,
                       skip_tokenizer_init=True)  # prompts arrive as ids and the trainer's tokenizer decodes
        if p.kv_cache_memory_bytes is not None:
            options["kv_cache_memory_bytes"] = p.kv_cache_memory_bytes
        if p.enforce_eager is not None:
            options["enforce_eager"] = p.enforce_eager
        if _distributed_world() > 1:
            options["distributed_executor_backend"] = "external_launcher"  # one engine per training process
        if self.lora:
            options.update(lora_engine_options(lora_rank(self.model)))
        self.engine = Engine(self._model_folder(), in_process=True, who=NAME, **{**options, **p.engine_kwargs})
        if self.lora:
            self._adapters = tempfile.TemporaryDirectory(prefix="plait-vllm-lora-")
            self._push_adapter(self.model)  # the engine generates with the policy's adapter from the first batch

    def _model_folder(self) -> str:
        """Where the engine loads the architecture and first weights from: the policy's own folder
        or hub id; a model built in memory is saved to a temporary folder first."""
        base = _unwrap(self.model)
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        source = getattr(base.config, "_name_or_path", "") or getattr(base, "name_or_path", "")
        if os.path.isfile(os.path.join(source, "config.json")) or (source and not os.path.exists(source)):
            return source  # a saved folder, or a hub id
        self._folder = tempfile.TemporaryDirectory(prefix="plait-vllm-")
        if self.lora:  # the frozen base weights; the adapter arrives on its own
            with base_parameters(self.model) as named:
                base.save_pretrained(self._folder.name, state_dict=dict(materialised(named)))
        else:
            with policy_parameters(self.model):  # adapters merged: the saved weights are the policy's
                base.save_pretrained(self._folder.name)
        return self._folder.name

    def generate(self, prompts, sampling: SamplingParams) -> Generations:
        self.start()
        if self.asleep:
            self.wake()
        prompt_ids = encode_prompts(self.processing_class, prompts)
        rows = self.engine.generate(prompt_ids, sampling, self.eos_ids, lora_request=self.lora_request)
        texts = tokenizer_of(self.processing_class).batch_decode(rows["completion_ids"], skip_special_tokens=True)
        return Generations(prompt_ids=rows["prompt_ids"], completion_ids=rows["completion_ids"], texts=texts,
                           finished=rows["finished"], logprobs=rows["logprobs"])

    def load_weights(self, model) -> None:
        self.start()
        if self.asleep:
            self.wake()
        if self.lora:
            self._push_adapter(model)
            return
        with policy_parameters(model) as named:
            self.push_bytes.append(payload_bytes(named))
            self.push_seconds.append(self.engine.load_weights(materialised(named)))

    def _push_adapter(self, model) -> None:
        """Save the adapter as a new version and load it into the engine; the previous version's
        files go once the new one is loaded."""
        start = time.perf_counter()
        self.adapter_version += 1
        folder = os.path.join(self._adapters.name, f"v{self.adapter_version}")
        self.push_bytes.append(save_adapter(model, folder))
        self.lora_request = self.engine.load_adapter(self.adapter_version, folder)
        self.push_seconds.append(time.perf_counter() - start)
        shutil.rmtree(os.path.join(self._adapters.name, f"v{self.adapter_version - 1}"), ignore_errors=True)

    def sleep(self) -> None:
        if self.params.enable_sleep_mode and self.engine is not None and not self.asleep:
            self.engine.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.engine.wake()
            self.asleep = False

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        for folder in (self._folder, self._adapters):
            if folder is not None:
                folder.cleanup()
        self._folder = self._adapters = None


def _unwrap(model):
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def _distributed_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_sleep_mode(params: VLLMColocateParams) -> None:
    if params.enable_sleep_mode and on_cpu():
        raise PlaitError("vllm_enable_sleep_mode=True is not supported by vLLM on CPU (it frees nothing and "
                         "blocks generation while asleep); set vllm_enable_sleep_mode=False")


def check_config(args) -> VLLMColocateParams:
    """The engine options a method config gives (its ``vllm_*`` fields), refusing what this backend cannot honour."""
    refuse_transformers_options(args, NAME)
    params = backend_options(VLLMColocateParams, args, NAME)
    _check_sleep_mode(params)
    return params


def planned_decode_steps(args) -> int | None:
    """``max_steps`` x ``max_completion_length`` of a method config: about the engine steps its rollouts
    take at most (one per new token, every optimizer step generating). None when the run is counted in
    epochs (the length is not known before the data is) or the config has no completion length."""
    steps = getattr(args, "max_steps", None)
    length = getattr(args, "max_completion_length", None) or getattr(args, "max_new_tokens", None)
    if not isinstance(steps, int) or steps <= 0 or not isinstance(length, int):
        return None
    return steps * length


def compiles_on_cpu(args) -> bool:
    """Does a CPU run compile the engine's model (``enforce_eager=False``)? Yes when it plans at least
    :data:`COMPILE_AFTER_DECODE_STEPS` decode steps (or is counted in epochs) and a C++ compiler is there
    for torch's inductor to build its kernels with; a short run, or no compiler, stays eager."""
    planned = planned_decode_steps(args)
    long_enough = planned is None or planned >= COMPILE_AFTER_DECODE_STEPS
    return long_enough and shutil.which(os.environ.get("CXX") or "g++") is not None  # inductor's own search


def vllm_colocate_backend(model, processing_class, args=None) -> VLLMColocateBackend:
    """Factory registered as ``generation.vllm_colocate``; options from the config's ``vllm_*`` fields."""
    params = check_config(args) if args is not None else VLLMColocateParams()
    if params.seed is None:
        params = attrs.evolve(params, seed=args.seed if isinstance(getattr(args, "seed", None), int) else 0)
    if params.enforce_eager is None and on_cpu():
        compiled = args is not None and compiles_on_cpu(args)
        params = attrs.evolve(params, enforce_eager=not compiled)
        if compiled:
            logger.info("vLLM colocate on CPU: compiling the engine's model (about a minute at start, then faster "
                        "decoding); vllm_enforce_eager=True starts at once")
    return VLLMColocateBackend(model, processing_class, params)


@hookimpl
def register_generation_backends(register):
    register(NAME, vllm_colocate_backend, params=VLLMColocateParams, check=check_config,
             doc="Sample with a vLLM engine inside the training process; weights pushed after each step")
