"""``remote``: a reward scored by ``plait reward-serve`` on this machine or another.

``{name: remote, url: http://host:8001, token_file: PATH, reward: NAME}`` posts each batch's
prompts, completions, completion ids and JSON-able dataset columns to the server's ``/score`` and
returns its scores. ``reward`` picks one of the served rewards (needed when it serves several).
The token is ``token_file``'s, else PLAIT_REWARD_TOKEN, else (a loopback server) the one the
server wrote for its port (:func:`plait.serving.token_path`).

Each request gets ``timeout`` seconds; a refused connection, a timeout or a 502/503/504 is retried
``retries`` times, ``backoff`` seconds apart (doubling). What still fails raises, and the run's
``reward_error_policy`` decides: ``fail`` stops with the reason, ``none`` scores the batch None. A
server found dead is not asked again for ``backoff * 2**retries`` seconds, so the per-example retry
that follows a failed batch ends at once. A wrong token or a malformed request is a configuration
error and always stops the run.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import attrs

from plait import hookimpl
from plait.errors import PlaitError
from plait.serving import is_loopback, read_token, token_path

TOKEN_ENV = "PLAIT_REWARD_TOKEN"
RETRIED = (502, 503, 504)


def _http_url(instance, attribute, value) -> None:
    parts = urllib.parse.urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url={value!r} must be the server's address, e.g. http://127.0.0.1:8001")


def _seconds(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{attribute.name}={value!r} must be a positive number of seconds")


def _count(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name}={value!r} must be a whole number >= 0")


@attrs.frozen
class Remote:
    """Parameters of ``reward.remote``."""

    url: str = attrs.field(validator=_http_url)
    token_file: str | None = None
    reward: str | None = None
    timeout: float = attrs.field(default=60.0, validator=_seconds)
    retries: int = attrs.field(default=2, validator=_count)
    backoff: float = attrs.field(default=0.5, validator=_seconds)


class RemoteReward:
    """The reward function: one POST /score per call (see the module's docstring)."""

    __name__ = "remote"

    def __init__(self, params: Remote):
        self.params = params
        self.url = params.url.rstrip("/") + "/score"
        self._token = read_token(params.token_file) if params.token_file else os.environ.get(TOKEN_ENV)
        self._down_until, self._last_failure = 0.0, ""
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # another process (an async rollout worker) gets the parameters and token, and a lock of its own
        return {k: v for k, v in vars(self).items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state, _lock=threading.Lock())

    def token(self) -> str | None:
        if self._token is None:
            parts = urllib.parse.urlsplit(self.params.url)
            path = token_path("reward-serve", parts.port or 80)
            if is_loopback(parts.hostname) and path.exists():
                self._token = read_token(path)
        return self._token

    def __call__(self, prompts: list, completions: list, completion_ids=None, **columns) -> list:
        ids = None if completion_ids is None else [[int(t) for t in row] for row in completion_ids]
        body = {"prompts": prompts, "completions": completions, "reward": self.params.reward, "completion_ids": ids,
                "columns": {k: v for k, v in columns.items() if k not in ("trainer_state", "log_extra", "log_metric")
                            and _jsonable(v)}}
        return self._post(json.dumps(body).encode())["scores"]

    def _post(self, data: bytes) -> dict:
        p = self.params
        with self._lock:
            if time.monotonic() < self._down_until:
                raise ConnectionError(f"{self._last_failure}; not asked again for {p.backoff * 2**p.retries:g} s")
        headers = {"Content-Type": "application/json"}
        if self.token():
            headers["Authorization"] = f"Bearer {self.token()}"
        for attempt in range(p.retries + 1):
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=p.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as err:
                reason = _error_text(err)
                if err.code in (401, 403, 404, 413) or err.code == 400:
                    raise PlaitError(f"reward server {p.url} refused the request ({err.code}: {reason}); "
                                     + _fix(err.code)) from None
                if err.code not in RETRIED:
                    raise RuntimeError(f"reward server {p.url} answered {err.code}: {reason}") from None
                failure: Exception = ConnectionError(f"reward server {p.url} answered {err.code}: {reason}")
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError) as err:
                failure = ConnectionError(f"reward server {p.url} did not answer "
                                          f"({getattr(err, 'reason', err)}) after {attempt + 1} attempt(s)")
            if attempt < p.retries:
                time.sleep(p.backoff * 2**attempt)
        with self._lock:
            self._down_until, self._last_failure = time.monotonic() + p.backoff * 2**p.retries, str(failure)
        raise failure


def _fix(code: int) -> str:
    return {401: "set token_file to the server's --token-file (or PLAIT_REWARD_TOKEN)",
            403: "set token_file to the server's --token-file (or PLAIT_REWARD_TOKEN)",
            404: "check url: it must be a plait reward-serve address",
            413: "use a smaller per-device batch, or raise plait reward-serve --max-body-bytes"}.get(
                code, "check the reward's 'reward' name and the dataset's columns")


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        return json.loads(err.read()).get("error", "")
    except (ValueError, OSError, AttributeError):
        return err.reason


def _jsonable(values) -> bool:
    try:
        json.dumps(values)
    except (TypeError, ValueError):
        return False
    return True


def make_remote(params: Remote) -> RemoteReward:
    return RemoteReward(params)


@hookimpl
def register_rewards(register):
    register("reward.remote", make_remote, params=Remote,
             doc="a reward scored by plait reward-serve: {name: remote, url: http://host:8001, token_file: PATH}")
