"""Scoring for online RL: resolve reward specs, call reward functions, summarise, pick an estimator.

A method (GRPO, RLOO, ...) does four things with this module, and names no concrete reward:

* :func:`resolve_reward_funcs` turns the user's ``reward_funcs`` into :class:`RewardFunction`
  objects before any model loads. An entry is a registered name (``think_format`` or
  ``reward.think_format``), a mapping ``{name, weight?, **params}`` (factories take params), or
  anything the ``resolve_reward`` hook understands: a callable, an import path
  ``pkg.module:func``, a sequence-classification reward model or its folder.
* :func:`compute_rewards` calls every function on one batch of completions and returns
  ``[N, K]`` scores with NaN for None; what the functions log through TRL's ``log_extra`` and
  ``log_metric`` lands in a :class:`RewardLogs`. Async functions run concurrently in one event loop. A
  function that raises is called again one example at a time to name the example that fails;
  one that does not return within ``timeout`` seconds (:data:`REWARD_TIMEOUT` unless set) is
  abandoned: interrupted by a signal in the main thread, left behind in a worker thread elsewhere,
  cancelled under :func:`asyncio.wait_for` when async. A reward's ``SystemExit`` is its error.
* :class:`UnscoredBatches` stops a run whose rewards score nothing, batch after batch.
* :func:`reward_metrics` gives the logged reward statistics; :func:`resolve_advantage_estimator`
  turns an advantage spec into a callable over :class:`plait.engine.batches.Rollout`.

This module is ``plait.online.scoring`` rather than ``plait.rewards``: that name is the package of
built-in reward plugins (the ``rewards/`` folder).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import math
import numbers
import os
import signal
import threading
from typing import Any, Callable, ClassVar, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from plait.engine.batches import Rollout
from plait.errors import PlaitError
from plait.params import int_at_least, one_of, positive
from plait.registry import Component, UnknownComponentError

logger = logging.getLogger("plait")

# Seconds a reward call may take unless reward_timeout says otherwise: far beyond any honest reward
# call on a batch (a model-judge round trip, a sandboxed test run), yet a hang ends in minutes.
REWARD_TIMEOUT = 300.0
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
ON_ERROR = ("fail", "none")
_SOURCES_HINT = "or give a callable, an import path 'pkg.module:func', or a reward-model folder"


# ---------------------------------------------------------------------------------------------
# Reward functions
# ---------------------------------------------------------------------------------------------


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


@attrs.frozen
class RewardFunction:
    """One resolved reward: a name for logs (``rewards/<name>/mean``), the function, its weight.

    ``fn(**kwargs)`` returns one float or None per completion (or an awaitable of that list when
    ``is_async``); see :func:`compute_rewards` for the keyword arguments.
    """

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    is_async: bool = attrs.field(default=attrs.Factory(lambda self: _is_async(self.fn), takes_self=True))

    def __call__(self, **kwargs: Any) -> Any:
        return self.fn(**kwargs)


def reward_name(fn: Any) -> str:
    """The name a callable is logged under: its ``__name__``, through partials, or its class name."""
    if isinstance(fn, RewardFunction):
        return fn.name
    while hasattr(fn, "func") and not hasattr(fn, "__name__"):  # functools.partial
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, or the last assistant message's content.

    Conversational completions are lists of ``{"role", "content"}`` messages; content may be a
    string or a list of ``{"type": "text", "text": ...}`` parts.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and all(isinstance(m, Mapping) for m in completion):
        if not completion:
            return ""
        message = next((m for m in reversed(completion) if m.get("role") == "assistant"), completion[-1])
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        return content if isinstance(content, str) else ""
    raise PlaitError(
        f"completion {completion!r:.80} is neither a string nor a list of messages; "
        "pass completions as text or as [{'role': 'assistant', 'content': ...}]"
    )


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------


def _finite_weight(weight: Any, where: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise PlaitError(f"{where}.weight={weight!r} must be a finite number")
    return float(weight)


def _from_component(component: Component, values: dict, shared: Mapping[str, Any], where: str) -> Callable:
    if component.params is None:
        component.make_params(**values)  # raises "takes no parameters" when values are given
        return component.obj
    fields = attrs.fields(component.params)
    values = {**{k: v for k, v in shared.items() if k in {f.name for f in fields}}, **values}
    missing = [f.name for f in fields if f.default is attrs.NOTHING and f.name not in values]
    if missing:
        short = component.name.removeprefix("reward.")
        raise PlaitError(
            f"{where}: reward {component.name!r} needs {', '.join(missing)}; write it as "
            f"{{name: {short}, {', '.join(f'{m}: ...' for m in missing)}}}"
        )
    fn = component.obj(component.make_params(**values))
    if not callable(fn):
        raise PlaitError(f"reward factory {component.name!r} from {component.plugin} returned {fn!r}, not a callable")
    return fn


def resolve_reward_funcs(
    specs: Any,
    plugins: Any = None,
    processing_class: Any = None,
    *,
    shared: Mapping[str, Any] = {},
    field: str = "reward_funcs",
) -> list[RewardFunction]:
    """Resolve ``reward_funcs`` (one entry or a list) into :class:`RewardFunction` objects.

    ``shared`` fills parameters a factory entry leaves unset (a method may pass e.g.
    ``{"max_len": max_completion_length}``). Names are made unique (``accuracy``, ``accuracy_2``)
    so each reward gets its own metrics. Every problem is a one-line :class:`PlaitError`.
    """
    if plugins is None:
        from plait.manager import default_plugins

        plugins = default_plugins()
    entries = list(specs) if isinstance(specs, (list, tuple)) else [specs]
    if not entries or specs is None:
        raise PlaitError(f"{field} is empty; give at least one reward, e.g. {field}: [think_format]")
    funcs: list[RewardFunction] = []
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        values: dict = {}
        weight = None
        target = entry
        if isinstance(entry, Mapping):
            values = dict(entry)
            if "name" not in values:
                raise PlaitError(f"{where} has no 'name'; write e.g. {{name: soft_overlong, max_len: 512, weight: 0.5}}")
            target = values.pop("name")
            if "weight" in values:
                weight = _finite_weight(values.pop("weight"), where)
        funcs.append(_resolve_one(target, values, weight, plugins, processing_class, shared, where))
    seen: dict[str, int] = {}
    unique = []
    for func in funcs:
        seen[func.name] = seen.get(func.name, 0) + 1
        unique.append(func if seen[func.name] == 1 else attrs.evolve(func, name=f"{func.name}_{seen[func.name]}"))
    return unique


def _resolve_one(target, values, weight, plugins, processing_class, shared, where) -> RewardFunction:
    if isinstance(target, RewardFunction):
        return target if weight is None else attrs.evolve(target, weight=weight)
    unknown: UnknownComponentError | None = None
    if isinstance(target, str):
        try:
            component = plugins.rewards.get(target, family="reward")
        except UnknownComponentError as err:
            unknown = err
        else:
            fn = _from_component(component, values, shared, where)
            return RewardFunction(component.name.removeprefix("reward."), fn, 1.0 if weight is None else weight)
    if values:
        raise PlaitError(
            f"{where}: parameters {sorted(values)} apply only to registered reward factories, "
            f"and {target!r:.80} is not one; remove them"
        )
    found = plugins.hook.resolve_reward(spec=target, processing_class=processing_class)
    if found is None:
        if unknown is not None:
            raise UnknownComponentError(f"{where}: {unknown}; {_SOURCES_HINT}") from None
        raise PlaitError(f"{where}: cannot use {type(target).__name__} {target!r:.80} as a reward; {_SOURCES_HINT}")
    if not isinstance(found, RewardFunction):
        _check_interface(found, where)
        found = RewardFunction(reward_name(found), found)
    return found if weight is None else attrs.evolve(found, weight=weight)


def _check_interface(fn: Callable, where: str) -> None:
    """Refuse a callable that cannot take a reward's keyword arguments (any importable function
    resolves, ``os.system`` too): it needs ``**kwargs``, or a parameter for each of :data:`RESERVED`,
    and no required parameter it could only get by position."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the first call will tell
        return
    by_keyword = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    by_position_only = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if (takes_any or by_keyword >= set(RESERVED)) and not by_position_only:
        return
    raise PlaitError(
        f"{where}: {reward_name(fn)}{inspect.signature(fn)} does not take a reward's arguments: plait calls "
        f"fn({', '.join(f'{name}=...' for name in RESERVED)}, <dataset column>=...); give it **kwargs, "
        f"e.g. def {reward_name(fn)}(completions, **kwargs)")


def reward_weights(funcs: Sequence[RewardFunction], weights: Sequence[float] | None = None) -> Tensor:
    """The ``[K]`` weight vector: each function's own weight, or ``weights`` (TRL's reward_weights)."""
    if weights is None:
        return torch.tensor([f.weight for f in funcs], dtype=torch.float32)
    weights = list(weights)
    if len(weights) != len(funcs):
        raise PlaitError(
            f"reward_weights has {len(weights)} values for {len(funcs)} reward functions "
            f"{[f.name for f in funcs]}; give one weight per reward function"
        )
    return torch.tensor([_finite_weight(w, f"reward_weights[{i}]") for i, w in enumerate(weights)], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Calling reward functions
# ---------------------------------------------------------------------------------------------


@attrs.define
class RewardLogs:
    """What reward functions log while one batch is scored, through the keyword callables TRL 1.16
    hands them: ``log_extra(column, values)`` adds a column of the completions table (one value per
    completion) and ``log_metric(name, value)`` one scalar for the logs (averaged over a logging
    window, as TRL does)."""

    extra: dict[str, list] = attrs.Factory(dict)
    metrics: dict[str, list[float]] = attrs.Factory(dict)

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise PlaitError(f"log_extra({column!r}, {values!r:.40}): give a list with one value per completion")
        self.extra.setdefault(column, []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        if torch.is_tensor(value) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise PlaitError(f"log_metric({name!r}, {value!r:.40}): the value must be one number")
        self.metrics.setdefault(name, []).append(float(value))

    def callables(self) -> dict[str, Callable]:
        return {"log_extra": self.log_extra, "log_metric": self.log_metric}

    def add(self, other: "RewardLogs") -> None:
        for column, values in other.extra.items():
            self.extra.setdefault(column, []).extend(values)
        for name, values in other.metrics.items():
            self.metrics.setdefault(name, []).extend(values)

    @classmethod
    def of_examples(cls, logs: Sequence["RewardLogs"]) -> "RewardLogs":
        """The logs of one reward called one example at a time: each column gets None where an
        example's call logged nothing to it (it failed, say)."""
        merged = cls()
        columns = dict.fromkeys(column for log in logs for column in log.extra)
        for column in columns:
            merged.extra[column] = [value for log in logs for value in log.extra.get(column, [None])]
        for log in logs:
            merged.add(cls(metrics=log.metrics))
        return merged

    def check(self, n: int) -> None:
        for column, values in self.extra.items():
            if len(values) != n:
                raise PlaitError(f"log_extra({column!r}) got {len(values)} values for {n} completions; log each column "
                                 "once per batch, with one value per completion")


class _LoopThread:
    """One event loop in a daemon thread, kept for the process: async rewards that hold clients
    (HTTP sessions, sandboxes) bound to a loop keep working from one step to the next."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        threading.Thread(target=self.loop.run_forever, name="plait-rewards", daemon=True).start()


_loop_lock = threading.Lock()
_loop: _LoopThread | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.pid != os.getpid():  # a forked child has no loop thread
            _loop = _LoopThread()
        return _loop.loop


class PluginExit(Exception):
    """A reward's ``SystemExit``, held as that reward's error: left to propagate it would end the run
    with exit status 0, no message and no model saved."""

    def __init__(self, exit: SystemExit):
        super().__init__(f"SystemExit({exit.code!r}) would end the process; a reward must raise an exception instead")


class _Overdue(BaseException):
    """Raised in the main thread when its reward call's deadline passes; not an Exception, so that a
    reward's own ``except Exception`` does not swallow it."""


# Interrupts a sync reward in the main thread at its deadline; not SIGALRM, which math-verify's own
# timeouts set and cancel inside rewards.
DEADLINE_SIGNAL = getattr(signal, "SIGUSR2", None)


class RewardTimeout(Exception):
    """A reward call that did not return within its deadline (returned by :func:`_invoke`, not raised)."""

    def __init__(self, timeout: float):
        super().__init__(f"did not return within reward_timeout={timeout:g}s")
        self.timeout = timeout


async def _gather(awaitables: list, timeout: float | None) -> list:
    async def held(awaitable):  # a SystemExit escaping a task would stop the event loop itself
        try:
            return await awaitable
        except SystemExit as exit:
            return PluginExit(exit)

    async def bounded(awaitable):
        try:
            return await asyncio.wait_for(held(awaitable), timeout)
        except asyncio.TimeoutError:
            return RewardTimeout(timeout)

    bounded_or_not = [held(a) if timeout is None else bounded(a) for a in awaitables]
    return await asyncio.gather(*bounded_or_not, return_exceptions=True)


def _call(fn: Callable, kwargs: dict, timeout: float | None) -> Any:
    """``fn(**kwargs)``, its exception, or :class:`RewardTimeout`.

    Sync rewards run in this thread (math-verify's own timeouts need the main thread); in the main
    thread a deadline interrupts them. Elsewhere a timeout runs the call in a daemon thread, which a
    hung reward keeps (Python cannot stop a thread) but training does not wait for."""
    if timeout is None:
        try:
            return fn(**kwargs)
        except Exception as err:  # noqa: BLE001 - attributed to the reward by the caller
            return err
        except SystemExit as exit:
            return PluginExit(exit)
    if DEADLINE_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        return _call_with_deadline(fn, kwargs, timeout)
    return _call_in_worker(fn, kwargs, timeout)


def _call_with_deadline(fn: Callable, kwargs: dict, timeout: float) -> Any:
    """:func:`_call` in the main thread: a watchdog thread signals it at the deadline, and the
    signal's handler raises :class:`_Overdue` there (a sleep or a socket wait is interrupted too;
    only a C call that never returns to Python is not)."""
    done = threading.Event()

    def overdue(signum, frame) -> None:
        if not done.is_set():  # a signal that arrives after the call returned is ignored
            raise _Overdue

    def watch(main: int = threading.get_ident()) -> None:
        if not done.wait(timeout):
            signal.pthread_kill(main, DEADLINE_SIGNAL)

    previous = signal.signal(DEADLINE_SIGNAL, overdue)
    watchdog = threading.Thread(target=watch, name=f"plait-reward-deadline-{reward_name(fn)}", daemon=True)
    watchdog.start()
    try:
        try:
            return fn(**kwargs)
        finally:
            done.set()  # from here on the handler raises nothing
    except _Overdue:
        return RewardTimeout(timeout)
    except Exception as err:  # noqa: BLE001 - attributed to the reward by the caller
        return err
    except SystemExit as exit:
        return PluginExit(exit)
    finally:
        watchdog.join()
        signal.signal(DEADLINE_SIGNAL, previous)


def _call_in_worker(fn: Callable, kwargs: dict, timeout: float) -> Any:
    """:func:`_call` off the main thread: in a daemon thread given ``timeout`` seconds."""
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()  # grad mode is per thread: keep the caller's (no_grad in a rollout)

    def run() -> None:
        try:
            with torch.set_grad_enabled(grad):
                box["result"] = fn(**kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the calling thread
            box["error"] = err

    worker = threading.Thread(target=run, name=f"plait-reward-{reward_name(fn)}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return RewardTimeout(timeout)
    if "error" in box:
        if isinstance(box["error"], SystemExit):
            return PluginExit(box["error"])
        if not isinstance(box["error"], Exception):
            raise box["error"]
        return box["error"]
    return box["result"]


def _invoke(calls: list[tuple[Callable, dict]], timeout: float | None = None) -> list[Any]:
    """Call each ``fn(**kwargs)``: sync ones in order (in this thread without a timeout: math-verify's
    own timeouts need the main thread), then every awaitable concurrently in one loop, each given
    ``timeout`` seconds. Exceptions and :class:`RewardTimeout` are returned, not raised."""
    global _loop
    out: list[Any] = [None] * len(calls)
    pending: dict[int, Any] = {}
    for i, (fn, kwargs) in enumerate(calls):
        result = _call(fn, kwargs, timeout)
        if inspect.isawaitable(result):
            pending[i] = result
        else:
            out[i] = result
    if pending:
        future = asyncio.run_coroutine_threadsafe(_gather(list(pending.values()), timeout), _event_loop())
        try:
            # wait_for cannot fire while a coroutine blocks the loop itself (time.sleep in an async def)
            results = future.result(None if timeout is None else timeout + 1.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            with _loop_lock:
                _loop = None  # that loop is stuck: the next batch gets a fresh one
            results = [RewardTimeout(timeout)] * len(pending)
        for i, result in zip(pending, results):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            out[i] = result
    return out


def _column(func: RewardFunction, values: Any, n: int) -> list[float]:
    if torch.is_tensor(values) or (hasattr(values, "tolist") and not isinstance(values, (list, tuple))):
        values = values.reshape(-1).tolist() if torch.is_tensor(values) else values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        size = f"length {len(values)}" if isinstance(values, (list, tuple)) else type(values).__name__
        raise PlaitError(
            f"reward {func.name!r} returned {size} for {n} completions; return a list with one float "
            "or None per completion"
        )
    column = []
    for i, value in enumerate(values):
        if torch.is_tensor(value) and value.numel() == 1:
            value = value.item()
        if value is None:
            column.append(math.nan)
        elif isinstance(value, numbers.Real):
            value = float(value)
            if math.isinf(value):
                raise PlaitError(f"reward {func.name!r} returned {value} for example {i}; return a finite float or None")
            column.append(value)
        else:
            raise PlaitError(
                f"reward {func.name!r} returned {value!r:.60} for example {i}; return a float or None per completion"
            )
    return column


def _one_example(kwargs: dict, i: int, n: int) -> dict:
    return {k: (v[i : i + 1] if k != "trainer_state" and isinstance(v, (list, tuple)) and len(v) == n else v)
            for k, v in kwargs.items()}


_warned: set[tuple[str, str]] = set()


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


timeouts: collections.Counter[str] = collections.Counter()  # reward name -> calls abandoned in this process


def _after_timeout(func: RewardFunction, n: int, error: RewardTimeout, on_error: str) -> list[None]:
    """A reward that did not return in time: stop the run, or score the whole batch None."""
    if on_error == "fail":
        raise PlaitError(
            f"reward {func.name!r} did not return within reward_timeout={error.timeout:g}s on a batch of {n} "
            "completions; make it faster, raise reward_timeout, or set reward_error_policy='none' to score such "
            "batches as None"
        ) from None
    timeouts[func.name] += 1
    logger.warning(
        "plait: reward %r did not return within reward_timeout=%gs on a batch of %d completions; scored as None "
        "(reward_error_policy 'none'; %d time(s) so far)", func.name, error.timeout, n, timeouts[func.name],
    )
    return [None] * n


def _after_failure(func: RewardFunction, kwargs: dict, n: int, error: Exception, on_error: str,
                   timeout: float | None = None, logs: RewardLogs | None = None) -> list[Any]:
    """Re-run a failed reward one example at a time: name the example that fails, and under
    ``on_error='none'`` score it None while the others keep their scores. What the calls log
    goes to ``logs``."""
    if isinstance(error, PlaitError):  # a configuration problem (a missing column, say), not an example
        raise error
    if isinstance(error, RewardTimeout):  # n more calls would each wait for the deadline too
        return _after_timeout(func, n, error, on_error)
    per_example = [RewardLogs() for _ in range(n)]
    results = _invoke([(func.fn, {**_one_example(kwargs, i, n), **per_example[i].callables()}) for i in range(n)],
                      timeout)
    if logs is not None:
        logs.add(RewardLogs.of_examples(
            [RewardLogs() if isinstance(r, Exception) else log for r, log in zip(results, per_example)]))
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, Exception)]
    for _, err in failed:
        if isinstance(err, PlaitError):
            raise err
    if on_error == "fail":
        if failed:
            i, err = failed[0]
            raise PlaitError(
                f"reward {func.name!r} raised on example {i} of {n} ({_describe(err)}); fix the reward, "
                "or set the reward error policy to 'none' to score failures as None"
            ) from err
        raise PlaitError(
            f"reward {func.name!r} raised on the batch of {n} completions but on no single one "
            f"({_describe(error)}); make it work on any batch size"
        ) from error
    key = (func.name, type(failed[0][1] if failed else error).__name__)
    message = (
        f"reward {func.name!r} raised on example(s) {[i for i, _ in failed][:10]} of {n} "
        f"({_describe(failed[0][1] if failed else error)}); scored as None (reward error policy 'none')"
    )
    logger.log(logging.DEBUG if key in _warned else logging.WARNING, message)
    _warned.add(key)
    return [None if isinstance(r, Exception) else _column(func, r, 1)[0] for r in results]


def compute_rewards(
    funcs: Sequence[RewardFunction],
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]] | None = None,
    trainer_state: Any = None,
    on_error: str = "fail",
    timeout: float | None = None,
    logs: RewardLogs | None = None,
) -> Tensor:
    """Score N completions with K reward functions: a float32 ``[N, K]`` tensor, NaN for None.

    Each function is called once with keyword arguments ``prompts``, ``completions``,
    ``completion_ids`` (unpadded token ids), ``trainer_state``, every entry of ``columns``
    (the extra dataset columns, e.g. ``solution``; one value per completion), and TRL 1.16's
    ``log_extra`` and ``log_metric``, whose entries go to ``logs`` (see :class:`RewardLogs`;
    dropped when ``logs`` is None). Sync functions run first, in order, in this thread; async
    ones then run concurrently in one event loop.

    ``on_error``: ``"fail"`` raises a :class:`PlaitError` naming the reward and the example
    (the original exception chained); ``"none"`` scores the failing examples as None and logs a
    warning once per reward and exception type. A reward that raises ``PlaitError`` or returns
    the wrong number of values always fails.

    ``timeout``: seconds each reward call may take (None: no limit). A call that takes longer is
    abandoned and handled by ``on_error``: ``"fail"`` raises naming the reward and the timeout,
    ``"none"`` scores that reward None for the whole batch and warns with a running count.
    """
    if on_error not in ON_ERROR:
        raise PlaitError(f"on_error={on_error!r} is not valid; use 'fail' or 'none'")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                or not 0 < timeout < math.inf):
        raise PlaitError(f"reward_timeout={timeout!r} must be a number of seconds > 0, or None for no limit")
    n = len(completions)
    columns = dict(columns or {})
    clash = sorted(set(columns) & set(RESERVED))
    if clash:
        raise PlaitError(f"dataset column {clash[0]!r} clashes with a reward-function argument; rename the column")
    for name, values in {"prompts": prompts, "completion_ids": completion_ids, **columns}.items():
        if len(values) != n:
            raise PlaitError(f"{name} has {len(values)} values for {n} completions; give one per completion")
    kwargs = {"prompts": list(prompts), "completions": list(completions), "completion_ids": list(completion_ids),
              "trainer_state": trainer_state, **{k: list(v) for k, v in columns.items()}}
    logged = [RewardLogs() for _ in funcs]  # one per call: a call that fails keeps its entries out
    results = _invoke([(func.fn, {**kwargs, **log.callables()}) for func, log in zip(funcs, logged)], timeout)
    scores = torch.full((n, len(funcs)), math.nan, dtype=torch.float32)
    batch_logs = RewardLogs()
    for k, (func, result) in enumerate(zip(funcs, results)):
        if isinstance(result, Exception):
            values = _after_failure(func, kwargs, n, result, on_error, timeout, batch_logs)
        else:
            values = result
            batch_logs.add(logged[k])
        scores[:, k] = torch.tensor(_column(func, values, n), dtype=torch.float32)
    batch_logs.check(n)
    if logs is not None:
        logs.add(batch_logs)
    return scores


@attrs.define(slots=False)  # a mixin: params classes also inherit LossChoice, and two slotted bases cannot mix
class RewardChoice:
    """The reward knobs every method that scores its own samples shares (GRPO, RLOO, PPO); TRL's names.

    ``reward_funcs`` are registered names, callables, import paths or reward-model folders, summed
    with ``reward_weights``. ``reward_error_policy`` says what a reward that raises or times out
    does: ``fail`` stops the run naming it, ``none`` scores that batch None (counted).
    """

    field_help: ClassVar[dict[str, str]] = {
        "reward_funcs": "reward names, callables, import paths or reward-model folders, summed (plait list rewards)",
        "reward_weights": "one weight per reward function, in order (null: each one's own, 1 by default)",
        "reward_error_policy": "a reward that raises or times out: 'fail' stops the run, 'none' scores that call None",
        "reward_timeout": "seconds one reward call may take before reward_error_policy applies (null: no limit)",
        "max_unscored_batches": "generation batches in a row with no scored completion before the run stops "
                                "(null: never; each such batch is warned about and trains on, as in TRL)",
    }

    reward_funcs: Any = None
    reward_weights: list | None = None
    reward_error_policy: str = attrs.field(default="fail", validator=one_of(ON_ERROR))
    # Seconds one reward call may take before reward_error_policy applies (REWARD_TIMEOUT unless set;
    # None: no limit, TRL's behaviour). A hung judge or sandbox otherwise stalls the run forever.
    reward_timeout: float | None = attrs.field(default=REWARD_TIMEOUT, validator=attrs.validators.optional(positive))
    # Generation batches in a row where no completion got a score before the run stops. None (TRL 1.16's
    # behaviour): warn about each and train on, its advantages 0; a number is the stricter choice.
    max_unscored_batches: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))


@attrs.define
class UnscoredBatches:
    """Watches generation batches for ones where no completion got a score (every reward None or NaN).

    Such a batch carries no learning signal (every advantage is 0), so it is warned about with the
    reward names, and ``limit`` of them in a row (when set) stop the run: rewards that cannot score these
    completions at all (a column they need is missing, a format they do not parse, a judge that is
    down) would otherwise let a run train on nothing until it ends.
    """

    names: Sequence[str]
    limit: int | None  # None: never stop
    in_a_row: int = 0
    scored: int = 0  # batches with at least one score, this process's life (a run that never had one is refused)

    def check(self, rewards: Tensor) -> None:
        """Count one generation batch's ``[N, K]`` scores (all processes'); raise at the limit."""
        if rewards.numel() and not rewards.isnan().all():
            self.in_a_row = 0
            self.scored += 1
            return
        self.in_a_row += 1
        what = (f"every reward ({', '.join(self.names)}) returned None or NaN for all {rewards.shape[0]} "
                "completions")
        if self.limit is not None and self.in_a_row >= self.limit:
            raise PlaitError(
                f"no completion got a score in {self.in_a_row} generation batches in a row: {what}; check that the "
                "rewards can score these completions (the dataset columns they read, the completion format, a "
                "service they call, reward_timeout) or raise max_unscored_batches"
            )
        stop = (f"the run stops at max_unscored_batches={self.limit}" if self.limit is not None
                else "set max_unscored_batches to stop a run after so many")
        logger.warning("plait: no completion of this generation batch got a score: %s; it trains on nothing "
                       "(%d batch(es) in a row; %s)", what, self.in_a_row, stop)

    def finish(self) -> None:
        """At the end of training: a run none of whose batches got a score trained on nothing, and must not end
        as if it had (TRL's default trains on through unscored batches, and would exit 0 here)."""
        if self.in_a_row and not self.scored:
            raise PlaitError(
                f"no completion got a score in any of this run's {self.in_a_row} generation batches: every reward "
                f"({', '.join(self.names)}) returned None or NaN, so nothing was learned; check that the rewards can "
                "score these completions (the dataset columns they read, the completion format, a service they call, "
                "reward_timeout)"
            )


# ---------------------------------------------------------------------------------------------
# Statistics and metrics
# ---------------------------------------------------------------------------------------------


def nan_mean_std(values: Tensor, dim: int = -1, keepdim: bool = False) -> tuple[Tensor, Tensor]:
    """Mean and unbiased (Bessel) std of the non-NaN entries along ``dim``, in float64.

    The mean is NaN where every entry is NaN; the std is 0 where fewer than two entries are set
    (one sample has no spread to normalise by). float64 because advantages divide small
    differences of large rewards by their spread, where float32 rounding would show.
    """
    values = values.double()
    valid = ~values.isnan()
    count = valid.sum(dim, keepdim=True)
    mean = torch.where(valid, values, 0.0).sum(dim, keepdim=True) / count.clamp(min=1)
    square = torch.where(valid, (values - mean) ** 2, 0.0).sum(dim, keepdim=True)
    std = torch.where(count >= 2, (square / (count - 1).clamp(min=1)).sqrt(), 0.0)
    mean = torch.where(count >= 1, mean, math.nan)
    return (mean, std) if keepdim else (mean.squeeze(dim), std.squeeze(dim))


def check_groups(n: int, group_size: int) -> None:
    if group_size < 1 or n % group_size:
        raise PlaitError(f"{n} completions do not split into groups of {group_size}; give num_generations completions per prompt")


def group_mean_std(values: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Per-row mean and std of each row's group (``group_size`` consecutive rows), NaN-aware; ``[N]`` float64 each."""
    check_groups(values.shape[0], group_size)
    mean, std = nan_mean_std(values.view(-1, group_size), dim=1, keepdim=True)
    return mean.expand(-1, group_size).reshape(-1), std.expand(-1, group_size).reshape(-1)


def total_reward(rollout: Rollout) -> Tensor:
    """R = Σ_k w_k·r_k in float64, None (NaN) entries skipped; NaN where every reward is None."""
    return attrs.evolve(rollout, rewards=rollout.rewards.double(), weights=rollout.weights.double()).total_reward


def reward_metrics(
    rewards: Tensor, names: Sequence[str], group_size: int, weights: Tensor | Sequence[float] | None = None
) -> dict[str, float]:
    """Logged reward statistics of one generation batch (gather across processes first).

    ``rewards/<name>/mean`` and ``/std`` per function (over the completions it scored),
    ``reward`` (mean of R over completions with any score), ``reward_std`` (mean over groups of
    the within-group std of R) and ``frac_reward_zero_std`` (the share of groups whose R does
    not vary: they carry no learning signal).
    """
    rewards = rewards.double()
    if rewards.dim() != 2 or rewards.shape[1] != len(names):
        raise PlaitError(f"rewards of shape {tuple(rewards.shape)} do not match {len(names)} reward names")
    weights = torch.ones(len(names)) if weights is None else torch.as_tensor(weights)
    metrics: dict[str, float] = {}
    for k, name in enumerate(names):
        mean, std = nan_mean_std(rewards[:, k], dim=0)
        metrics[f"rewards/{name}/mean"] = mean.item()
        metrics[f"rewards/{name}/std"] = std.item()
    total = total_reward(Rollout(rewards=rewards, weights=weights, group_size=group_size))
    check_groups(total.shape[0], group_size)
    metrics["reward"] = nan_mean_std(total, dim=0)[0].item()
    _, group_std = nan_mean_std(total.view(-1, group_size), dim=1)
    metrics["reward_std"] = group_std.mean().item()
    metrics["frac_reward_zero_std"] = torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item()
    return metrics


# ---------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class AdvantageEstimator:
    """A registered estimator bound to its validated parameters: ``estimator(rollout) -> [N]``."""

    component: Component
    params: Any

    @property
    def name(self) -> str:
        return self.component.name

    @property
    def zero_mean_per_group(self) -> bool:
        return self.component.options.zero_mean_per_group

    def __call__(self, rollout: Rollout) -> Tensor:
        return self.component.obj(rollout, self.params)


def resolve_advantage_estimator(spec: str | Mapping[str, Any], plugins: Any = None, *, field: str = "advantage") -> AdvantageEstimator:
    """``"group"`` / ``"advantage.rloo"`` / ``{name: group, scale: false}`` -> :class:`AdvantageEstimator`."""
    if plugins is None:
        from plait.manager import default_plugins

        plugins = default_plugins()
    values = dict(spec) if isinstance(spec, Mapping) else {"name": spec}
    if not isinstance(values.get("name"), str):
        raise PlaitError(f"{field} needs a name, e.g. {field}: group or {{name: group, scale: false}}; got {spec!r}")
    component = plugins.advantage_estimators.get(values.pop("name"), family="advantage")
    return AdvantageEstimator(component, component.make_params(**values))


# ---------------------------------------------------------------------------------------------
# Turn-level credit: multi-turn episodes whose environment rewards each model turn
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Turns:
    """A rollout's turns as turn-level estimators read them (float64): ``rewards`` r_{i,k} ``[N, M]``
    (0 past the row's last turn), ``present`` ``[N, M]`` (k < K_i), ``scored`` ``[N]`` (the row has
    any reward) and ``index`` ``[N, T]``, each token's turn (−1: none)."""

    rewards: Tensor
    present: Tensor
    scored: Tensor
    index: Tensor


def turns_of(rollout: Rollout, *, who: str = "a turn-level estimator") -> Turns:
    """r_{i,k}: turn k's per-turn reward (0 where the environment gave none), plus the episode reward
    R_i = Σ_k w_k·r_ik on row i's last turn K_i − 1. A row with no per-turn reward thus keeps its
    episode reward at its end, and a row with no turns (``turn_index`` None) is one turn over ``mask``."""
    reward = total_reward(rollout)
    index = rollout.turn_index
    if index is None:
        if rollout.mask is None:
            raise PlaitError(f"{who} needs the Rollout's turn_index (multi-turn episodes) or mask [N, T]; use it with "
                             "grpo, whose online trainer gives them, or pick a sequence-level estimator")
        index = torch.where(rollout.mask.bool(), 0, -1)
    index = index.long()
    n = reward.shape[0]
    given = rollout.turn_rewards
    width = max(1, int(index.max()) + 1 if index.numel() else 1, given.shape[1] if given is not None else 1)
    turn = torch.arange(width)
    per_turn = torch.full((n, width), math.nan, dtype=torch.float64)
    if given is not None:
        per_turn[:, :given.shape[1]] = given.double()
    last_token = index.amax(dim=1) if index.shape[1] else torch.full((n,), -1)
    last_reward = torch.where(per_turn.isnan(), -1, turn).amax(dim=1)
    count = torch.maximum(last_token, last_reward).clamp(min=0) + 1
    present = turn < count.unsqueeze(1)
    rewards = torch.where(present, per_turn.nan_to_num(0.0), 0.0)
    rewards[torch.arange(n), count - 1] += reward.nan_to_num(0.0)
    scored = ~reward.isnan() | (present & ~per_turn.isnan()).any(dim=1)
    return Turns(rewards, present, scored, index)


def discounted_returns(rewards: Tensor, present: Tensor, gamma: float) -> Tensor:
    """G_{i,k} = Σ_{j=k}^{K_i−1} γ^{j−k}·r_{i,j} ``[N, M]`` (0 past each row's turns)."""
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for k in reversed(range(rewards.shape[1])):
        running = (rewards[:, k] + gamma * running) * present[:, k]
        returns[:, k] = running
    return returns


def turn_group_mean_std(values: Tensor, counted: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Mean and std of ``values`` ``[N, M]`` at each turn index over the rows of each group that count
    there (``counted``), ``[N, M]`` each; NaN mean and 0 std where no row counts (see :func:`nan_mean_std`)."""
    n, width = values.shape
    check_groups(n, group_size)
    grouped = values.masked_fill(~counted, math.nan).view(-1, group_size, width)
    mean, std = nan_mean_std(grouped, dim=1, keepdim=True)
    return mean.expand(-1, group_size, -1).reshape(n, width), std.expand(-1, group_size, -1).reshape(n, width)


def turn_baselines(rollout: Rollout, gamma: float, who: str) -> tuple[Turns, Tensor, Tensor, Tensor, Tensor]:
    """What both turn-level estimators start from: the rollout's :class:`Turns`, the returns G ``[N, M]``, which
    (row, turn) count (the turn exists and the row is scored), and the group's mean and std of G per turn."""
    turns = turns_of(rollout, who=who)
    returns = discounted_returns(turns.rewards, turns.present, gamma)
    counted = turns.present & turns.scored.unsqueeze(1)
    mean, std = turn_group_mean_std(returns, counted, rollout.group_size)
    return turns, returns, counted, mean, std


def per_token(turn_values: Tensor, index: Tensor, mask: Tensor | None = None) -> Tensor:
    """Each token's turn value ``[N, T]`` (float32) from ``[N, M]`` per-turn values; 0 where index < 0 or ``mask`` is 0."""
    values = torch.where(index >= 0, turn_values.gather(1, index.clamp(min=0)), 0.0).float()
    return values if mask is None else values * mask.to(values.dtype)


def turn_reward_metrics(rollout: Rollout) -> dict[str, float]:
    """``rewards/turn_<k>/mean``: the mean per-turn reward of turn k (from 1) over the episodes the environment
    rewarded there; ``rewards/turns/mean``: the mean number of model turns; ``rewards/return/mean``: the mean
    return Σ_k r_k (per-turn rewards plus the episode reward) of the scored episodes."""
    turns = turns_of(rollout, who="turn_reward_metrics")
    given = rollout.turn_rewards.double()
    metrics = {}
    for k in range(given.shape[1]):
        values = given[:, k][turns.present[:, k] & ~given[:, k].isnan()]
        if values.numel():
            metrics[f"rewards/turn_{k + 1}/mean"] = values.mean().item()
    metrics["rewards/turns/mean"] = turns.present.sum(dim=1).double().mean().item()
    returns = turns.rewards.sum(dim=1)[turns.scored]
    metrics["rewards/return/mean"] = returns.mean().item() if returns.numel() else math.nan
    return metrics
