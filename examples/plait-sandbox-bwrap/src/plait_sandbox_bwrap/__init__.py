"""env.python_bwrap: plait's python tool, run inside bubblewrap (https://github.com/containers/bubblewrap).

A sketch of a stronger box than the built-in ``env.python``: the code sees a filesystem made only of
the system's and the interpreter's folders (read-only) and an empty /tmp, nothing of the trainer's
home, data or checkpoints; it has no network, no view of other processes and no capabilities; and
``prlimit`` holds it to CPU time, memory, file size (its output included: it goes to size-limited
files), open files and processes. Killing bwrap (on timeout) ends everything it started
(``--die-with-parent``, a PID namespace). The same shape fits nsjail or ``docker run``: build the
command, run it, read a bounded result.
"""

import math
import shutil
import subprocess
import sys
import tempfile

from plait import hookimpl
from plait.errors import PlaitError
from plait.online.rollouts import ToolEnvironment
from plait.online.tools import Tool, resolve_tools
from plait.plugins.environments.python_tool import PythonParams, run_python

VISIBLE = sorted({"/usr", "/lib", "/lib64", "/bin", "/etc/alternatives", sys.base_prefix, sys.prefix})


def bwrap_command(bwrap: str, code: str, params: PythonParams) -> list[str]:
    visible = [arg for path in VISIBLE for arg in ("--ro-bind-try", path, path)]
    limits = [f"--cpu={math.ceil(params.timeout) + 1}", f"--as={params.memory_mb << 20}",
              f"--fsize={params.output_bytes}", "--nofile=64", "--nproc=64"]
    return [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", *visible,
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp",
            "prlimit", *limits, "--", sys.executable, "-I", "-c", code]


def run_in_bwrap(bwrap: str, code: str, params: PythonParams) -> str:
    """What the code prints; its error, a timeout or a limit raised as RuntimeError (the model reads it)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            done = subprocess.run(bwrap_command(bwrap, code, params), stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=err, timeout=params.timeout)
        except subprocess.TimeoutExpired:  # bwrap was killed: its PID namespace with it
            raise RuntimeError(f"the code did not finish within {params.timeout} s") from None
        out.seek(0)
        text = out.read(params.output_bytes).decode(errors="replace")
        if out.tell() >= params.output_bytes:
            return f"{text}\n[output truncated at {params.output_bytes} bytes]"
        if done.returncode != 0:
            err.seek(0)
            lines = err.read(params.output_bytes).decode(errors="replace").strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"exit status {done.returncode}")
        return text


def python_bwrap_environment(params: PythonParams) -> ToolEnvironment:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise PlaitError("env.python_bwrap needs bubblewrap: install it (apt install bubblewrap, dnf install "
                         "bubblewrap) or use env.python")
    schema = resolve_tools([run_python])[0].schema
    return ToolEnvironment([Tool("run_python", lambda code: run_in_bwrap(bwrap, code, params), schema)],
                           params.timeout + 5.0)


@hookimpl
def register_environments(register):
    register("env.python_bwrap", python_bwrap_environment, params=PythonParams, owns_reward=False,
             doc="Run Python inside bubblewrap: only system and interpreter folders visible, no network (example)")
