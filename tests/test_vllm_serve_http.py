"""`plait vllm-serve`'s HTTP layer on real sockets.

Every request is judged from its headers before a byte of its body is read (token, route, size,
framing); the request line and headers must arrive within ``--header-timeout`` all told and a
body within ``--body-timeout``; connections beyond ``--max-connections`` get 503; a join request
and a weight layout are checked (port, timeout, session prefix; the model's own parameter names,
shapes and dtypes) before an engine sees them; the weight-sync store listens on the one address
the client reached, never on every interface; the token is generated into a file of the user's
alone when none is given; and every client request has a deadline.

vLLM does not install in this venv (docs/vllm.md), so the engines are stood in for: an
:class:`EnginePool` whose one engine runs in this process, echoing prompts back and joining the
weight-sync group and receiving weights through the real ``WorkerExtension`` code, as a vLLM
worker does. The server, its sockets, the client and the process group are real;
tests/test_vllm_server.py runs the whole thing with vLLM.
"""

import argparse
import contextlib
import http.client
import json
import socket
import stat
import threading
import time

import psutil
import pytest
import torch
from _http import request_json
from transformers import AutoModelForCausalLM

from plait.errors import PlaitError
from plait.online.generation import SamplingParams
from plait.online.weights import policy_parameters
from plait.plugins.generation._vllm import (
    WorkerExtension,
    bucket_layout,
    session_prefix,
    token_path,
    write_token,
)
from plait.plugins.generation.vllm_serve import EnginePool, GenerationServer, add_arguments, server_token
from plait.plugins.generation.vllm_server import VLLMClient
from plait.testing.tiny_model import tiny_model_path

TOKEN = "s3cret-for-tests"
LIMIT = 4096  # bytes, the body limit of the servers below unless a test says otherwise


class StandInWorker(WorkerExtension):
    """What ``WorkerExtension`` needs of a vLLM worker to join the weight group (its rank) and to
    take weights (a reload: here the received tensors are kept)."""

    rank = 0

    def plait_load_weights(self, weights) -> None:
        self.loaded = {name: tensor.clone() for name, tensor in weights}


class StandInPool(EnginePool):
    """An engine pool of one in-process engine: generate echoes each prompt reversed; join,
    receive and leave run the real weight-group code of a vLLM worker. ``commands`` lists what
    reached the engine."""

    def start(self) -> None:
        self.worker = StandInWorker()
        self.commands = []

    def call(self, command: str, per_engine: list[tuple]) -> list:
        (arguments,) = per_engine
        self.commands.append((command, arguments))
        return [getattr(self, f"_{command}")(*arguments)]

    def _receive(self, layout):
        self.worker.plait_receive_weights(layout)
        return 0.0

    def _generate(self, prompt_ids, sampling, stop):
        return {"prompt_ids": prompt_ids, "completion_ids": [ids[::-1] for ids in prompt_ids],
                "texts": [""] * len(prompt_ids), "logprobs": [[0.0] * len(ids) for ids in prompt_ids],
                "finished": [True] * len(prompt_ids)}

    def _join(self, *arguments):
        return self.worker.plait_join_weight_group(*arguments)

    def _leave(self):
        return self.worker.plait_leave_weight_group()

    def _reset(self):
        return None


@contextlib.contextmanager
def serving(host: str = "127.0.0.1", **options):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    pool = StandInPool(parser.parse_args(["--model", "stand-in"]))
    pool.start()
    server = GenerationServer((host, 0), pool, model=str(tiny_model_path()), **{
        "token": TOKEN, "max_body_bytes": LIMIT, "body_timeout": 1.0, "header_timeout": 1.0, **options})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def connect(server) -> socket.socket:
    return socket.create_connection(server.server_address, timeout=10)


def head(route="/generate", length=0, token=TOKEN, extra=()) -> bytes:
    lines = [f"POST {route} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join([*lines, *extra]) + "\r\n\r\n").encode()


def read_response(sock) -> tuple[int, http.client.HTTPMessage, dict]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.headers, json.loads(response.read())


def post(server, route, body: bytes, token=TOKEN) -> tuple[int, dict]:
    host, port = server.server_address
    return request_json(f"http://{host}:{port}{route}", token=token, data=body, timeout=10)


def generate_body(size: int) -> bytes:
    """A /generate body of exactly ``size`` bytes (one prompt of token ids, padded with spaces)."""
    body = json.dumps({"prompts": [[7] * (size // 4)], "sampling": {"max_completion_length": 4}})
    return (body[:-1] + " " * (size - len(body)) + "}").encode()


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing", "wrong"])
def test_a_request_without_the_token_is_refused_before_its_body_is_read(token):
    length = 48 * 2**20  # under this server's size limit: only the token refuses it
    with serving(max_body_bytes=64 * 2**20) as server, connect(server) as sock:
        sock.sendall(head(length=length, token=token))
        status, headers, reply = read_response(sock)  # answered while not one body byte was sent
        assert status == 401 and "Authorization: Bearer <token>" in reply["error"]
        assert headers["Connection"] == "close"
        sent, chunk, start = 0, b"x" * 2**16, time.monotonic()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while sent < length:  # send the body anyway: the server has stopped reading
                sock.sendall(chunk)
                sent += len(chunk)
        print(f"\nrefused before the body; the connection broke after {sent / 2**20:.1f} of {length / 2**20:.0f} MiB "
              f"sent (socket buffers and the bounded drain), {time.monotonic() - start:.2f} s")
        assert sent < length / 4


def test_an_oversized_body_is_413_before_it_is_read():
    with serving() as server:
        with connect(server) as sock:
            sock.sendall(head(length=LIMIT + 1))
            status, _, reply = read_response(sock)
        assert status == 413
        assert reply == {"error": f"the body is {LIMIT + 1} bytes, over this server's limit of {LIMIT}; "
                                  "send fewer prompts per request or raise plait vllm-serve --max-body-bytes"}

        # a client that sends the whole body before reading (urllib) still reads the refusal
        assert post(server, "/generate", generate_body(LIMIT + 100))[0] == 413
        status, rows = post(server, "/generate", generate_body(LIMIT))
        assert status == 200 and rows["completion_ids"] == [[7] * (LIMIT // 4)]

        # plait's own client knows the limit from /health and says so without sending
        client = VLLMClient(host="127.0.0.1", port=server.server_address[1], token=TOKEN)
        assert client.wait_until_ready()["max_body_bytes"] == LIMIT
        assert client.generate([[3, 2, 1]], SamplingParams(), [0])["completion_ids"] == [[1, 2, 3]]
        with pytest.raises(PlaitError, match=f"POST /generate would send .* bytes to the vLLM server at "
                                             rf".*, over its limit of {LIMIT}; raise it \(plait vllm-serve "
                                             r"--max-body-bytes\)"):
            client.generate([[7] * LIMIT], SamplingParams(), [0])


def test_a_stalled_body_is_408_within_the_timeout():
    with serving(body_timeout=1.0) as server, connect(server) as sock:
        sock.sendall(head(length=100) + b'{"prompts": [[1, ')  # then nothing
        start = time.monotonic()
        status, headers, reply = read_response(sock)
        waited = time.monotonic() - start
    assert status == 408 and headers["Connection"] == "close"
    assert reply["error"] == "the request body did not arrive within 1 s (plait vllm-serve --body-timeout)"
    assert 0.9 <= waited < 3, waited


def test_a_trickled_body_is_408_within_the_timeout():
    """A byte every 0.2 s: every read returns quickly, only a deadline on the whole body ends it."""
    stop = threading.Event()

    def trickle(sock):
        while not stop.wait(0.2):
            try:
                sock.send(b" ")
            except OSError:
                return

    with serving(body_timeout=1.0) as server, connect(server) as sock:
        sock.sendall(head(length=1000))
        sender = threading.Thread(target=trickle, args=(sock,))
        sender.start()
        start = time.monotonic()
        try:
            status, _, _ = read_response(sock)
        finally:
            stop.set()
            sender.join()
        waited = time.monotonic() - start
    assert status == 408
    assert 0.9 <= waited < 3, waited


def test_a_stalled_request_head_is_dropped_within_the_timeout():
    with serving(header_timeout=1.0) as server, connect(server) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: te")  # then nothing
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - start < 3


@pytest.mark.parametrize("request_head, status, says", [
    (head("/nowhere", length=2**30), 404, "no route POST /nowhere"),
    (head(length="12abc"), 400, "Content-Length '12abc' is not a byte count"),
    (head(length=-5), 400, "Content-Length '-5' is not a byte count"),
    (head(length=None, extra=["Transfer-Encoding: chunked"]), 411, "send the body with a Content-Length header"),
], ids=["unknown-route", "garbled-length", "negative-length", "chunked"])
def test_requests_are_refused_from_their_headers(request_head, status, says):
    with serving() as server, connect(server) as sock:
        sock.sendall(request_head)  # no body follows: the answer must not wait for one
        got, headers, reply = read_response(sock)
    assert (got, headers["Connection"]) == (status, "close")
    assert says in reply["error"]


def test_expect_100_continue_is_answered_from_the_headers():
    with serving() as server:
        with connect(server) as sock:  # refused: the client is never invited to send its body
            sock.sendall(head(length=10, token="wrong", extra=["Expect: 100-continue"]))
            assert read_response(sock)[0] == 401
        with connect(server) as sock:
            sock.sendall(head("/reset_prefix_cache", length=2, extra=["Expect: 100-continue"]))
            assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(b"{}")
            status, _, reply = read_response(sock)
            assert (status, reply) == (200, {"status": "ok"})


def listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def client_of(server, host="127.0.0.1", **options) -> VLLMClient:
    return VLLMClient(host=host, port=server.server_address[1], **{"token": TOKEN, "connection_timeout": 30, **options})


@pytest.mark.parametrize("bind, reach", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.2")])
def test_the_weight_sync_store_listens_on_the_address_the_client_reached(bind, reach):
    """Under --host 0.0.0.0 the store once listened on every interface; now on the one the
    authenticated client's request arrived at, under a secret prefix of its session."""
    with serving(bind) as server:
        prefixes = []
        for _ in range(2):
            client = client_of(server, reach, group_port=free_port(reach))
            client.wait_until_ready()
            client.init_weight_group()  # the stand-in worker hosts the store, as vLLM's worker 0 does
            try:
                assert listening_addresses(client.group_port) == {reach}
            finally:
                client.close()
            (host, port, _, _, _, _, prefix), = [a for c, a in server.pool.commands if c == "join"][-1:]
            assert (host, port) == (reach, client.group_port)
            prefixes.append(prefix)
        assert prefixes[0] != prefixes[1] and all(p.startswith("plait-weights-") for p in prefixes)


@pytest.fixture(scope="module")
def tiny_model():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)


def test_weights_pushed_through_the_front_arrive_intact(tiny_model):
    with serving() as server:
        client = client_of(server, group_port=free_port("127.0.0.1"))
        with policy_parameters(tiny_model) as named:
            client.update_weights(named)
            loaded = server.pool.worker.loaded
            assert list(loaded) == [name for name, _ in named]
            assert all(torch.equal(loaded[name], param) for name, param in named)
        client.close()


def tiny_layout(tiny_model) -> list[dict]:
    with policy_parameters(tiny_model) as named:
        return bucket_layout(named, limit=2**16)


def with_entry(layout, bucket, index, position, value) -> list[dict]:
    changed = json.loads(json.dumps(layout))
    changed[bucket]["params"][index][position] = value
    return changed


@pytest.mark.parametrize("change, says", [
    (lambda l: with_entry(l, 0, 0, 0, "lm_head.evil"), "'lm_head.evil' is not a parameter of this server's model"),
    (lambda l: with_entry(l, 0, 0, 1, [2**40]), "has shape"),
    (lambda l: with_entry(l, 1, 1, 2, 0), "must start at"),
    (lambda l: [{**l[0], "numel": 2**50}, *l[1:]], "numel must be"),
    (lambda l: [{**l[0], "dtype": "float64"}, *l[1:]], "dtype 'float64' is not one of"),
    (lambda l: [{**l[0], "dtype": "save"}, *l[1:]], "dtype 'save' is not one of"),
    (lambda l: l + l[:1], "is sent twice"),
    (lambda l: {"a": 1}, "'layout' must be a list"),
    (lambda l: [{"dtype": "float32", "numel": 1, "params": [["x"]]}], "each param must be [name, shape, offset]"),
], ids=["unknown-name", "huge-shape", "overlap", "huge-numel", "float64", "not-a-dtype", "twice", "not-a-list",
        "short-entry"])
def test_a_layout_that_is_not_the_models_is_refused_before_an_engine_allocates(tiny_model, change, says):
    with serving() as server:
        status, reply = post(server, "/update_weights", json.dumps({"layout": change(tiny_layout(tiny_model))}).encode())
    assert status == 400 and says in reply["error"]
    assert server.pool.commands == []  # nothing reached the engine


@pytest.mark.parametrize("body, says", [
    ({"port": "51216", "prefix": session_prefix()}, "'port' must be a port number"),
    ({"port": 70000, "prefix": session_prefix()}, "'port' must be a port number"),
    ({"port": True, "prefix": session_prefix()}, "'port' must be a port number"),
    ({"port": 51216, "timeout": 1e9, "prefix": session_prefix()}, "'timeout' must be seconds"),
    ({"port": 51216, "timeout": -1, "prefix": session_prefix()}, "'timeout' must be seconds"),
    ({"port": 51216}, "'prefix' must be a fresh session prefix"),
    ({"port": 51216, "prefix": "plait-weights"}, "'prefix' must be a fresh session prefix"),
], ids=["port-text", "port-range", "port-bool", "timeout-huge", "timeout-negative", "no-prefix", "constant-prefix"])
def test_a_join_request_is_checked_before_the_engines_join(body, says):
    with serving() as server:
        status, reply = post(server, "/init_communicator", json.dumps(body).encode())
    assert status == 400 and says in reply["error"]
    assert server.pool.commands == []


@pytest.mark.parametrize("route", ["/update_weights", "/init_communicator", "/close", "/reset_prefix_cache"])
def test_calls_that_change_the_engines_need_the_token(route):
    body = {"layout": [], "port": 51216, "prefix": session_prefix()}
    with serving() as server:
        assert [post(server, route, json.dumps(body).encode(), token=t)[0] for t in ("", "wrong")] == [401, 401]
    assert server.pool.commands == []


def test_a_server_made_without_a_token_refuses_everything():
    with serving(token=None) as server:
        assert post(server, "/close", b"{}", token="None")[0] == 401


def test_a_trickled_request_head_is_dropped_at_one_deadline():
    """Slowloris: a header line every 0.2 s; each read is quick, only the one deadline ends it."""
    with serving(header_timeout=1.0) as server, connect(server) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\n")
        start, dropped = time.monotonic(), False
        while time.monotonic() - start < 5 and not dropped:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                dropped = True
            time.sleep(0.2)
        held = time.monotonic() - start
    print(f"\na client trickling its headers was dropped after {held:.1f} s")
    assert dropped and held < 2.5


def test_connections_beyond_the_limit_get_503_until_one_frees():
    with serving(max_connections=2, header_timeout=5.0) as server:
        idle = [connect(server) for _ in range(2)]  # each holds a slot, saying nothing
        time.sleep(0.2)
        with connect(server) as sock:
            sock.sendall(head("/reset_prefix_cache", length=2) + b"{}")
            status, headers, reply = read_response(sock)
        assert status == 503 and "--max-connections" in reply["error"]
        idle.pop().close()  # its handler sees the end and frees the slot
        client = client_of(server)  # plait's client tries a 503 again
        client.reset_prefix_cache()
        for sock in idle:
            sock.close()


def hung_server() -> socket.socket:
    """A socket that accepts connections (the kernel does) and never answers."""
    return socket.create_server(("127.0.0.1", 0))


@pytest.mark.parametrize("call", [
    lambda c: c.generate([[1, 2]], SamplingParams(), [0]),
    lambda c: c.reset_prefix_cache(),
    lambda c: c._request("POST", "/update_weights", {"layout": []}, idempotent=False),
    lambda c: c._request("POST", "/init_communicator", {"port": 1}, idempotent=False),
], ids=["generate", "reset", "update_weights", "init_communicator"])
def test_every_client_request_has_a_deadline(call):
    with hung_server() as hung:
        client = VLLMClient(port=hung.getsockname()[1], token=TOKEN, request_timeout=1.0)
        start = time.monotonic()
        with pytest.raises(PlaitError, match=r"did not answer POST /\w+ within 1 s; it is hung or overloaded "
                                             r"\(raise vllm_server_request_timeout"):
            call(client)
        assert time.monotonic() - start < 3  # no second try: a hung server would only be waited on again


def serve_arguments(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "unused", "--port", "8123", *flags])


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("PLAIT_VLLM_TOKEN", raising=False)
    return tmp_path


def test_a_token_is_generated_into_a_file_local_clients_find(runtime_dir):
    token, path = server_token(serve_arguments())
    assert path == token_path(8123) == runtime_dir / "plait" / f"vllm-serve-{socket.gethostname()}-8123.token"
    assert len(token) >= 40
    with serving(token=token) as server:
        port = server.server_address[1]
        generated = token_path(port)
        write_token(generated, token)  # as `plait vllm-serve --port PORT` does once it listens
        assert stat.S_IMODE(generated.stat().st_mode) == 0o600
        assert stat.S_IMODE(generated.parent.stat().st_mode) == 0o700
        assert VLLMClient(port=port).wait_until_ready()["status"] == "ok"  # found, no token configured
        assert VLLMClient(host="192.0.2.1", port=port).credentials()[0] is None  # never sent to another machine
        write_token(generated, "stale")
        with pytest.raises(PlaitError, match=f"refused GET /health \\(401\\).*this client's token: {generated}"):
            VLLMClient(port=port).health()


def test_token_flags(runtime_dir, capsys, monkeypatch):
    assert server_token(serve_arguments("--token", "abc")) == ("abc", None)
    assert "--token is visible to every user of this machine (ps" in capsys.readouterr().err
    chosen = runtime_dir / "mine.token"
    token, path = server_token(serve_arguments("--token-file", str(chosen)))
    assert path == chosen  # missing: generated into it
    chosen.write_text("from-the-file\n")
    chosen.chmod(0o644)
    with pytest.raises(PlaitError, match="open to other users .*-rw-r--r--.*chmod 600"):
        server_token(serve_arguments("--token-file", str(chosen)))
    chosen.chmod(0o600)
    assert server_token(serve_arguments("--token-file", str(chosen))) == ("from-the-file", None)
    client = VLLMClient(port=1, token_file=str(chosen))
    assert client.credentials() == ("from-the-file", f"vllm_server_token_file {chosen}")
    monkeypatch.setenv("PLAIT_VLLM_TOKEN", "from-env")
    assert server_token(serve_arguments()) == ("from-env", None)


def test_a_sigterm_while_a_connection_thread_starts_still_stops_the_server(monkeypatch):
    """The serve commands' SIGTERM handler raises SystemExit wherever the main thread is. Landing in the
    start of a connection's thread, it must end the server (the thread gives its own slot back), not turn
    into socketserver's logged ValueError for a slot released twice, after which the server served on."""
    import http.server

    from plait.serving import BoundedServer

    server = BoundedServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler, who="test", token="t",
                           max_connections=2, header_timeout=1.0, max_body_bytes=1024, body_timeout=1.0)
    start = threading.Thread.start

    def start_then_signal(thread):
        start(thread)
        thread.join()  # the connection's thread has served and given its slot back ...
        raise SystemExit(0)  # ... when the signal lands in Thread.start

    ours, theirs = socket.socketpair()
    theirs.close()  # the handler reads an empty request and returns
    monkeypatch.setattr(threading.Thread, "start", start_then_signal)
    try:
        with pytest.raises(SystemExit):
            server.process_request(ours, ("127.0.0.1", 0))
    finally:
        monkeypatch.undo()
        for thread in list(server._threads):
            thread.join(timeout=5)
        server.server_close()
    assert server.slots.acquire(blocking=False) and server.slots.acquire(blocking=False)  # both slots back
    assert not server.slots.acquire(blocking=False)  # and no third
