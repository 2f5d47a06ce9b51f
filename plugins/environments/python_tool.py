"""``run_python``: a code-executing tool, and the ``env.python`` environment that offers it.

The code runs in a fresh isolated interpreter (``python -I``) in a subprocess, under a CPU-time
and an address-space limit (:func:`plait.tools.run_sandboxed`), never in the trainer's process;
what it prints comes back to the model, and an error, a timeout or a limit comes back as text.
"""

from __future__ import annotations

import attrs

from plait import hookimpl
from plait.rollouts import ToolEnvironment
from plait.tools import Tool, resolve_tools, run_sandboxed


def run_python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: A Python program; print the values you need.

    Returns:
        The program's standard output, or its error.
    """
    out, failed = run_sandboxed(code, timeout=5.0, memory_mb=256)
    if failed:
        raise RuntimeError(out.removeprefix("error: "))
    return out


@attrs.define
class PythonParams:
    timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    memory_mb: int = attrs.field(default=256, validator=attrs.validators.ge(32))


def python_environment(params: PythonParams) -> ToolEnvironment:
    def sandboxed(code: str) -> str:
        out, failed = run_sandboxed(code, timeout=params.timeout, memory_mb=params.memory_mb)
        if failed:
            raise RuntimeError(out.removeprefix("error: "))
        return out

    schema = resolve_tools([run_python])[0].schema
    return ToolEnvironment([Tool("run_python", sandboxed, schema)], params.timeout + 5.0)


@hookimpl
def register_environments(register):
    register("env.python", python_environment, params=PythonParams, owns_reward=False,
             doc="Run Python in a subprocess with time and memory limits (rewards score the episodes)")
