"""`plait vllm-serve`'s HTTP layer on real sockets.

Every request is judged from its headers before a byte of its body is read (token, route, size,
framing); a body must arrive in full within ``--body-timeout``; the weight-sync store listens on
the server's own address, never on every interface.

vLLM does not install in this venv (docs/vllm.md), so the engines are stood in for: an
:class:`EnginePool` whose one engine runs in this process, echoing prompts back and joining the
weight-sync group through the real ``WorkerExtension`` code, as a vLLM worker does. The server,
its sockets, the client and the process group are real; tests/test_vllm_server.py runs the whole
thing with vLLM.
"""

import argparse
import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from plait.errors import PlaitError
from plait.generation import SamplingParams
from plait.plugins.generation._vllm import WorkerExtension
from plait.plugins.generation.vllm_server import VLLMClient
from plait.plugins.generation.vllm_serve import EnginePool, GenerationServer, add_arguments

TOKEN = "s3cret-for-tests"
LIMIT = 4096  # bytes, the body limit of the servers below unless a test says otherwise


class StandInWorker(WorkerExtension):
    """What ``WorkerExtension`` needs of a vLLM worker to join the weight group: its rank."""

    rank = 0


class StandInPool(EnginePool):
    """An engine pool of one in-process engine: generate echoes each prompt reversed; join and
    leave run the real weight-group code of a vLLM worker."""

    def start(self) -> None:
        self.worker = StandInWorker()

    def call(self, command: str, per_engine: list[tuple]) -> list:
        (arguments,) = per_engine
        return [getattr(self, f"_{command}")(*arguments)]

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
    server = GenerationServer((host, 0), pool, model="stand-in", token=TOKEN,
                              **{"max_body_bytes": LIMIT, "body_timeout": 1.0, **options})
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
    request = urllib.request.Request(f"http://{host}:{port}{route}", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


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
    with serving(body_timeout=1.0) as server, connect(server) as sock:
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


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_the_weight_sync_store_listens_on_the_server_host_only(host):
    with serving(host) as server:
        client = VLLMClient(host=host, port=server.server_address[1], token=TOKEN, group_port=free_port(host),
                            connection_timeout=30)
        client.wait_until_ready()
        client.init_weight_group()  # the stand-in worker hosts the store, as vLLM's worker 0 does
        try:
            assert listening_addresses(client.group_port) == {host}
        finally:
            client.close()
