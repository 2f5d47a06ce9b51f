"""``generation.vllm_server``: sample from a ``plait vllm-serve`` process over HTTP.

The server owns its devices; the trainer is a client. :class:`VLLMClient` waits for the server
to answer ``/health`` (up to ``server_timeout`` seconds, then an error naming host and port),
gives every other request ``server_request_timeout`` seconds (then an error saying the server
did not answer), retries idempotent calls on connection errors and any call the server turned
away at its connection limit (503), and pushes weights over a side channel: the server's engine
workers and the trainer form a process group of their own (gloo on CPU, NCCL on GPU), keyed under
a random prefix sent only in the authenticated join request, and the trainer broadcasts the
parameters in flat buckets, never inside an HTTP body. The trainer needs no vLLM installed.

A plain LoRA policy with ``vllm_lora_sync=True`` reaches a server started with ``--enable-lora``
as its adapter alone: each sync saves the PEFT adapter (adapter_config.json and
adapter_model.safetensors, a few MB) and posts both files to ``/load_adapter``, where it becomes the
next LoRA version the server generates with. The client checks at connect time that the server
serves LoRA adapters of the policy's rank, and pushes the adapter then, so the first rollout
already uses it (docs/vllm.md).

Every request carries the server's token: ``vllm_server_token``, else the file
``vllm_server_token_file``, else PLAIT_VLLM_TOKEN, else (for a server on loopback) the file a
``plait vllm-serve`` on this machine generated for its port (:func:`~._vllm.token_path`).

Its options (:class:`VLLMServerParams`, published under the ``plait.generation_options`` entry-point group) are
fields of every online method's Config as ``vllm_<option>``; TRL's names: ``vllm_server_base_url``,
``vllm_server_host``, ``vllm_server_port``, ``vllm_server_timeout``, ``vllm_group_port``, and
plait's ``vllm_server_token``, ``vllm_server_token_file``, ``vllm_server_request_timeout`` and
``vllm_lora_sync`` (shared with ``generation.vllm_colocate``: :class:`~._vllm.LoRASyncParams`);
``vllm_structured_outputs_regex`` travels with each request's sampling options.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http import HTTPStatus
from pathlib import Path
from typing import Any, ClassVar, Iterator, Sequence

import attrs
import torch

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
    adapter_parameters,
    lora_rank,
    lora_unservable,
    materialised,
    payload_bytes,
    policy_parameters,
    save_adapter,
)
from plait.params import positive

from ._vllm import (
    ADAPTER_FILES,
    TOKEN_ENV,
    WEIGHT_DTYPES,
    LoRASyncParams,
    bucket_layout,
    is_loopback,
    read_token,
    refuse_quantized_merge,
    refuse_transformers_options,
    send_buckets,
    session_prefix,
    token_path,
    weight_group,
)

NAME = "generation.vllm_server"
RETRY_DELAYS = (0.5, 1.0, 2.0)  # between tries of an idempotent call
# Seconds any request may wait for its answer: a generate of a large batch of long completions
# takes minutes; a server that has not answered in half an hour is hung, and saying so beats waiting.
REQUEST_TIMEOUT = 1800.0


def _port(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"vllm_{attribute.name}={value!r} must be a port number (1-65535)")


@attrs.frozen
class VLLMServerParams(LoRASyncParams):
    """Where the server is and how long to wait for it, and whether a LoRA policy syncs as its adapter
    alone (``lora_sync``, :class:`~._vllm.LoRASyncParams`); a method config gives each as ``vllm_<name>``."""

    config_prefix: ClassVar[str] = "vllm_"
    field_help: ClassVar[dict[str, str]] = {
        "server_base_url": "the plait vllm-serve server's URL, e.g. http://10.0.0.5:8000 (else host and port)",
        "server_host": "the server's host",
        "server_port": "the server's port",
        "server_timeout": "seconds to wait for the server's /health",
        "group_port": "port of the weight-sync store on the server",
        "server_token": "the server's token (else server_token_file or PLAIT_VLLM_TOKEN)",
        "server_token_file": "a file holding the server's token (mode 0600)",
        "server_request_timeout": "seconds one request may take before the server counts as hung",
    }
    server_base_url: str | None = None  # e.g. http://10.0.0.5:8000; else host and port
    server_host: str = "127.0.0.1"
    server_port: int = attrs.field(default=8000, validator=_port)
    server_timeout: float = attrs.field(default=240.0, validator=positive)  # seconds to wait for /health
    group_port: int = attrs.field(default=51216, validator=_port)  # the weight-sync store on the server
    server_token: str | None = None
    server_token_file: str | None = None  # a file holding the token (yours alone: mode 0600)
    server_request_timeout: float = attrs.field(default=REQUEST_TIMEOUT, validator=positive)  # seconds per request


class VLLMClient:
    """A client of ``plait vllm-serve``: health, generate, weight updates, prefix-cache reset."""

    def __init__(self, base_url: str | None = None, host: str = "127.0.0.1", port: int = 8000, *,
                 group_port: int = 51216, token: str | None = None, token_file: str | None = None,
                 connection_timeout: float = 240.0, request_timeout: float = REQUEST_TIMEOUT):
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        parsed = urllib.parse.urlsplit(self.base_url)
        self.host, self.port = parsed.hostname or host, parsed.port or port
        self.group_port, self.connection_timeout, self.request_timeout = group_port, connection_timeout, request_timeout
        self.token, self.token_file = token, token_file
        self.local = is_loopback(self.host)  # only then may a token file of this machine's server be sent to it
        self.group = None
        self.rank = None
        self.push_seconds: list[float] = []
        self.sent_bytes: list[int] = []  # what each push carried: bucket bytes over the side channel, or the body
        self._send_buffers: dict | None = None  # CPU pushes fill one kept buffer (send_buckets)
        self.max_body_bytes: int | None = None  # the server's, from /health

    # -- plumbing -----------------------------------------------------------------------------
    def credentials(self) -> tuple[str | None, str]:
        """The token to send and where it came from. Files are read at each request: the server
        may write its token after this client is made, or restart with a new one."""
        if self.token:
            return self.token, "vllm_server_token"
        if self.token_file:
            return read_token(self.token_file), f"vllm_server_token_file {self.token_file}"
        if os.environ.get(TOKEN_ENV):
            return os.environ[TOKEN_ENV], TOKEN_ENV
        generated = token_path(self.port)
        if self.local and generated.exists():
            return read_token(generated), str(generated)
        return None, (f"no token: no vllm_server_token, vllm_server_token_file or {TOKEN_ENV}"
                      + (f", and no {generated}" if self.local else ""))

    def _request(self, method: str, route: str, body: Any = None, *, idempotent: bool = True,
                 timeout: float | None = None) -> dict:
        """One call, answered within ``timeout`` seconds (default ``request_timeout``)."""
        timeout = self.request_timeout if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        if data is not None and self.max_body_bytes is not None and len(data) > self.max_body_bytes:
            # said here: the server refuses such a body unread, and a client still sending sees a reset
            raise PlaitError(f"{method} {route} would send {len(data)} bytes to the vLLM server at {self.base_url}, "
                             f"over its limit of {self.max_body_bytes}; raise it (plait vllm-serve --max-body-bytes) "
                             "or generate from fewer prompts at a time")
        token, source = self.credentials()
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        for delay in (*RETRY_DELAYS, None):
            request = urllib.request.Request(self.base_url + route, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    return json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as err:
                if err.code == HTTPStatus.SERVICE_UNAVAILABLE and delay is not None:
                    time.sleep(delay)  # turned away unread at the connection limit: any call may try again
                    continue
                try:
                    message = json.loads(err.read()).get("error", err.reason)
                except ValueError:
                    message = err.reason
                sent = f" (this client's token: {source})" if err.code == HTTPStatus.UNAUTHORIZED else ""
                raise PlaitError(f"vLLM server at {self.base_url} refused {method} {route} "
                                 f"({err.code}): {message}{sent}") from None
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as err:
                reason = getattr(err, "reason", err)
                if isinstance(reason, TimeoutError):  # busy or hung: trying again would only wait again
                    raise PlaitError(f"vLLM server at {self.base_url} did not answer {method} {route} within "
                                     f"{timeout:g} s; it is hung or overloaded (raise vllm_server_request_timeout "
                                     "if its work takes longer)") from None
                if not idempotent or delay is None:
                    raise PlaitError(f"vLLM server at {self.base_url} did not answer {method} {route} "
                                     f"({reason}); is `plait vllm-serve` running there?") from None
                time.sleep(delay)

    @contextlib.contextmanager
    def _meanwhile(self, route: str, body: dict) -> Iterator[None]:
        """POST ``route`` from a thread while the block does this side's part of the side channel;
        the request's error is raised after the block, ahead of the block's own (the server's
        refusal says more than a process group that waited in vain)."""
        errors: list[BaseException] = []

        def post() -> None:
            try:
                self._request("POST", route, body, idempotent=False)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(err)

        posting = threading.Thread(target=post)
        posting.start()
        try:
            yield
        except Exception:
            posting.join()
            if errors:
                raise errors[0] from None
            raise
        posting.join()
        if errors:
            raise errors[0]

    def health(self, timeout: float = 10.0) -> dict:
        info = self._request("GET", "/health", idempotent=False, timeout=timeout)
        self.max_body_bytes = info.get("max_body_bytes")
        return info

    def wait_until_ready(self, timeout: float | None = None) -> dict:
        """Poll ``/health`` until the server answers, or fail after ``timeout`` seconds naming it."""
        timeout = self.connection_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            except PlaitError as err:
                if "refused GET /health (401)" in str(err):
                    raise
            if time.monotonic() >= deadline:
                raise PlaitError(f"no vLLM server answered at {self.host}:{self.port} ({self.base_url}/health) "
                                 f"within {timeout:g} s; start one with `plait vllm-serve --model ... --port "
                                 f"{self.port}` or fix vllm_server_host / vllm_server_port")
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    # -- routes -------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Any], sampling: SamplingParams, stop_token_ids: Sequence[int] = ()) -> dict:
        body = {"prompts": [list(p) if not isinstance(p, str) else p for p in prompts],
                "sampling": attrs.asdict(sampling), "stop_token_ids": sorted(int(t) for t in stop_token_ids)}
        return self._request("POST", "/generate", body)

    def reset_prefix_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache", {})

    def init_weight_group(self) -> None:
        """Join the server's engine workers in a process group of our own (we are the last rank)."""
        info = self.health()
        backend, world = info["weight_backend"], info["world_size"] + 1
        if backend == "nccl" and not torch.cuda.is_available():
            raise PlaitError(f"the vLLM server at {self.base_url} syncs weights over NCCL but this trainer has no GPU")
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._send_buffers = {} if self.device.type == "cpu" else None  # a GPU's caching allocator keeps its own
        prefix = session_prefix()  # the store's keys, known only to this authenticated client and the server
        with self._meanwhile("/init_communicator", {"port": self.group_port, "timeout": self.connection_timeout,
                                                    "prefix": prefix}):
            self.group = weight_group(self.host, self.group_port, world - 1, world, backend, self.connection_timeout,
                                      prefix)
        self.rank = world - 1

    def update_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> float:
        """Broadcast (HF name, parameter) pairs to the server's engines; returns the seconds it took."""
        if self.group is None:
            self.init_weight_group()
        start = time.perf_counter()
        layout = bucket_layout(named)
        with self._meanwhile("/update_weights", {"layout": layout}):
            send_buckets(self.group, self.rank, layout, named, self.device, self._send_buffers)
        self.push_seconds.append(time.perf_counter() - start)
        self.sent_bytes.append(sum(b["numel"] * WEIGHT_DTYPES[b["dtype"]].itemsize for b in layout))
        return self.push_seconds[-1]

    def load_adapter(self, folder: str) -> dict:
        """Post the PEFT adapter in ``folder`` (its two files, base64) to a server started with
        ``--enable-lora``, which loads it as its next LoRA version; returns the server's answer."""
        start = time.perf_counter()
        files = {name: base64.b64encode(Path(folder, name).read_bytes()).decode("ascii") for name in ADAPTER_FILES}
        size = sum(map(len, files.values())) + 128  # the JSON around the files is a few dozen bytes
        if self.max_body_bytes is not None and size > self.max_body_bytes:
            raise PlaitError(f"the LoRA adapter is {size} bytes as sent, over the limit of the vLLM server at "
                             f"{self.base_url} ({self.max_body_bytes}); restart it with a larger --max-body-bytes "
                             "or set vllm_lora_sync=False (merged weights over the side channel)")
        reply = self._request("POST", "/load_adapter", {"files": files}, idempotent=False)
        self.push_seconds.append(time.perf_counter() - start)
        self.sent_bytes.append(size)
        return reply

    def close(self) -> None:
        if self.group is not None:
            self.group = None
            self._request("POST", "/close", {})


class VLLMServerBackend(GenerationBackend):
    """Samples from a running ``plait vllm-serve``; pushes the policy's weights to it after each step."""

    shares_weights = False

    def __init__(self, model, processing_class, params: VLLMServerParams | None = None):
        self.params = p = params or VLLMServerParams()
        self.model, self.processing_class = model, processing_class
        self.lora = p.lora_sync and lora_unservable(model) is None  # else the merged push, as colocate does
        self.push_bytes: list[int] = []  # the tensor bytes each push carried (trainer precision)
        self._adapters: tempfile.TemporaryDirectory | None = None
        self.eos_ids = eos_token_ids(processing_class, _unwrap(model))
        if not self.eos_ids:
            raise PlaitError("the tokenizer has no eos_token and the model's generation_config no eos_token_id; "
                             "set tokenizer.eos_token so completions can end")
        self.client = VLLMClient(p.server_base_url, p.server_host, p.server_port, group_port=p.group_port,
                                 token=p.server_token, token_file=p.server_token_file,
                                 connection_timeout=p.server_timeout, request_timeout=p.server_request_timeout)
        self.started = False

    @property
    def push_seconds(self) -> list[float]:
        return self.client.push_seconds

    def start(self) -> None:
        if self.started:
            return
        info = self.client.wait_until_ready()
        if torch.cuda.is_available():  # the server must not share the trainer's GPU
            mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            if mine in info.get("devices", []):
                raise PlaitError(f"the vLLM server at {self.client.base_url} runs on this trainer's GPU {mine}; "
                                 "start it on other devices (CUDA_VISIBLE_DEVICES) or use generation.vllm_colocate")
        if not self.lora:
            refuse_quantized_merge(_unwrap(self.model), "set vllm_lora_sync=True and start plait vllm-serve with --enable-lora")
        if self.lora:
            check_lora_server(info, lora_rank(self.model), self.client.base_url)
            self._adapters = tempfile.TemporaryDirectory(prefix="plait-vllm-lora-")
        self.started = True
        if self.lora:  # the server holds the base weights alone: the first rollout needs the adapter too
            self._push_adapter(self.model)

    def generate(self, prompts, sampling: SamplingParams) -> Generations:
        self.start()
        prompt_ids = encode_prompts(self.processing_class, prompts)  # the trainer's tokenizer decides the ids
        rows = self.client.generate(prompt_ids, sampling, self.eos_ids)
        texts = tokenizer_of(self.processing_class).batch_decode(rows["completion_ids"], skip_special_tokens=True)
        return Generations(prompt_ids=rows["prompt_ids"], completion_ids=rows["completion_ids"], texts=texts,
                           finished=rows["finished"], logprobs=rows["logprobs"])

    def load_weights(self, model) -> None:
        """The main process pushes; the others wait for it (and take part in gathering sharded weights)."""
        self.start()
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        if self.lora:
            self._push_adapter(model)
            return
        with policy_parameters(model) as named:
            if not distributed or dist.get_rank() == 0:
                self.push_bytes.append(payload_bytes(named))
                self.client.update_weights(named)
            elif any(hasattr(p, "ds_id") or hasattr(p, "full_tensor") for _, p in named):
                for _ in materialised(named):  # the gathers are collective
                    pass
        if distributed:
            dist.barrier()

    def _push_adapter(self, model) -> None:
        """The main process saves the adapter and posts it; the others wait for it (and take part in
        gathering sharded adapter weights)."""
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        if not distributed or dist.get_rank() == 0:
            folder = os.path.join(self._adapters.name, f"v{len(self.push_bytes) + 1}")
            self.push_bytes.append(save_adapter(model, folder))
            self.client.load_adapter(folder)
            shutil.rmtree(folder, ignore_errors=True)
        elif any(hasattr(p, "ds_id") or hasattr(p, "full_tensor") for _, p in adapter_parameters(_unwrap(model))):
            for _ in materialised(adapter_parameters(_unwrap(model))):  # the gathers are collective
                pass
        if distributed:
            dist.barrier()

    def close(self) -> None:
        if self.started:
            self.client.close()
            self.started = False
        if self._adapters is not None:
            self._adapters.cleanup()
            self._adapters = None


def check_lora_server(info: dict, rank: int, url: str) -> None:
    """Refuse, at connect time, a server that cannot serve the policy's adapter (its /health ``info``)."""
    limit = info.get("max_lora_rank")
    if limit is None:
        raise PlaitError(f"vllm_lora_sync=True but the vLLM server at {url} was started without LoRA; restart it "
                         f"with `plait vllm-serve ... --enable-lora --max-lora-rank {rank}`, or set vllm_lora_sync=False")
    if rank > limit:
        raise PlaitError(f"the policy's LoRA rank {rank} is over the vLLM server's --max-lora-rank {limit} ({url}); "
                         f"restart it with --max-lora-rank {rank}, or set vllm_lora_sync=False")


def _unwrap(model):
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def check_config(args) -> VLLMServerParams:
    """The server options a method config gives (its ``vllm_*`` fields), refusing what this backend cannot honour."""
    refuse_transformers_options(args, NAME)
    return backend_options(VLLMServerParams, args, NAME)


def vllm_server_backend(model, processing_class, args=None) -> VLLMServerBackend:
    """Factory registered as ``generation.vllm_server``; options from the config's ``vllm_*`` fields."""
    params = check_config(args) if args is not None else VLLMServerParams()
    return VLLMServerBackend(model, processing_class, params)


@hookimpl
def register_generation_backends(register):
    register(NAME, vllm_server_backend, params=VLLMServerParams, check=check_config,
             doc="Sample from a `plait vllm-serve` process over HTTP; weights pushed over a side channel")
