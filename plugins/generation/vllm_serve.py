"""``plait vllm-serve``: a vLLM generation server that an online trainer drives (server mode).

``plait vllm-serve --model PATH [--tensor-parallel-size N] [--data-parallel-size N] [--host H]
[--port P] [--gpu-memory-utilization F] [--token T] [--max-body-bytes B] [--body-timeout S]``
starts ``data_parallel_size`` engine processes (each a ``vllm.LLM`` over ``tensor_parallel_size``
devices, or over its own share of the CPU cores) behind a small JSON-over-HTTP front:

====================  =====================================================================
``GET /health``       ``{"status": "ok", "world_size", "weight_backend", "devices", ...}``
``POST /generate``    ``{"prompts": [ids | text | messages], "sampling": {SamplingParams},
                      "stop_token_ids": [...]}`` -> prompt_ids, completion_ids, texts,
                      per-token logprobs and finished, grouped by prompt
``POST /init_communicator``  ``{"port"}``: the engines' workers join a weight-sync process group
                      with the trainer (rank ``world_size``; worker 0 hosts the store at
                      ``port`` on the server's own address, never on every interface)
``POST /update_weights``     ``{"layout"}``: receive the buckets the trainer broadcasts, reload
                      them into the engines, reset the prefix cache
``POST /reset_prefix_cache``
``POST /close``       leave the weight-sync group
====================  =====================================================================

Weights never travel in an HTTP body: they go over the process group (gloo on CPU, NCCL on
GPU). The server binds 127.0.0.1 by default; binding any other address needs a shared token
(``--token`` or PLAIT_VLLM_TOKEN), and then every request without ``Authorization: Bearer
<token>`` is refused with 401. Every request is judged from its headers before a byte of its
body is read: a wrong token is 401, a body over ``--max-body-bytes`` (64 MiB) is 413, and a body
that does not arrive in full within ``--body-timeout`` seconds (60; also the longest pause
allowed while the headers arrive) is 408, so a slow or stalled client cannot hold a handler
thread. Note that the weight-sync store listens (on ``--host``) while a trainer joins.
"""

from __future__ import annotations

import argparse
import functools
import hmac
import ipaddress
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from plait import hookimpl
from plait.cli import Command
from plait.errors import PlaitError

TOKEN_ENV = "PLAIT_VLLM_TOKEN"
MAX_BODY_BYTES = 64 * 2**20  # generate requests: millions of prompt token ids; weights never travel in a body
BODY_TIMEOUT = 60.0  # seconds for a whole body to arrive: 64 MiB at ~1 MB/s
# After refusing a request whose body was not read, the client may still be sending: discard at
# most this much, this long, so it can read the refusal instead of a reset (RFC 9112 section 9.6).
LINGER_BYTES, LINGER_SECONDS = 2**20, 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # each flag also under TRL's spelling (--tensor_parallel_size), so `trl vllm-serve ...` lines run unchanged
    parser.add_argument("--model", required=True, help="model folder or hub id")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--tensor-parallel-size", "--tensor_parallel_size", type=int, default=1)
    parser.add_argument("--data-parallel-size", "--data_parallel_size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback; any other needs --token)")
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
    parser.add_argument("--token", default=None, help=f"shared secret clients must send (or set {TOKEN_ENV})")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help="largest request body accepted; larger ones get 413 before they are read (default 64 MiB)")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT,
                        help="seconds a request body may take to arrive in full (and the longest pause while "
                             "headers arrive); slower clients get 408 (default 60)")


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without a token: the server runs arbitrary prompts and
    overwrites its weights on request."""
    if not token and not is_loopback(host):
        raise PlaitError(f"--host {host} listens beyond this machine; pass --token SECRET (or set {TOKEN_ENV}) "
                         "so requests without it are refused, or bind --host 127.0.0.1")


def run(args: argparse.Namespace, plugins) -> int:
    token = args.token or os.environ.get(TOKEN_ENV) or None
    check_bind(args.host, token)
    for flag in ("tensor_parallel_size", "data_parallel_size", "port", "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise PlaitError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be at least 1")
    if not args.body_timeout > 0:
        raise PlaitError(f"--body-timeout={args.body_timeout} must be a positive number of seconds")
    try:  # bind first: a busy port fails now
        httpd = GenerationServer((args.host, args.port), model=args.model, token=token,
                                 max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout)
    except OSError as err:
        raise PlaitError(f"cannot listen on {args.host}:{args.port} ({err.strerror}); choose another --port") from None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pool = EnginePool(args)
    try:
        try:
            pool.start()
        except RuntimeError as err:
            raise PlaitError(f"the vLLM engine for {args.model} did not start: {str(err).splitlines()[0]}") from None
        httpd.pool = pool
        print(f"plait vllm-serve: {args.model} ready on http://{args.host}:{args.port} "
              f"({args.data_parallel_size} engine(s) × {args.tensor_parallel_size} device(s))", flush=True)
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        pool.close()
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
    from plait.generation import SamplingParams
    from plait.plugins.generation._vllm import Engine, on_cpu

    try:
        engine = Engine(model, in_process=on_cpu(), who="plait vllm-serve", **options)
    except BaseException as err:  # noqa: BLE001 - reported to the front, which exits
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    import torch

    devices = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    conn.send(("ok", {"devices": devices}))
    commands = {
        "generate": lambda ids, sampling, stop: engine.generate(ids, SamplingParams(**sampling), stop),
        "join": lambda *a: engine.llm.collective_rpc("plait_join_weight_group", args=a),
        "receive": lambda layout: _receive(engine, layout),
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

    def join(self, host: str, port: int, timeout: float) -> None:
        """Every worker joins the weight-sync group; worker 0 hosts its store at ``host:port``."""
        tp = self.args.tensor_parallel_size
        self.call("join", [(host, port, self.world_size + 1, i * tp, self.weight_backend, timeout)
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


class GenerationServer(ThreadingHTTPServer):
    """The HTTP front: ``pool`` (an :class:`EnginePool`) answers the routes; ``token``,
    ``max_body_bytes`` and ``body_timeout`` decide which requests it gets to see."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], pool: EnginePool | None = None, *, model: str = "",
                 token: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT):
        super().__init__(address, Handler)
        self.pool, self.model, self.token = pool, model, token
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout


class Handler(BaseHTTPRequestHandler):
    server_version = "plait-vllm-serve"
    protocol_version = "HTTP/1.1"
    routes = {("GET", "/health"): "health", ("POST", "/generate"): "generate",
              ("POST", "/init_communicator"): "init_communicator", ("POST", "/update_weights"): "update_weights",
              ("POST", "/reset_prefix_cache"): "reset_prefix_cache", ("POST", "/close"): "close_communicator"}

    def setup(self) -> None:
        self.timeout = self.server.body_timeout  # socket timeout: a stalled request line or header is dropped
        super().setup()

    def log_message(self, format, *args) -> None:  # one line per request on stderr, without the host
        sys.stderr.write(f"plait vllm-serve: {format % args}\n")

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_GET

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue``: a refused request is answered before the client sends its body."""
        refusal = self._refusal()
        if refusal is not None:
            self._refuse(*refusal)
            return False
        return super().handle_expect_100()

    def _dispatch(self) -> None:
        refusal = self._refusal()
        if refusal is not None:
            return self._refuse(*refusal)
        try:
            raw = self._read_body(self._content_length())
        except TimeoutError:
            return self._refuse(HTTPStatus.REQUEST_TIMEOUT, f"the request body did not arrive within "
                                f"{self.server.body_timeout:g} s (plait vllm-serve --body-timeout)")
        except ConnectionError:
            self.close_connection = True  # the client went away mid-body: no one to answer
            return
        try:
            status, payload = HTTPStatus.OK, self._route()(json.loads(raw) if raw else {})
        except (PlaitError, ValueError, TypeError, KeyError) as err:
            status, payload = HTTPStatus.BAD_REQUEST, {"error": f"{type(err).__name__}: {err}"}
        except Exception as err:  # noqa: BLE001 - the client sees what went wrong
            traceback.print_exc()
            status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(err).__name__}: {err}"}
        self._reply(status, payload)

    def _route(self):
        name = self.routes.get((self.command, self.path.rstrip("/") or "/"))
        return getattr(self, name) if name else None

    def _refusal(self) -> tuple[HTTPStatus, str] | None:
        """Why this request is refused, judged from its headers alone (None: read its body)."""
        if not self._authorised():
            return HTTPStatus.UNAUTHORIZED, ("missing or wrong token: send the header 'Authorization: Bearer "
                                             f"<token>' (the server's --token or {TOKEN_ENV})")
        if self._route() is None:
            return HTTPStatus.NOT_FOUND, f"no route {self.command} {self.path}"
        if "Transfer-Encoding" in self.headers:
            return HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length header, not Transfer-Encoding"
        length = self._content_length()
        if length is None:
            return HTTPStatus.BAD_REQUEST, f"Content-Length {self.headers['Content-Length']!r} is not a byte count"
        if length > self.server.max_body_bytes:
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, (
                f"the body is {length} bytes, over this server's limit of {self.server.max_body_bytes}; "
                "send fewer prompts per request or raise plait vllm-serve --max-body-bytes")
        return None

    def _content_length(self) -> int | None:
        values = self.headers.get_all("Content-Length") or ["0"]
        text = values[0].strip()
        return int(text) if len(values) == 1 and text.isascii() and text.isdigit() else None

    def _read_body(self, length: int) -> bytes:
        """The body, which must arrive in full within ``body_timeout`` seconds: one deadline for
        the whole read, so a client trickling a byte at a time cannot outlast it."""
        deadline = time.monotonic() + self.server.body_timeout
        body = bytearray()
        try:
            while len(body) < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(left)
                chunk = self.rfile.read1(min(length - len(body), 2**20))
                if not chunk:
                    raise ConnectionResetError
                body += chunk
        finally:
            self.connection.settimeout(self.timeout)
        return bytes(body)

    def _refuse(self, status: HTTPStatus, message: str) -> None:
        """Answer and close without taking in the body; first discard a little of what the client
        may still be sending, so it reads this answer rather than a connection reset."""
        self.close_connection = True
        self._reply(status, {"error": message})
        try:
            self.connection.shutdown(socket.SHUT_WR)
            deadline, drained = time.monotonic() + LINGER_SECONDS, 0
            while drained < LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(2**16)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass

    def _authorised(self) -> bool:
        token = self.server.token
        if not token:
            return True
        sent = self.headers.get("Authorization", "")
        return hmac.compare_digest(sent.encode(), f"Bearer {token}".encode())

    def _reply(self, status: HTTPStatus, payload: dict) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True  # the client stopped waiting (e.g. a health poll while engines started)

    # -- routes -------------------------------------------------------------------------------
    @property
    def pool(self) -> EnginePool:
        return self.server.pool

    def health(self, body: dict) -> dict:
        pool = self.pool
        return {"status": "ok", "model": self.server.model, "world_size": pool.world_size,
                "data_parallel_size": pool.engines, "tensor_parallel_size": pool.args.tensor_parallel_size,
                "weight_backend": pool.weight_backend, "devices": pool.devices,
                "max_body_bytes": self.server.max_body_bytes}

    def generate(self, body: dict) -> dict:
        from plait.generation import SamplingParams, encode_prompts

        prompts = body["prompts"]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("'prompts' must be a non-empty list of token-id lists, strings or message lists")
        sampling = dict(body.get("sampling") or {})
        SamplingParams(**sampling)  # validate here: a bad field is a 400 naming it
        needs_tokenizer = any(not (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompts)
        ids = encode_prompts(_tokenizer(self.server.model) if needs_tokenizer else None, prompts)
        return self.pool.generate(ids, sampling, [int(t) for t in body.get("stop_token_ids") or []])

    def init_communicator(self, body: dict) -> dict:
        # the store listens where this server does (loopback by default), never on every interface
        self.pool.join(self.server.server_address[0], int(body["port"]), float(body.get("timeout", 300)))
        return {"world_size": self.pool.world_size + 1}

    def update_weights(self, body: dict) -> dict:
        seconds = self.pool.broadcast("receive", body["layout"])
        return {"seconds": max(seconds)}

    def reset_prefix_cache(self, body: dict) -> dict:
        self.pool.broadcast("reset")
        return {"status": "ok"}

    def close_communicator(self, body: dict) -> dict:
        self.pool.broadcast("leave")
        return {"status": "ok"}


@functools.lru_cache(maxsize=1)
def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@hookimpl
def register_commands(register):
    register("command.vllm-serve", Command(run, add_arguments, help="serve a model with vLLM for online training "
                                                                     "(generation.vllm_server)"))
