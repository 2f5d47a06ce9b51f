"""``run_python``: a code-executing tool, and the ``env.python`` environment that offers it.

The code runs in a boxed child process (:func:`plait.online.tools.run_sandboxed`), never in the trainer's
process: no inherited environment variables (no tokens), a scratch folder removed afterwards, limits
on CPU time, memory, file size, open files and processes, at most 64 KiB of output, its whole
process group killed when it returns or times out, and, where the machine allows unprivileged
namespaces (or the trainer runs as root), no network, a read-only filesystem but its folder and its
own process tree. What it prints comes back to the model; an error, a timeout, a limit or truncated
output comes back as text.

This stops mistakes and casual reward hacking, not a determined attacker: for untrusted models at
scale, register an environment that runs the code in nsjail, bubblewrap or a container
(examples/plait-sandbox-bwrap shows one).
"""

from __future__ import annotations

import attrs

from plait import hookimpl
from plait.online.rollouts import ToolEnvironment
from plait.online.tools import SANDBOX_OUTPUT_BYTES, Tool, resolve_tools, run_sandboxed


def run_python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: A Python program; print the values you need.

    Returns:
        The program's standard output, or its error.
    """
    return _raise_failure(*run_sandboxed(code, timeout=5.0, memory_mb=256))


def _raise_failure(out: str, failed: bool) -> str:
    if failed:  # call_tool turns it into the error text the model reads, counted as a failure
        raise RuntimeError(out.removeprefix("error: "))
    return out


@attrs.define
class PythonParams:
    timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    memory_mb: int = attrs.field(default=256, validator=attrs.validators.ge(32))
    output_bytes: int = attrs.field(default=SANDBOX_OUTPUT_BYTES, validator=attrs.validators.ge(1))


def python_environment(params: PythonParams) -> ToolEnvironment:
    def sandboxed(code: str) -> str:
        return _raise_failure(*run_sandboxed(code, timeout=params.timeout, memory_mb=params.memory_mb,
                                             output_limit=params.output_bytes))

    schema = resolve_tools([run_python])[0].schema
    return ToolEnvironment([Tool("run_python", sandboxed, schema)], params.timeout + 5.0)


@hookimpl
def register_environments(register):
    register("env.python", python_environment, params=PythonParams, owns_reward=False,
             doc="Run Python in a boxed subprocess: no inherited environment, a scratch folder, resource "
                 "and output limits, no network where the machine allows it (rewards score the episodes)")
