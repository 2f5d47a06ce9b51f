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
  never ending the run. :func:`run_sandboxed` runs code in a subprocess with time and memory limits
  (the built-in ``run_python`` tool and code-executing environments use it).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import subprocess
import sys
import threading
from typing import Any, Callable, Mapping

import attrs

from .errors import PlaitError

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


def _import(path: str, field: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PlaitError(f"{field}={path!r} is not an import path; write 'pkg.module:func'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - the user's module failed; say which
        raise PlaitError(f"{field}={path!r}: importing {module_name!r} failed ({type(err).__name__}: {err})") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlaitError(f"{field}={path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def import_object(spec: Any, field: str) -> Any:
    """``spec`` itself, or the object an import path (``pkg.module:attr`` / ``pkg.module.attr``) names."""
    return _import(spec, field) if isinstance(spec, str) else spec


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


def run_sandboxed(code: str, *, timeout: float = 5.0, memory_mb: int = 256, stdin: str = "") -> tuple[str, bool]:
    """Run Python ``code`` in a fresh isolated interpreter (``python -I``) under a CPU-time and an
    address-space limit: ``(stdout, or the error text; failed)``. Nothing runs in the trainer's process."""
    def limits() -> None:  # in the child, before it executes anything
        import resource

        seconds = max(1, int(timeout) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))
        size = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size, size))

    try:
        done = subprocess.run([sys.executable, "-I", "-c", code], input=stdin, capture_output=True, text=True,
                              timeout=timeout, preexec_fn=limits if sys.platform != "win32" else None)
    except subprocess.TimeoutExpired:
        return f"error: the code did not finish within {timeout} s", True
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        if done.returncode < 0:
            tail = f"killed by signal {-done.returncode} (time or memory limit: {timeout} s, {memory_mb} MiB)"
        return f"error: {tail}", True
    return done.stdout, False
