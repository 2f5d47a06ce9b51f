"""``plait vllm-serve``: a vLLM generation server that an online trainer drives (server mode).

``plait vllm-serve --model PATH [--tensor-parallel-size N] [--data-parallel-size N] [--host H]
[--port P] [--gpu-memory-utilization F] [--token-file PATH] [--max-connections N]
[--header-timeout S] [--max-body-bytes B] [--body-timeout S] [--enable-lora [--max-lora-rank R]]`` starts ``data_parallel_size``
engine processes (each a ``vllm.LLM`` over ``tensor_parallel_size`` devices, or over its own share
of the CPU cores) behind a small JSON-over-HTTP front:

====================  =====================================================================
``GET /health``       ``{"status": "ok", "world_size", "weight_backend", "devices", ...}``
``POST /generate``    ``{"prompts": [ids | text | messages], "sampling": {SamplingParams},
                      "stop_token_ids": [...]}`` -> prompt_ids, completion_ids, texts,
                      per-token logprobs and finished, grouped by prompt
``POST /init_communicator``  ``{"port", "timeout", "prefix"}``: the engines' workers join a
                      weight-sync process group with the trainer (rank ``world_size``); worker 0
                      hosts its store at ``port`` on the address this request arrived at, keyed
                      under the session's random ``prefix``
``POST /update_weights``     ``{"layout"}``: receive the buckets the trainer broadcasts, reload
                      them into the engines, reset the prefix cache
``POST /load_adapter``  ``{"files": {"adapter_config.json": base64, "adapter_model.safetensors":
                      base64}}`` (a server started with ``--enable-lora``): a PEFT LoRA adapter, checked
                      against the model's own linear layers and ``--max-lora-rank``, becomes the next
                      LoRA version, which every later generation uses until the next push of either kind
``POST /reset_prefix_cache``
``POST /close``       leave the weight-sync group
====================  =====================================================================

Weights never travel in an HTTP body: they go over the process group (gloo on CPU, NCCL on
GPU); only a LoRA adapter (``vllm_lora_sync``: a few MB, bounded by ``--max-body-bytes``) travels in
a body, as the two files of a PEFT adapter folder. Every request must carry ``Authorization: Bearer <token>``: the token is ``--token-file``'s
(generated into it when the file does not exist), PLAIT_VLLM_TOKEN, ``--token`` (visible to every
user in ``ps``), or else a fresh one written to a file of this user's alone
(:func:`~plait.plugins.generation._vllm.token_path`) where clients on this machine find it.

The front is bounded: at most ``--max-connections`` at once (more get 503), the request line and
headers must arrive within ``--header-timeout`` seconds all told and the body within
``--body-timeout``, each request is judged from its headers before its body is read (401, 404,
411, 413), and a weight layout or join request is checked against the model's own parameters and
sane ranges before an engine allocates anything.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import functools
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from plait import hookimpl, serving
from plait.cli import Command
from plait.errors import PlaitError
from plait.serving import HEADER_TIMEOUT, MAX_CONNECTIONS, BoundedServer, JsonHandler, add_limit_arguments, check_limits

from ._vllm import ADAPTER_FILES, LORA_RANKS, TOKEN_ENV, WEIGHT_DTYPES, lora_engine_options, token_path, write_token

if TYPE_CHECKING:
    import torch

MAX_BODY_BYTES = 64 * 2**20  # generate requests: millions of prompt token ids; weights never travel in a body
BODY_TIMEOUT = 60.0  # seconds for a whole body to arrive: 64 MiB at ~1 MB/s
MAX_JOIN_TIMEOUT = 3600.0  # the longest wait for a trainer to join the weight-sync group a client may ask for
SESSION_PREFIX = re.compile(r"plait-weights-[0-9a-f]{32}")  # what _vllm.session_prefix makes
LORA_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")  # PEFT's name for a LoRA factor
SAFETENSORS_FLOATS = {"F32": 4, "BF16": 2, "F16": 2}  # the float dtypes an adapter's tensors may have, and their bytes
NO_LORA = ("this server was started without LoRA; restart plait vllm-serve with --enable-lora (and --max-lora-rank "
           "at least the adapter's rank), or set vllm_lora_sync=False on the trainer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # each flag also under TRL's spelling (--tensor_parallel_size), so `trl vllm-serve ...` lines run unchanged
    parser.add_argument("--model", required=True, help="model folder or hub id")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--tensor-parallel-size", "--tensor_parallel_size", type=int, default=1)
    parser.add_argument("--data-parallel-size", "--data_parallel_size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback; any other needs a token you give clients)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--gpu-memory-utilization", "--gpu_memory_utilization", type=float, default=0.9)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", "--max_model_len", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache size (CPU: instead of VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--enable-prefix-caching", "--enable_prefix_caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enforce-eager", "--enforce_eager", action=argparse.BooleanOptionalAction, default=None,
                        help="no CUDA graphs / compilation (default: on for CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-file", default=None,
                        help="file holding the token clients must send (made, mode 0600, when missing); default: "
                             f"{TOKEN_ENV}, else a fresh token in a file of yours that local clients find")
    parser.add_argument("--token", default=None,
                        help="the token itself: visible to every user of this machine in `ps`; prefer --token-file")
    parser.add_argument("--enable-lora", "--enable_lora", action="store_true",
                        help="serve LoRA adapters that trainers push (vllm_lora_sync=True) over the model's weights")
    parser.add_argument("--max-lora-rank", "--max_lora_rank", type=int, default=16,
                        help="the largest adapter rank --enable-lora takes (raised to one vLLM allows: 1, 8, 16, 32, "
                             "64, 128, 256, 320, 512; default 16)")
    add_limit_arguments(parser, max_body_bytes=MAX_BODY_BYTES, body_timeout=BODY_TIMEOUT)


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without a token the operator chose (the server runs arbitrary
    prompts and overwrites its weights on request)."""
    serving.check_bind(host, token, TOKEN_ENV)


def server_token(args: argparse.Namespace) -> tuple[str, Path | None]:
    """The token this server requires, and the file to write it into: ``--token`` (warned: any user sees
    it in ``ps``), else :func:`plait.serving.server_token` (``--token-file``, PLAIT_VLLM_TOKEN, a fresh one
    for :func:`token_path`)."""
    if args.token:
        print("plait vllm-serve: warning: --token is visible to every user of this machine (ps, /proc/*/cmdline); "
              f"use --token-file or {TOKEN_ENV}", file=sys.stderr)
        return args.token, None
    return serving.server_token(args.token_file, TOKEN_ENV, token_path(args.port))


def run(args: argparse.Namespace, plugins) -> int:
    check_bind(args.host, args.token or args.token_file or os.environ.get(TOKEN_ENV))
    for flag in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(args, flag) < 1:
            raise PlaitError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be at least 1")
    check_limits(args)
    if not 1 <= args.max_lora_rank <= LORA_RANKS[-1]:
        raise PlaitError(f"--max-lora-rank={args.max_lora_rank} must be from 1 to {LORA_RANKS[-1]} (vLLM's largest)")
    lora = lora_engine_options(args.max_lora_rank) if args.enable_lora else None
    token, token_file = server_token(args)
    try:  # bind first: a busy port fails now, before its server's token file is overwritten
        httpd = GenerationServer((args.host, args.port), model=args.model, revision=args.revision, token=token,
                                 max_connections=args.max_connections, header_timeout=args.header_timeout,
                                 max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                                 max_lora_rank=lora["max_lora_rank"] if lora else None)
    except OSError as err:
        raise PlaitError(f"cannot listen on {args.host}:{args.port} ({err.strerror}); choose another --port") from None
    if token_file is not None:
        write_token(token_file, token)
        print(f"plait vllm-serve: the token is in {token_file} (yours alone, removed at exit); clients on this "
              "machine find it there, others need vllm_server_token_file", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pool = EnginePool(args)
    try:
        try:
            pool.start()
        except RuntimeError as err:
            raise PlaitError(f"the vLLM engine for {args.model} did not start: {str(err).splitlines()[0]}") from None
        httpd.pool = pool
        print(f"plait vllm-serve: {args.model} ready on http://{args.host}:{args.port} "
              f"({args.data_parallel_size} engine(s) × {args.tensor_parallel_size} device(s)"
              + (f"; LoRA adapters up to rank {lora['max_lora_rank']}" if lora else "") + ")", flush=True)
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        pool.close()
        if token_file is not None:
            token_file.unlink(missing_ok=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Engine processes
# ---------------------------------------------------------------------------------------------


def engine_options(args: argparse.Namespace) -> dict:
    options = dict(dtype=args.dtype, max_model_len=args.max_model_len, revision=args.revision,
                   gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
                   enable_prefix_caching=args.enable_prefix_caching, seed=args.seed)
    if args.kv_cache_memory_bytes is not None:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.enforce_eager is not None:
        options["enforce_eager"] = args.enforce_eager
    if args.enable_lora:
        options.update(lora_engine_options(args.max_lora_rank))
    return options


def placement(index: int, engines: int, tensor_parallel_size: int) -> dict[str, str]:
    """Environment giving engine ``index`` of ``engines`` its own devices (GPU) or cores (CPU)."""
    if engines == 1:
        return {}
    import torch

    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        share = devices[index * tensor_parallel_size:(index + 1) * tensor_parallel_size]
        return {"CUDA_VISIBLE_DEVICES": ",".join(share)}
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // engines)
    share = cores[index * per:(index + 1) * per] or cores[-per:]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, share))}


def engine_process(conn, model: str, options: dict, environment: dict) -> None:
    """One engine: build it, then answer (command, args) messages until told to close."""
    os.environ.update(environment)
    from plait.online.generation import SamplingParams
    from plait.plugins.generation._vllm import Engine, on_cpu

    try:
        engine = Engine(model, in_process=on_cpu(), who="plait vllm-serve", **options)
    except BaseException as err:  # noqa: BLE001 - reported to the front, which exits
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    import torch

    devices = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    conn.send(("ok", {"devices": devices}))
    lora = [None]  # the LoRA version generation uses: the last push decides (a full weight push drops it)

    def load_adapter(version: int, folder: str) -> float:
        start = time.perf_counter()
        lora[0] = engine.load_adapter(version, folder)
        return time.perf_counter() - start

    def receive(layout) -> float:
        lora[0] = None
        return _receive(engine, layout)

    commands = {
        "generate": lambda ids, sampling, stop: engine.generate(ids, SamplingParams(**sampling), stop,
                                                                lora_request=lora[0]),
        "join": lambda *a: engine.llm.collective_rpc("plait_join_weight_group", args=a),
        "receive": receive,
        "adapter": load_adapter,
        "reset": engine.reset_prefix_cache,
        "leave": lambda: engine.llm.collective_rpc("plait_leave_weight_group"),
    }
    while True:
        command, arguments = conn.recv()
        if command == "close":
            engine.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[command](*arguments)))
        except Exception as err:  # noqa: BLE001 - the front turns it into an HTTP error
            traceback.print_exc()
            conn.send(("error", f"{type(err).__name__}: {err}"))


def _receive(engine, layout) -> float:
    start = time.perf_counter()
    engine.llm.collective_rpc("plait_receive_weights", args=(layout,))
    engine.reset_prefix_cache()
    return time.perf_counter() - start


class EnginePool:
    """The engine processes and the pipes to them; one command at a time (a lock)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.engines = args.data_parallel_size
        self.world_size = self.engines * args.tensor_parallel_size  # weight-sync ranks on this side
        self.lock = threading.Lock()
        self.processes, self.conns, self.devices = [], [], []
        self.weight_backend = "gloo"

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        options = engine_options(self.args)
        for index in range(self.engines):
            parent, child = context.Pipe()
            environment = placement(index, self.engines, self.args.tensor_parallel_size)
            process = context.Process(target=engine_process, args=(child, self.args.model, options, environment),
                                      daemon=False, name=f"plait-vllm-engine-{index}")
            process.start()
            self.processes.append(process)
            self.conns.append(parent)
        for reply in self._collect():
            self.devices.extend(reply["devices"])
        self.weight_backend = "nccl" if self.devices else "gloo"

    def _collect(self) -> list:
        replies, errors = [], []
        for conn in self.conns:
            status, value = conn.recv()
            (replies if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError(errors[0])
        return replies

    def call(self, command: str, per_engine: list[tuple]) -> list:
        """Send ``command`` with its arguments to each engine (None: skip that engine) and wait for all."""
        with self.lock:
            busy = []
            for conn, arguments in zip(self.conns, per_engine):
                if arguments is not None:
                    conn.send((command, arguments))
                    busy.append(conn)
            replies, errors = [], []
            for conn in busy:
                status, value = conn.recv()
                (replies if status == "ok" else errors).append(value)
            if errors:
                raise RuntimeError(errors[0])
            return replies

    def broadcast(self, command: str, *arguments) -> list:
        return self.call(command, [arguments] * self.engines)

    def generate(self, prompt_ids: list[list[int]], sampling: dict, stop: list[int]) -> dict:
        """Split the prompts into contiguous shares, one per engine; rows come back in order."""
        shares = [prompt_ids[self._bounds(i, len(prompt_ids))] for i in range(self.engines)]
        replies = self.call("generate", [(share, sampling, stop) if share else None for share in shares])
        rows = {key: [] for key in ("prompt_ids", "completion_ids", "texts", "logprobs", "finished")}
        for reply in replies:
            for key in rows:
                rows[key].extend(reply[key])
        return rows

    def _bounds(self, index: int, n: int) -> slice:
        per, extra = divmod(n, self.engines)
        start = index * per + min(index, extra)
        return slice(start, start + per + (index < extra))

    def join(self, host: str, port: int, timeout: float, prefix: str) -> None:
        """Every worker joins the weight-sync group; worker 0 hosts its store at ``host:port``,
        its keys under ``prefix``."""
        tp = self.args.tensor_parallel_size
        self.call("join", [(host, port, self.world_size + 1, i * tp, self.weight_backend, timeout, prefix)
                           for i in range(self.engines)])

    def close(self) -> None:
        for conn, process in zip(self.conns, self.processes):
            try:
                if process.is_alive():
                    conn.send(("close", ()))
                    if conn.poll(30):
                        conn.recv()
            except (OSError, EOFError):
                pass
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


class GenerationServer(BoundedServer):
    """The HTTP front: ``pool`` (an :class:`EnginePool`) answers the routes; ``token``,
    ``max_connections``, ``header_timeout``, ``max_body_bytes`` and ``body_timeout`` decide which
    requests it gets to see (:class:`plait.serving.BoundedServer`), ``model`` (its config) which
    weight layouts and adapters it accepts, and ``max_lora_rank`` (None: started without LoRA) the
    largest adapter rank. Pushed adapters live in a folder of this server's (0700), removed at close."""

    def __init__(self, address: tuple[str, int], pool: EnginePool | None = None, *, token: str, model: str = "",
                 revision: str | None = None, max_connections: int = MAX_CONNECTIONS,
                 header_timeout: float = HEADER_TIMEOUT, max_body_bytes: int = MAX_BODY_BYTES,
                 body_timeout: float = BODY_TIMEOUT, max_lora_rank: int | None = None):
        super().__init__(address, Handler, who="plait vllm-serve", token=token, max_connections=max_connections,
                         header_timeout=header_timeout, max_body_bytes=max_body_bytes, body_timeout=body_timeout)
        self.pool, self.model, self.revision = pool, model, revision
        self.max_lora_rank, self.adapter_version = max_lora_rank, 0
        self.adapter_lock = threading.Lock()  # one adapter push at a time: versions in order
        self.adapters = Path(tempfile.mkdtemp(prefix="plait-vllm-serve-lora-")) if max_lora_rank else None

    def server_close(self) -> None:
        super().server_close()
        if self.adapters is not None:
            shutil.rmtree(self.adapters, ignore_errors=True)

    @functools.cached_property
    def parameters(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return model_parameters(self.model, self.revision)


class Handler(JsonHandler):
    server_version = "plait-vllm-serve"
    routes = {("GET", "/health"): "health", ("POST", "/generate"): "generate",
              ("POST", "/init_communicator"): "init_communicator", ("POST", "/update_weights"): "update_weights",
              ("POST", "/reset_prefix_cache"): "reset_prefix_cache", ("POST", "/close"): "close_communicator",
              ("POST", "/load_adapter"): "load_adapter"}
    token_hint = f"the server's --token or {TOKEN_ENV}"
    too_large_hint = "send fewer prompts per request"

    # -- routes -------------------------------------------------------------------------------
    @property
    def pool(self) -> EnginePool:
        return self.server.pool

    def health(self, body: dict) -> dict:
        pool = self.pool
        return {"status": "ok", "model": self.server.model, "world_size": pool.world_size,
                "data_parallel_size": pool.engines, "tensor_parallel_size": pool.args.tensor_parallel_size,
                "weight_backend": pool.weight_backend, "devices": pool.devices,
                "max_body_bytes": self.server.max_body_bytes, "max_lora_rank": self.server.max_lora_rank}

    def generate(self, body: dict) -> dict:
        from plait.online.generation import SamplingParams, encode_prompts

        prompts = body["prompts"]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("'prompts' must be a non-empty list of token-id lists, strings or message lists")
        sampling = dict(body.get("sampling") or {})
        SamplingParams(**sampling)  # validate here: a bad field is a 400 naming it
        needs_tokenizer = any(not (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompts)
        ids = encode_prompts(_tokenizer(self.server.model) if needs_tokenizer else None, prompts)
        return self.pool.generate(ids, sampling, [int(t) for t in body.get("stop_token_ids") or []])

    def init_communicator(self, body: dict) -> dict:
        port, timeout, prefix = body.get("port"), body.get("timeout", 300), body.get("prefix")
        if type(port) is not int or not 0 < port < 65536:
            raise ValueError(f"'port' must be a port number (1-65535), not {port!r}")
        if type(timeout) not in (int, float) or not 0 < timeout <= MAX_JOIN_TIMEOUT:
            raise ValueError(f"'timeout' must be seconds, more than 0 and at most {MAX_JOIN_TIMEOUT:g}, not {timeout!r}")
        if not isinstance(prefix, str) or not SESSION_PREFIX.fullmatch(prefix):
            raise ValueError("'prefix' must be a fresh session prefix ('plait-weights-' and 32 hex digits)")
        # The store listens on the address this authenticated client reached (one interface,
        # even under --host 0.0.0.0), its keys under the session's secret prefix.
        self.pool.join(self.connection.getsockname()[0], port, float(timeout), prefix)
        return {"world_size": self.pool.world_size + 1}

    def update_weights(self, body: dict) -> dict:
        # the engines allocate what the model's own parameters say, never what a request says
        layout = checked_layout(body.get("layout"), self.server.parameters)
        seconds = self.pool.broadcast("receive", layout)
        return {"seconds": max(seconds)}

    def load_adapter(self, body: dict) -> dict:
        """A pushed PEFT adapter becomes the next LoRA version of every engine; the previous version's
        folder goes once the new one is loaded."""
        server = self.server
        if server.max_lora_rank is None:
            raise PlaitError(NO_LORA)
        files, tensor_bytes = checked_adapter(body.get("files"), server.parameters, server.max_lora_rank)
        with server.adapter_lock:
            version = server.adapter_version + 1
            folder = write_adapter(server.adapters, version, files)
            try:
                seconds = self.pool.broadcast("adapter", version, str(folder))
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            server.adapter_version = version
            shutil.rmtree(server.adapters / f"v{version - 1}", ignore_errors=True)
        return {"version": version, "seconds": max(seconds), "bytes": tensor_bytes}

    def reset_prefix_cache(self, body: dict) -> dict:
        self.pool.broadcast("reset")
        return {"status": "ok"}

    def close_communicator(self, body: dict) -> dict:
        self.pool.broadcast("leave")
        return {"status": "ok"}


def model_parameters(model: str, revision: str | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model's parameters as a trainer names them (name -> shape, dtype; tied ones once),
    built from its config on the meta device: no weight is read and nothing allocated."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model, revision=revision)
    architecture = getattr(transformers, next(iter(config.architectures or []), ""), None)
    with torch.device("meta"):
        skeleton = (architecture(config) if architecture is not None
                    else transformers.AutoModelForCausalLM.from_config(config))
    return {name: (tuple(p.shape), p.dtype) for name, p in skeleton.named_parameters()}


def checked_layout(layout, parameters: dict) -> list[dict]:
    """A weight layout (:func:`~plait.plugins.generation._vllm.bucket_layout`) rebuilt from the
    model's own parameters, or a ValueError where the one sent does not describe them: each name
    one of them, at most once, with its shape and a floating dtype for it, packed one after another
    without gap or overlap. What an engine allocates for a push is then bounded by the model's size."""
    if not isinstance(layout, list):
        raise ValueError("'layout' must be a list of weight buckets")
    sent, checked = set(), []
    for index, bucket in enumerate(layout):
        if not isinstance(bucket, dict) or not isinstance(bucket.get("params"), list):
            raise ValueError(f"weight bucket {index} must be an object with dtype, numel and params")
        if bucket.get("dtype") not in WEIGHT_DTYPES:
            raise ValueError(f"weight bucket {index}: dtype {bucket.get('dtype')!r} is not one of {sorted(WEIGHT_DTYPES)}")
        rows, end = [], 0
        for entry in bucket["params"]:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
                raise ValueError(f"weight bucket {index}: each param must be [name, shape, offset], not {entry!r}")
            name, shape, offset = entry
            if name not in parameters or name in sent:
                raise ValueError(f"weight bucket {index}: {name!r} is " + (
                    "sent twice" if name in sent else "not a parameter of this server's model"))
            expected, dtype = parameters[name]
            if shape != list(expected) or not dtype.is_floating_point:
                raise ValueError(f"weight bucket {index}: {name} has shape {list(expected)} ({dtype}) in this server's "
                                 f"model, not {shape!r}")
            if type(offset) is not int or offset != end:
                raise ValueError(f"weight bucket {index}: {name} must start at {end}, where the one before it ends, "
                                 f"not at {offset!r}")
            rows.append([name, list(expected), end])
            end += math.prod(expected)
            sent.add(name)
        if type(bucket.get("numel")) is not int or bucket["numel"] != end:
            raise ValueError(f"weight bucket {index}: numel must be {end}, the sum of its params, "
                             f"not {bucket.get('numel')!r}")
        checked.append({"dtype": bucket["dtype"], "numel": end, "params": rows})
    return checked


def checked_adapter(files, parameters: dict, max_rank: int) -> tuple[dict[str, bytes], int]:
    """The files of a pushed adapter (name -> bytes) and its tensor bytes, or a ValueError where they are
    not a plain PEFT LoRA adapter of this server's model within ``max_rank``: exactly the two files of
    :data:`ADAPTER_FILES` (no other name, so no path), valid base64, a LoRA config without DoRA, biases
    or whole trained modules, and safetensors whose every tensor is one factor of a LoRA pair on one of
    the model's 2-d weights, of its shape, at a rank of at most ``max_rank``."""
    if not isinstance(files, dict) or sorted(files) != sorted(ADAPTER_FILES):
        names = sorted(str(name)[:80] for name in files) if isinstance(files, dict) else type(files).__name__
        raise ValueError(f"'files' must map exactly {list(ADAPTER_FILES)} to base64 text, not {names}")
    decoded = {}
    for name in ADAPTER_FILES:
        if not isinstance(files[name], str):
            raise ValueError(f"{name} must be base64 text")
        try:
            decoded[name] = base64.b64decode(files[name], validate=True)
        except binascii.Error as err:
            raise ValueError(f"{name} is not valid base64 ({err})") from None
    try:
        config = json.loads(decoded["adapter_config.json"])
    except ValueError as err:
        raise ValueError(f"adapter_config.json is not JSON ({err})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ValueError("adapter_config.json must describe a LoRA adapter (peft_type 'LORA')")
    if config.get("use_dora") or config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise ValueError("the adapter uses DoRA, biases or modules_to_save, which only a full weight push carries; "
                         "set vllm_lora_sync=False")
    pattern = config.get("rank_pattern") or {}
    ranks = [config.get("r"), *(pattern.values() if isinstance(pattern, dict) else [None])]
    if not all(type(r) is int and r >= 1 for r in ranks):
        raise ValueError(f"adapter_config.json: r and rank_pattern must be positive integers, not {ranks[:8]}")
    if max(ranks) > max_rank:
        raise ValueError(f"the adapter's rank {max(ranks)} is over this server's --max-lora-rank {max_rank}; "
                         f"restart plait vllm-serve with --max-lora-rank {max(ranks)}")
    tensors = _safetensors_header(decoded["adapter_model.safetensors"])
    if not tensors:
        raise ValueError("adapter_model.safetensors holds no tensor")
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, (dtype, shape) in tensors.items():
        match = LORA_TENSOR.fullmatch(name)
        weight = parameters.get(f"{match.group(1)}.weight") if match else None
        if weight is None or len(weight[0]) != 2:
            raise ValueError(f"adapter tensor {name[:200]!r} is not a LoRA factor of a linear layer of this server's "
                             "model (base_model.model.<module>.lora_A/lora_B.weight)")
        if dtype not in SAFETENSORS_FLOATS:
            raise ValueError(f"adapter tensor {name} has dtype {dtype}, not a float")
        pairs.setdefault(match.group(1), {})[match.group(2)] = shape
    for module, factors in pairs.items():
        (out_features, in_features), a, b = parameters[f"{module}.weight"][0], factors.get("A"), factors.get("B")
        if a is None or b is None or len(a) != 2 or len(b) != 2 or a[1] != in_features or b[0] != out_features \
                or a[0] != b[1] or not 1 <= a[0] <= max_rank:
            raise ValueError(f"adapter factors of {module} have shapes A {a} and B {b}; this server's model needs "
                             f"A [r, {in_features}] and B [{out_features}, r] with r at most {max_rank}")
    return decoded, sum(math.prod(shape) * SAFETENSORS_FLOATS[dtype] for dtype, shape in tensors.values())


def _safetensors_header(data: bytes) -> dict[str, tuple[str, list[int]]]:
    """A safetensors file's tensors (name -> dtype, shape) from its header alone, checked to tile the
    data that follows it exactly, so what the engine later loads is what was checked."""
    if len(data) < 8:
        raise ValueError("adapter_model.safetensors is not a safetensors file (shorter than its header size)")
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + size]) if size <= len(data) - 8 else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ValueError("adapter_model.safetensors is not a safetensors file (its header is not JSON)")
    header.pop("__metadata__", None)
    tensors, spans = {}, []
    for name, entry in header.items():
        dtype, shape, offsets = (entry.get(k) if isinstance(entry, dict) else None
                                 for k in ("dtype", "shape", "data_offsets"))
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape) and isinstance(offsets, list)
                and len(offsets) == 2 and all(type(n) is int for n in offsets)):
            raise ValueError(f"adapter_model.safetensors: tensor {str(name)[:200]!r} has a malformed entry")
        if dtype in SAFETENSORS_FLOATS and offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_FLOATS[dtype]:
            raise ValueError(f"adapter_model.safetensors: tensor {name} does not span its shape's bytes")
        tensors[name] = (dtype, shape)
        spans.append(offsets)
    end = 0
    for start, stop in sorted(spans):
        if start != end:
            raise ValueError("adapter_model.safetensors: its tensors overlap or leave gaps")
        end = stop
    if end != len(data) - 8 - size:
        raise ValueError("adapter_model.safetensors: its tensors do not fill the file exactly")
    return tensors


def write_adapter(root: Path, version: int, files: dict[str, bytes]) -> Path:
    """Write a checked adapter as ``root/v<version>``: into a fresh hidden folder first, renamed whole,
    so an engine never reads half an adapter; the names are :data:`ADAPTER_FILES`, never a client's."""
    staged = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=root))
    for name in ADAPTER_FILES:
        (staged / name).write_bytes(files[name])
    final = root / f"v{version}"
    os.rename(staged, final)
    return final


@functools.lru_cache(maxsize=1)
def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@hookimpl
def register_commands(register):
    register("command.vllm-serve", Command(run, add_arguments, help="serve a model with vLLM for online training "
                                                                     "(generation.vllm_server)"))
