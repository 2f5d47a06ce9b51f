"""A JSON request to a test server on loopback, as the servers' clients make them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def request_json(url: str, body=None, token: str | None = None, *, data: bytes | None = None,
                 timeout: float = 60) -> tuple[int, dict]:
    """POST ``body`` as JSON (or the raw bytes ``data``) to ``url``, or GET it when there is neither,
    with ``token`` as the bearer token; the status and the parsed reply, an HTTP error's too."""
    if data is None and body is not None:
        data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
