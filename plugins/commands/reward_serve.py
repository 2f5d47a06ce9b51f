"""``plait reward-serve``: rewards scored over HTTP, so the reward model runs apart from the trainer.

``plait reward-serve [--model FOLDER] [--reward NAME ...] [--host H] [--port P] [--token-file PATH]
[--max-batch-size N] [--batch-window S] [...the limits of plait vllm-serve]`` serves a saved
sequence-classification reward model (what the reward method writes) and/or reward functions named
as ``reward_funcs`` entries name them (``accuracy``, ``pkg.module:func``, a reward-model folder):

====================  =====================================================================
``GET /health``       ``{"status": "ok", "rewards": [names], "requests", "forwards"}``
``POST /score``       ``{"reward": name, "prompts": [...], "completions": [...],
                      "completion_ids": [...]?, "columns": {name: [...]}?}`` -> ``{"scores": [float|None]}``
====================  =====================================================================

Requests that arrive within ``--batch-window`` seconds of each other for the same reward are
coalesced into one call of it (one forward of the reward model), at most ``--max-batch-size``
completions at a time; ``forwards`` counts those calls. The front is :mod:`plait.serving`'s, as
``plait vllm-serve``'s: a bearer token (``--token-file``, PLAIT_REWARD_TOKEN, or a fresh one in a
file of this user's that local clients find), loopback unless a token is given, bounded connections,
header/body deadlines and body size. Clients: the ``remote`` reward (``{name: remote, url: ...}``).
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time

import attrs

from plait import hookimpl, serving
from plait.cli import Command
from plait.errors import PlaitError
from plait.serving import BoundedServer, JsonHandler, add_limit_arguments, check_limits, write_token

TOKEN_ENV = "PLAIT_REWARD_TOKEN"
MAX_BODY_BYTES = 16 * 2**20  # prompts and completions as text
BODY_TIMEOUT = 30.0
SCORE_TIMEOUT = 300.0  # a request's wait for its batch to be scored


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a reward-model folder (a saved …ForSequenceClassification)")
    parser.add_argument("--reward", action="append", default=[],
                        help="a reward to serve, as a reward_funcs entry names it (accuracy, pkg.module:func); repeat")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default loopback; any other needs a token you give clients)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--token-file", default=None,
                        help=f"file holding the token clients must send (made, mode 0600, when missing); default: "
                             f"{TOKEN_ENV}, else a fresh token in a file of yours that local clients find")
    parser.add_argument("--max-batch-size", type=int, default=64, help="completions scored in one call (default 64)")
    parser.add_argument("--batch-window", type=float, default=0.02,
                        help="seconds to wait for more requests to join a batch (default 0.02)")
    add_limit_arguments(parser, max_body_bytes=MAX_BODY_BYTES, body_timeout=BODY_TIMEOUT)


def served_rewards(args: argparse.Namespace, plugins) -> dict:
    """name -> reward function, resolved (and the model loaded) before the port opens."""
    from plait.online.scoring import resolve_reward_funcs

    specs = list(args.reward)
    funcs = resolve_reward_funcs(specs, plugins, field="--reward") if specs else []
    if args.model is not None:
        from transformers import AutoModelForSequenceClassification

        from plait.data.pretrained import pretrained_kwargs

        resolve_reward_funcs([args.model], plugins, field="--model")  # checks the folder's config first
        model = AutoModelForSequenceClassification.from_pretrained(args.model, **pretrained_kwargs())
        func = plugins.hook.resolve_reward(spec=model, processing_class=None)
        if attrs.has(type(func.fn)) and hasattr(func.fn, "batch_size"):  # a coalesced batch is one forward
            func = attrs.evolve(func, fn=attrs.evolve(func.fn, batch_size=args.max_batch_size))
        funcs.append(func)
    if not funcs:
        raise PlaitError("plait reward-serve serves nothing; pass --model FOLDER and/or --reward NAME")
    return {f.name: f for f in funcs}


class Batcher:
    """One reward's queue: a thread takes the requests that arrive within ``window`` seconds of the
    first (at most ``max_size`` completions), calls the reward once on all of them, and hands each
    request its slice. A batch that raises is retried request by request, so one bad request fails alone."""

    def __init__(self, fn, max_size: int, window: float):
        self.fn, self.max_size, self.window = fn, max_size, window
        self.requests: queue.Queue = queue.Queue()
        self.calls = 0
        threading.Thread(target=self._serve, daemon=True, name="plait-reward-batcher").start()

    def score(self, kwargs: dict, n: int, timeout: float) -> list:
        done, box = threading.Event(), {}
        self.requests.put((kwargs, n, done, box))
        if not done.wait(timeout):
            raise TimeoutError(f"the reward was not scored within {timeout:g} s")
        if "error" in box:  # the reward's own failure: a 500 for the client to weigh, never a 400
            raise RuntimeError(f"the reward raised {type(box['error']).__name__}: {box['error']}") from box["error"]
        return box["scores"]

    def _serve(self) -> None:
        held = None
        while True:
            first = held or self.requests.get()
            held, batch, size = None, [first], first[1]
            deadline = time.monotonic() + self.window
            while size < self.max_size:
                try:
                    item = self.requests.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if size + item[1] > self.max_size or set(item[0]) != set(first[0]):
                    held = item  # the next batch starts with it
                    break
                batch.append(item)
                size += item[1]
            self._run(batch)

    def _call(self, batch: list) -> list:
        merged = {key: [v for kwargs, *_ in batch for v in kwargs[key]] for key in batch[0][0]}
        self.calls += 1
        scores = list(self.fn(**merged))
        if len(scores) != len(merged["completions"]):
            raise ValueError(f"the reward returned {len(scores)} scores for {len(merged['completions'])} completions")
        return scores

    def _run(self, batch: list) -> None:
        try:
            scores = self._call(batch)
        except Exception as err:  # noqa: BLE001 - each request learns its own outcome
            if len(batch) > 1:
                for item in batch:
                    self._run([item])
                return
            batch[0][3]["error"] = err
            batch[0][2].set()
            return
        start = 0
        for kwargs, n, done, box in batch:
            box["scores"] = [None if s is None else float(s) for s in scores[start:start + n]]
            start += n
            done.set()


class Handler(JsonHandler):
    server_version = "plait-reward-serve"
    routes = {("GET", "/health"): "health", ("POST", "/score"): "score"}
    token_hint = f"the server's --token-file or {TOKEN_ENV}"
    too_large_hint = "send fewer completions per request"

    def health(self, body: dict) -> dict:
        batchers = self.server.batchers
        return {"status": "ok", "rewards": list(batchers), "requests": self.server.requests,
                "forwards": {name: b.calls for name, b in batchers.items()},
                "max_body_bytes": self.server.max_body_bytes, "max_batch_size": self.server.max_batch_size}

    def score(self, body: dict) -> dict:
        batchers = self.server.batchers
        name = body.get("reward")
        if name is None and len(batchers) == 1:
            name = next(iter(batchers))
        if name not in batchers:
            raise ValueError(f"'reward' must be one of {list(batchers)}, not {name!r}")
        prompts, completions = body.get("prompts"), body.get("completions")
        if not isinstance(completions, list) or not completions or not isinstance(prompts, list) \
                or len(prompts) != len(completions):
            raise ValueError("'prompts' and 'completions' must be non-empty lists of equal length")
        n = len(completions)
        if n > self.server.max_batch_size:
            raise ValueError(f"{n} completions in one request, over --max-batch-size={self.server.max_batch_size}")
        columns = dict(body.get("columns") or {})
        if body.get("completion_ids") is not None:
            columns["completion_ids"] = body["completion_ids"]
        for key, values in columns.items():
            if key in ("prompts", "completions") or not isinstance(values, list) or len(values) != n:
                raise ValueError(f"column {key!r} must be a list with one value per completion")
        self.server.requests += 1
        kwargs = {"prompts": prompts, "completions": completions, **columns}
        return {"scores": batchers[name].score(kwargs, n, SCORE_TIMEOUT)}


class RewardServer(BoundedServer):
    def __init__(self, address, rewards: dict, *, max_batch_size: int, batch_window: float, **limits):
        super().__init__(address, Handler, who="plait reward-serve", **limits)
        self.max_batch_size, self.requests = max_batch_size, 0
        self.batchers = {name: Batcher(fn, max_batch_size, batch_window) for name, fn in rewards.items()}


def run(args: argparse.Namespace, plugins) -> int:
    serving.check_bind(args.host, args.token_file or os.environ.get(TOKEN_ENV), TOKEN_ENV)
    check_limits(args)
    if args.max_batch_size < 1 or not 0 <= args.batch_window < 60:
        raise PlaitError(f"--max-batch-size={args.max_batch_size} must be at least 1 and --batch-window="
                         f"{args.batch_window} seconds in [0, 60)")
    rewards = served_rewards(args, plugins)
    token, token_file = serving.server_token(args.token_file, TOKEN_ENV, serving.token_path("reward-serve", args.port))
    try:
        httpd = RewardServer((args.host, args.port), rewards, max_batch_size=args.max_batch_size,
                             batch_window=args.batch_window, token=token, max_connections=args.max_connections,
                             header_timeout=args.header_timeout, max_body_bytes=args.max_body_bytes,
                             body_timeout=args.body_timeout)
    except OSError as err:
        raise PlaitError(f"cannot listen on {args.host}:{args.port} ({err.strerror}); choose another --port") from None
    if token_file is not None:
        write_token(token_file, token)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"plait reward-serve: {', '.join(rewards)} ready on http://{args.host}:{args.port}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        if token_file is not None and not args.token_file:
            token_file.unlink(missing_ok=True)
    return 0


@hookimpl
def register_commands(register):
    register("command.reward-serve", Command(run, add_arguments, help="serve reward models and reward functions "
                                                                       "over HTTP (the remote reward)"))
