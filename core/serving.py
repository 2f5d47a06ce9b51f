"""The hardened JSON-over-HTTP front that plait's servers share (``plait vllm-serve``, ``plait reward-serve``).

A server built on :class:`BoundedServer` and :class:`JsonHandler` answers only requests that carry
``Authorization: Bearer <token>``, serves at most ``max_connections`` at once (more get 503), gives
the request line and headers ``header_timeout`` seconds all told and the body ``body_timeout``,
and judges each request from its headers before reading its body (401, 404, 411, 413). A subclass
of the handler names its ``routes`` and implements each as ``method(body) -> dict``.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import ipaddress
import json
import math
import os
import secrets
import socket
import stat
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from plait.errors import PlaitError

HEADER_TIMEOUT = 10.0  # seconds for the request line and all headers together: a few hundred bytes
MAX_CONNECTIONS = 32  # open at once
# After refusing a request whose body was not read, the client may still be sending: discard at
# most this much, this long, so it can read the refusal instead of a reset (RFC 9112 section 9.6).
LINGER_BYTES, LINGER_SECONDS = 2**20, 1.0


def check_limits(args) -> None:
    """One-line errors for the limit flags every server takes (``add_limit_arguments``)."""
    for flag in ("port", "max_body_bytes", "max_connections"):
        if getattr(args, flag) < 1:
            raise PlaitError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be at least 1")
    for flag in ("header_timeout", "body_timeout"):
        if not 0 < getattr(args, flag) < math.inf:
            raise PlaitError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be a positive number of seconds")


def add_limit_arguments(parser, *, max_body_bytes: int, body_timeout: float) -> None:
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help=f"connections served at once; more are answered 503 (default {MAX_CONNECTIONS})")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                        help="seconds the request line and headers may take to arrive, all together (default 10)")
    parser.add_argument("--max-body-bytes", type=int, default=max_body_bytes,
                        help=f"largest request body accepted; larger ones get 413 before they are read "
                             f"(default {max_body_bytes})")
    parser.add_argument("--body-timeout", type=float, default=body_timeout,
                        help=f"seconds a request body may take to arrive in full; slower clients get 408 "
                             f"(default {body_timeout:g})")


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is this machine's loopback."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def write_token(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` for this user alone (file 0600, a folder made here 0700); a
    reader sees the old file or the new one, never half of it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    with os.fdopen(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w") as out:
        out.write(token + "\n")
    os.replace(staged, path)


def read_token(path: str | os.PathLike) -> str:
    """The token in ``path``, which must be this user's and closed to others (as ssh treats a key)."""
    path = Path(path).expanduser()
    try:
        info, text = path.stat(), path.read_text().strip()
    except OSError as err:
        raise PlaitError(f"cannot read the server token file {path} ({err.strerror})") from None
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PlaitError(f"the server token file {path} is open to other users (mode "
                         f"{stat.filemode(info.st_mode)}, owner uid {info.st_uid}); make it yours with chmod 600")
    if not text:
        raise PlaitError(f"the server token file {path} is empty")
    return text


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server with a token and limits; ``who`` (the command) names it in messages."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler, *, who: str, token: str, max_connections: int,
                 header_timeout: float, max_body_bytes: int, body_timeout: float):
        super().__init__(address, handler)
        self.who, self.token = who, token
        self.slots = threading.BoundedSemaphore(max_connections)
        self.header_timeout, self.max_body_bytes, self.body_timeout = header_timeout, max_body_bytes, body_timeout
        busy = json.dumps({"error": f"the server is at its connection limit ({who} --max-connections); retry"}).encode()
        self.busy_reply = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                           b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(busy), busy))

    def process_request(self, request, client_address) -> None:
        """Serve the connection in a thread of its own if a slot is free, else answer 503 and close."""
        if not self.slots.acquire(blocking=False):
            try:  # a fresh socket's send buffer takes these few bytes at once: nothing here can block
                request.setblocking(False)
                request.send(self.busy_reply)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            # The server's SIGTERM handler raises SystemExit wherever the main thread is, also while the new
            # thread is starting; that thread then runs and gives its slot back itself. A second release
            # here raised ValueError, which socketserver logs and serves on: the server did not exit.
            with contextlib.suppress(ValueError):
                self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class DeadlineReader(io.RawIOBase):
    """A socket's receiving side where every read shares one ``deadline`` (time.monotonic()),
    so a client that trickles a byte at a time cannot outlast it: a plain socket timeout starts
    afresh with every byte."""

    def __init__(self, sock: socket.socket):
        self.sock, self.deadline = sock, math.inf

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self.sock.settimeout(None if left == math.inf else left)
        return self.sock.recv_into(buffer)


class JsonHandler(BaseHTTPRequestHandler):
    """JSON requests and answers under :class:`BoundedServer`'s limits. ``routes`` maps
    ``(method, path)`` to the name of a method ``(body: dict) -> dict``; ``token_hint`` says where the
    token comes from. A route raising ValueError, TypeError, KeyError or PlaitError is a 400."""

    protocol_version = "HTTP/1.1"
    routes: dict[tuple[str, str], str] = {}
    token_hint = "the server's token"
    too_large_hint = "send less per request"

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # every read goes through one deadline instead
        self.reader = DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self) -> None:
        """One request, whose request line and headers must all arrive within ``header_timeout``
        (BaseHTTPRequestHandler drops the connection when they do not)."""
        self.reader.deadline = time.monotonic() + self.server.header_timeout
        super().handle_one_request()

    def log_message(self, format, *args) -> None:  # one line per request on stderr, without the host
        sys.stderr.write(f"{self.server.who}: {format % args}\n")

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
                                f"{self.server.body_timeout:g} s ({self.server.who} --body-timeout)")
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
                                             f"<token>' ({self.token_hint})")
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
                f"{self.too_large_hint} or raise {self.server.who} --max-body-bytes")
        return None

    def _content_length(self) -> int | None:
        values = self.headers.get_all("Content-Length") or ["0"]
        text = values[0].strip()
        return int(text) if len(values) == 1 and text.isascii() and text.isdigit() else None

    def _read_body(self, length: int) -> bytes:
        """The body, which must arrive in full within ``body_timeout`` seconds of the headers' end."""
        self.reader.deadline = time.monotonic() + self.server.body_timeout
        body = self.rfile.read(length)
        if len(body) < length:
            raise ConnectionResetError
        return body

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
        sent = self.headers.get("Authorization", "")
        return bool(token) and hmac.compare_digest(sent.encode(), f"Bearer {token}".encode())

    def _reply(self, status: HTTPStatus, payload: dict) -> None:
        data = json.dumps(payload).encode()
        try:
            # a client that does not read its answer is dropped too
            self.connection.settimeout(self.server.body_timeout)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True  # the client stopped waiting


def token_path(server: str, port: int) -> Path:
    """Where ``plait <server> --port PORT`` writes the token it generates, and where clients of a loopback
    server look for it: ``$XDG_RUNTIME_DIR/plait/`` (per user, emptied at logout), else plait's cache
    folder (:func:`plait.paths.cache_dir`), as ``<server>-<machine name>-<port>.token`` (the machine's name
    keeps servers apart when machines share a home folder)."""
    from plait.paths import cache_dir

    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "plait" if runtime else cache_dir()
    return folder / f"{server}-{socket.gethostname()}-{port}.token"


def check_bind(host: str, token: str | None, token_env: str) -> None:
    """Refuse to listen beyond loopback without a token the operator chose: a generated token lives in a
    file on this machine that remote clients cannot read."""
    if not token and not is_loopback(host):
        raise PlaitError(f"--host {host} listens beyond this machine; pass --token-file PATH (or {token_env}) "
                         "and give the token to your clients, or bind --host 127.0.0.1")


def server_token(token_file: str | None, token_env: str, generated: Path) -> tuple[str, Path | None]:
    """The token a server requires, and the file to write it into (None: it is there already or the
    operator holds it). In order: ``--token-file`` (read, or generated into when missing), the
    ``token_env`` variable, a fresh token for the file ``generated`` (see :func:`token_path`)."""
    if token_file:
        path = Path(token_file).expanduser()
        return (read_token(path), None) if path.exists() else (secrets.token_urlsafe(32), path)
    if os.environ.get(token_env):
        return os.environ[token_env], None
    return secrets.token_urlsafe(32), generated
