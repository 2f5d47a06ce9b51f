"""Tool calling: schemas from Python functions, tool calls parsed from completions, tools run safely.

* :func:`resolve_tools` turns ``tools`` (callables or import paths ``pkg.module:func``) into
  :class:`Tool` objects whose JSON schema comes from transformers' own
  ``transformers.utils.get_json_schema`` (the function's type hints and Google-style docstring),
  the schema a chat template renders when given ``tools=``.
* A completion is parsed for tool calls by the tokenizer's own response parser when its template
  defines one (``tokenizer.parse_response``), else by a registered parser of the ``env`` kind
  (``env.parser.<format>``, e.g. ``env.parser.hermes`` for the ``<tool_call>{json}</tool_call>``
  style of Qwen and Hermes templates), chosen by ``tool_call_parser``.
* :func:`call_tool` runs one call with a per-call timeout; a tool that raises, is unknown, gets bad
  arguments or overruns returns its error text (the model reads it) and is counted as a failure,
  never ending the run. :func:`run_sandboxed` runs code in a boxed subprocess: no inherited
  environment, a scratch folder, resource limits, capped output, and no network where the machine
  allows it (the built-in ``run_python`` tool and code-executing environments use it).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs

from plait.errors import PlaitError
from plait.import_paths import import_object

logger = logging.getLogger("plait")

__all__ = ["Tool", "ToolCall", "call_tool", "parse_hermes", "resolve_tools", "run_sandboxed"]


@attrs.frozen
class ToolCall:
    """One parsed call: the function's ``name`` and its ``arguments``; ``error`` when the text
    looked like a call but could not be read (then the model is told why, and it counts as a failure)."""

    name: str | None
    arguments: dict = attrs.field(factory=dict)
    error: str | None = None

    def message(self) -> dict:
        """The call as a chat message's ``tool_calls`` entry."""
        return {"type": "function", "function": {"name": self.name or "", "arguments": self.arguments}}


@attrs.frozen(eq=False)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict


def resolve_tools(specs: Any, field: str = "tools") -> list[Tool]:
    """:class:`Tool` objects from callables or import paths; refused now (before any model loads)
    when one is not callable, two share a name, or transformers cannot build a schema from it."""
    from transformers.utils import get_json_schema

    tools, seen = [], set()
    for i, spec in enumerate(specs or []):
        fn = import_object(spec, f"{field}[{i}]")
        if not callable(fn) or isinstance(fn, type):
            raise PlaitError(f"{field}[{i}]={spec!r:.60} is not a function; give a function or 'pkg.module:func'")
        try:
            schema = get_json_schema(fn)
        except Exception as err:  # noqa: BLE001 - transformers' DocstringParsingException, TypeHintParsingException
            raise PlaitError(f"{field}[{i}] {getattr(fn, '__name__', fn)!r}: transformers cannot build its JSON schema "
                             f"({err}); give every argument a type hint and a Google-style docstring with Args:") from None
        name = schema["function"]["name"]
        if name in seen:
            raise PlaitError(f"{field}: two tools are named {name!r}; rename one")
        seen.add(name)
        tools.append(Tool(name, fn, schema))
    return tools


# ---------------------------------------------------------------------------------------------
# Parsing tool calls
# ---------------------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen, Hermes templates):
    the text outside them and the calls, in order. A block that is not such JSON is a call with an error."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(None, error=f"the tool call is not valid JSON ({err.msg} at {err.pos})"))
            continue
        arguments = data.get("arguments", {}) if isinstance(data, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(arguments, dict):
            calls.append(ToolCall(None, error='a tool call must be {"name": "<tool>", "arguments": {...}}'))
            continue
        calls.append(ToolCall(data["name"], arguments))
    return _HERMES.sub("", text).strip(), calls


def template_parser(tokenizer) -> Callable[[str], tuple[str, list[ToolCall]]] | None:
    """The tokenizer's own response parser (``parse_response`` with its ``response_template``) when it has one.
    A model turn is parsed as sampled (``prefix=""``): what a template pre-writes before it (an opening
    ``<think>``) is not seen by the parser."""
    if getattr(tokenizer, "response_template", None) is None:
        return None

    def parse(text: str) -> tuple[str, list[ToolCall]]:
        parsed = tokenizer.parse_response(text, prefix="")
        calls = []
        for call in parsed.get("tool_calls") or []:
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    calls.append(ToolCall(function.get("name"), error="the tool call's arguments are not valid JSON"))
                    continue
            calls.append(ToolCall(function.get("name"), arguments))
        return parsed.get("content") or "", calls

    return parse


def resolve_parser(name: str | None, tokenizer, plugins) -> Callable[[str], tuple[str, list[ToolCall]]]:
    """``tool_call_parser`` (a registered ``env.parser.<name>``), else the template's own parser,
    else ``env.parser.hermes``."""
    if name is None:
        own = template_parser(tokenizer)
        if own is not None:
            return own
        name = "hermes"
    return plugins.environments.get(name if name.startswith("env.") else f"env.parser.{name}").obj


# ---------------------------------------------------------------------------------------------
# Running tools
# ---------------------------------------------------------------------------------------------


class ToolTimeout(Exception):
    pass


def _run(fn: Callable, arguments: Mapping[str, Any]) -> Any:
    out = fn(**arguments)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def call_tool(tools: Mapping[str, Tool], call: ToolCall, timeout: float | None) -> tuple[str, bool]:
    """Run one call: ``(result text, failed)``. Errors, unknown tools and timeouts come back as text."""
    if call.error is not None:
        return f"error: {call.error}", True
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool is named {call.name!r}; the tools are {sorted(tools)}", True
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = _run(tool.fn, call.arguments)
        except BaseException as err:  # noqa: BLE001 - handed back to the model as text
            box["error"] = err

    worker = threading.Thread(target=work, name=f"plait-tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():  # Python cannot stop a thread: it is abandoned, and the episode goes on
        return f"error: {tool.name} did not return within {timeout} s", True
    if "error" in box:
        err = box["error"]
        if isinstance(err, KeyboardInterrupt):
            raise err
        return f"error: {type(err).__name__}: {err}", True
    result = box["result"]
    return (result if isinstance(result, str) else json.dumps(result, default=str)), False


# The sandbox's limits beyond the caller's time and memory: how much it may write to a file, how many
# files it may hold open, how many processes it may run (a fork bomb stops there), how much of its
# output comes back.
SANDBOX_FILE_MB, SANDBOX_OPEN_FILES, SANDBOX_PROCESSES, SANDBOX_OUTPUT_BYTES = 16, 64, 64, 64 * 1024
_NOBODY = 65534
_CHILD = str(Path(__file__).with_name("sandbox_child.py"))


@functools.cache
def _as_nobody() -> list[str]:
    """Root is never held to RLIMIT_NPROC (the kernel exempts uid 0) and may write anything: as root the
    code runs as ``nobody`` (util-linux ``setpriv``, probed once). Where ``nobody`` cannot reach the
    interpreter (one installed under /root), it keeps the right to read and search every file
    (CAP_DAC_READ_SEARCH), which is logged: files only root may read are then within its reach."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0:
        return []
    drop = [setpriv, f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups"]
    keep = "+dac_read_search"
    reading = [*drop, f"--inh-caps=-all,{keep}", f"--ambient-caps=-all,{keep}", f"--bounding-set=-all,{keep}"]
    # the same interpreter and standard library as the trainer's, not a system one found instead
    same_python = f"import sys; assert (sys.version, sys.base_prefix) == {(sys.version, sys.base_prefix)!r}"
    for command in ([*drop, "--inh-caps=-all", "--bounding-set=-all"], reading) if setpriv else ():
        if subprocess.run([*command, sys.executable, "-I", "-c", same_python], capture_output=True, cwd="/",
                          env={}).returncode == 0:
            if command is reading:
                logger.warning(f"run_sandboxed: nobody cannot reach {sys.executable}, so sandboxed code runs as "
                               "nobody but may read any file root may (but the trainer's home, where it is hidden)")
            return command
    logger.warning("run_sandboxed: the trainer runs as root and cannot become nobody (util-linux setpriv is "
                   "missing or refused): sandboxed code runs as root, with no limit on its number of processes")
    return []


@functools.cache
def _namespaces() -> tuple[list[str], bool]:
    """The ``unshare`` command this machine allows, probed once: new network, mount and PID namespaces
    (no network; every mount read-only but the code's folder; no process outlives the first one, and
    the trainer's processes are out of sight), else a network namespace alone, else none. Also returns
    whether the child makes the mounts read-only. What is missing is logged once. An unprivileged
    trainer needs unprivileged user namespaces for any of them."""
    unshare = shutil.which("unshare")
    user = ["--user", "--map-root-user"] if os.geteuid() != 0 else []
    full = [unshare, *user, "--net", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child"]
    for prefix, readonly, missing in [(full, True, None), ([unshare, *user, "--net"], False, "mount or PID namespace")]:
        probe = unshare and _run_boxed("print('boxed')", prefix, readonly, timeout=10.0, memory_mb=256, stdin="",
                                       output_limit=64)
        if probe == ("boxed\n", False):
            if missing:
                logger.warning(f"run_sandboxed: no {missing} can be made here: sandboxed code can write wherever its "
                               "user can, and a child that leaves its session can outlive the call")
            return prefix, readonly
    logger.warning("run_sandboxed: no network namespace can be made here (no unshare, or unprivileged user namespaces "
                   "are disabled): sandboxed code has the network and can write wherever its user can")
    return [], False


def run_sandboxed(code: str, *, timeout: float = 5.0, memory_mb: int = 256, stdin: str = "",
                  output_limit: int = SANDBOX_OUTPUT_BYTES) -> tuple[str, bool]:
    """Run Python ``code`` in a fresh isolated interpreter (``python -I``) in a child process, boxed:
    ``(stdout, or the error text; failed)``. Nothing runs in the trainer's process.

    The box: an environment of PATH and a scratch HOME only; a fresh temporary working directory,
    removed afterwards; its own session, killed as a whole (SIGKILL) when the code returns, fails or
    overruns ``timeout``; limits on CPU time, address space (``memory_mb``), file size, open files and
    processes, set by a small first program (:mod:`plait.online.sandbox_child`) rather than ``preexec_fn``;
    at most ``output_limit`` bytes of output read (the code is stopped there, and the result says so);
    as root, the code runs as ``nobody`` (see :func:`_as_nobody`). Where the machine allows it (see
    :func:`_namespaces`), it also has no network, the trainer's home hidden (tokens, keys, caches; the
    interpreter's folders stay), a read-only filesystem but its folder, and its own process tree.

    This keeps honest mistakes and casual reward hacking out of the trainer. It is not an isolation
    boundary against a determined attacker: the kernel, files its user may read and (without
    namespaces) the network stay within reach. For that, register an environment that runs the code in
    nsjail, bubblewrap or a container (see examples/plait-sandbox-bwrap)."""
    prefix, readonly = _namespaces()
    return _run_boxed(code, prefix, readonly, timeout=timeout, memory_mb=memory_mb, stdin=stdin,
                      output_limit=output_limit)


def _run_boxed(code: str, prefix: list[str], readonly: bool, *, timeout: float, memory_mb: int, stdin: str,
               output_limit: int) -> tuple[str, bool]:
    seconds = max(1, math.ceil(timeout) + 1)
    limits = {"RLIMIT_CPU": seconds, "RLIMIT_AS": memory_mb * 1024 * 1024, "RLIMIT_FSIZE": SANDBOX_FILE_MB << 20,
              "RLIMIT_NOFILE": SANDBOX_OPEN_FILES, "RLIMIT_NPROC": SANDBOX_PROCESSES}
    with tempfile.TemporaryDirectory(prefix="plait-sandbox-", ignore_cleanup_errors=True) as folder:
        Path(folder, "main.py").write_text(code)
        Path(folder, "stdin").write_text(stdin)
        as_nobody = _as_nobody()
        if as_nobody:
            os.chown(folder, _NOBODY, _NOBODY)
        settings = {"limits": limits, "readonly": readonly, "argv": [*as_nobody, sys.executable, "-I", "main.py"],
                    "hide": os.path.expanduser("~"), "keep": [sys.base_prefix, sys.prefix, os.path.realpath(folder)]}
        # nothing of the trainer's environment (its tokens); one thread per math library, as threads
        # count against the process limit
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": folder,
               "OMP_NUM_THREADS": "1"}
        with open(Path(folder, "stdin"), "rb") as given:
            child = subprocess.Popen([*prefix, sys.executable, "-I", "-S", _CHILD, json.dumps(settings)], cwd=folder,
                                     env=env, stdin=given, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        try:
            out, err, overflowed = _read_capped(child, time.monotonic() + timeout, output_limit)
            timed_out = child.poll() is None
        finally:
            _kill_session(child)
            child.wait()
            child.stdout.close()
            child.stderr.close()
    stdout = out.decode(errors="replace")
    if overflowed:
        return f"{stdout}\n[output truncated: the code printed more than {output_limit} bytes and was stopped]", True
    if timed_out:
        return f"error: the code did not finish within {timeout} s", True
    if child.returncode != 0:
        tail = (err.decode(errors="replace").strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        if child.returncode < 0:
            tail = f"killed by signal {-child.returncode} (time or memory limit: {timeout} s, {memory_mb} MiB)"
        return f"error: {tail}", True
    return stdout, False


def _read_capped(child: subprocess.Popen, deadline: float, limit: int) -> tuple[bytes, bytes, bool]:
    """The child's stdout (its first ``limit`` bytes) and stderr (its last ``limit`` bytes), read as they
    come until both close, the deadline passes or stdout overflows (True): never more than that in
    memory. Once the first process exits its session is killed, so that a child it left behind holding
    the pipes open cannot keep the call waiting."""
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as streams:
        streams.register(child.stdout, selectors.EVENT_READ, out)
        streams.register(child.stderr, selectors.EVENT_READ, err)
        while streams.get_map():
            if child.poll() is not None:
                _kill_session(child)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in streams.select(min(remaining, 0.05)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    streams.unregister(key.fileobj)
                elif key.data is out:
                    out += chunk
                    if len(out) > limit:
                        return bytes(out[:limit]), bytes(err), True
                else:
                    err[:] = (err + chunk)[-limit:]
    try:
        child.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    return bytes(out), bytes(err), False


def _kill_session(child: subprocess.Popen) -> None:
    """SIGKILL to every process of the child's session (its process group: it started a new session);
    in a PID namespace, killing its first process also ends every other one in it."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
