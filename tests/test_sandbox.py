"""The python tool's box (:func:`plait.online.tools.run_sandboxed`, ``env.python``) against a catalogue of
hostile code, each case run both directly and through the environment the trainer uses: a parent's
secret, writes outside its folder, a fork bomb, orphans, the network, unbounded output, an infinite
loop, a huge allocation, a huge file and too many open files; and a GRPO run that keeps training
while the model's code is all of these. Where the machine cannot make namespaces, the cases that
need them check the documented-open behaviour and skip, saying so."""

from __future__ import annotations

import itertools
import math
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import pytest

import plait
from plait.manager import make_plugins
from plait.online.tools import SANDBOX_OUTPUT_BYTES, SANDBOX_PROCESSES, ToolCall, _as_nobody, _namespaces, run_sandboxed
from plait.plugins.environments.python_tool import PythonParams, python_environment
from plait.testing.tool_model import QUESTION

PREFIX, READ_ONLY = _namespaces()  # READ_ONLY: network, mount and PID namespaces all made
NO_NAMESPACES = "this machine cannot make namespaces (no unshare, or no unprivileged user namespaces)"
UNLIMITED_ROOT = os.geteuid() == 0 and not _as_nobody()
TIMEOUT, FINISH = 2.0, 20.0  # for the cases that overrun it; for all others
SLEEP = shutil.which("sleep")


@pytest.fixture(params=["run_sandboxed", "env.python"])
def run(request):
    """``run(code, timeout) -> (text, failed)``: through run_sandboxed itself, or as a model's tool
    call to the env.python environment (its error text then comes as the tool message). The default
    timeout is generous: only the cases meant to overrun it should, even on a busy machine."""
    if request.param == "run_sandboxed":
        return lambda code, timeout=FINISH: run_sandboxed(code, timeout=timeout, memory_mb=128)
    component = make_plugins().environments.get("env.python")

    def through_environment(code, timeout=FINISH):
        env = component.obj(component.make_params(timeout=timeout, memory_mb=128))
        step = env.step("", [ToolCall("run_python", {"code": code})])
        return step.messages[0]["content"], bool(step.failures)

    return through_environment


def marker() -> str:
    """A ``sleep`` argument no other process has: its survivors can be found by it."""
    return f"1000.{uuid.uuid4().int % 10**9}"


def survivors(argument: str) -> list[int]:
    """Pids whose command line holds ``argument``, after giving SIGKILLed ones a moment to go."""
    for _ in range(20):
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if argument.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
        if not found:
            return []
        time.sleep(0.05)
    return found


def test_a_secret_of_the_trainer_does_not_reach_the_code(run, monkeypatch):
    monkeypatch.setenv("FAKE_SECRET", "s3cr3t-value")
    code = """import os, glob
print(dict(os.environ))
for path in glob.glob("/proc/*/environ"):
    try:
        print(open(path, "rb").read())
    except OSError:
        pass
"""
    text, failed = run(code)
    assert not failed and "PATH" in text
    assert "s3cr3t-value" not in text and "FAKE_SECRET" not in text


def test_the_trainers_home_is_hidden(run, monkeypatch, tmp_path):
    if not READ_ONLY:
        pytest.skip(f"{NO_NAMESPACES}: the code can read what the trainer's user can (documented)")
    token = tmp_path / "home" / ".cache" / "huggingface" / "token"
    token.parent.mkdir(parents=True)
    token.write_text("hf_s3cr3t")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert run(f"import os\nprint(os.listdir({str(tmp_path / 'home')!r}))") == ("[]\n", False)


def test_writes_outside_its_folder_fail_and_its_folder_is_removed(run, monkeypatch, tmp_path):
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    monkeypatch.chdir(trainer)
    targets = [trainer / "stolen.txt", tmp_path / "outside.txt", Path("/tmp") / f"plait-escape-{uuid.uuid4().hex}"]
    if not READ_ONLY:
        pytest.skip(f"{NO_NAMESPACES}: the code can write wherever its user can (documented)")
    code = f"""import os
for target in {[str(t) for t in targets]!r} + ["../escape.txt"]:
    try:
        open(target, "w").write("x")
        print("wrote", target)
    except OSError as err:
        print("refused", target, err.errno)
open(os.path.expanduser("~/own.txt"), "w").write("its own folder is writable")
print(os.getcwd())
"""
    text, failed = run(code)
    assert not failed and "wrote" not in text and text.count("refused") == 4, text
    assert not any(target.exists() for target in targets)
    assert not Path(text.splitlines()[-1]).exists()  # the scratch folder is gone


@pytest.mark.skipif(UNLIMITED_ROOT, reason="the trainer runs as root and setpriv is missing: no process limit")
def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing(run):
    argument = marker()
    code = f"""import os
forks = 0
try:
    while True:
        if os.fork() == 0:
            os.execv({SLEEP!r}, ["sleep", {argument!r}])
        forks += 1
except OSError:
    print(forks)
"""
    start = time.monotonic()
    text, failed = run(code)
    assert not failed and int(text) < SANDBOX_PROCESSES and time.monotonic() - start < 5
    assert survivors(argument) == []


@pytest.mark.parametrize("ending, timeout", [("print('left')", FINISH), ("while True: pass", TIMEOUT)])
def test_a_child_left_behind_dies_when_the_code_returns_or_times_out(run, ending, timeout):
    argument = marker()
    start = time.monotonic()
    text, failed = run(f"import subprocess\nsubprocess.Popen([{SLEEP!r}, {argument!r}])\n{ending}", timeout)
    assert (text, failed) == ("left\n", False) if timeout == FINISH else failed and "did not finish" in text
    assert time.monotonic() - start < min(timeout, 5) + 1.5  # the sleep's 1000 s held nothing up
    assert survivors(argument) == []


def test_a_child_in_its_own_session_dies_with_the_pid_namespace(run):
    if not READ_ONLY:
        pytest.skip(f"{NO_NAMESPACES}: a child that calls setsid() leaves the process group (documented)")
    argument = marker()
    text, failed = run(f"import subprocess\nsubprocess.Popen([{SLEEP!r}, {argument!r}], start_new_session=True)")
    assert not failed and survivors(argument) == []


def test_the_code_cannot_reach_a_socket_the_trainer_listens_on(run):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        text, failed = run(code)
        if not PREFIX:
            assert (text, failed) == ("connected\n", False)
            pytest.skip(f"{NO_NAMESPACES}: the network is open (run_sandboxed logs it once)")
        assert failed and "unreachable" in text, text
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize("code", ["while True: print('x' * 1000)",
                                  "import os\nchunk = b'x' * 10_000_000\nfor _ in range(20): os.write(1, chunk)"])
def test_unbounded_output_is_cut_at_the_cap_and_the_result_says_so(run, code):
    start = time.monotonic()
    text, failed = run(code)
    assert failed and "output truncated" in text and f"more than {SANDBOX_OUTPUT_BYTES} bytes" in text
    assert SANDBOX_OUTPUT_BYTES <= len(text) <= SANDBOX_OUTPUT_BYTES + 200
    assert time.monotonic() - start < 5


def test_an_infinite_loop_times_out(run):
    start = time.monotonic()
    text, failed = run("while True: pass", TIMEOUT)
    assert failed and f"did not finish within {TIMEOUT} s" in text
    assert TIMEOUT <= time.monotonic() - start < TIMEOUT + 3


@pytest.mark.parametrize("code, error", [("x = bytearray(8 * 1024 ** 3)", "MemoryError"),
                                         ("open('big', 'wb').write(b'x' * 50_000_000)", "File too large"),
                                         ("files = [open('f%d' % i, 'w') for i in range(1000)]", "Too many open files")])
def test_huge_allocations_files_and_descriptors_hit_a_limit_and_the_trainer_goes_on(run, code, error):
    text, failed = run(code)
    assert failed and error in text
    assert run("print(6 * 7)") == ("42\n", False)


HOSTILE = [
    "import os; print(os.environ.get('FAKE_SECRET'))",
    "open('/tmp/plait-hostile-escape', 'w').write('x')",
    f"import subprocess\nsubprocess.Popen([{SLEEP!r}, '1000.24680'])\nwhile True: pass",
    "while True: print('x' * 1000)",
    "x = bytearray(8 * 1024 ** 3)",
    "import os\nwhile True: os.fork()",
]


PYTHON_TOOL = python_environment(PythonParams(timeout=1.0, memory_mb=128)).tools[0]
PROGRAMS = itertools.cycle(HOSTILE)
RESULTS: list[str] = []


def calculator(expression: str) -> str:
    """Evaluate arithmetic.

    Args:
        expression: e.g. 3 * (4 + 5)
    """
    # the tiny model was taught to call the calculator: whatever it asks, the env.python tool runs
    # the next hostile program, as if the model had written it
    try:
        RESULTS.append(PYTHON_TOOL.fn(next(PROGRAMS)))
    except RuntimeError as err:  # call_tool hands it to the model as a failure
        RESULTS.append(str(err))
        raise
    return RESULTS[-1]


def tool_turns(completions, **kwargs):
    return [float(sum(message["role"] == "tool" for message in completion)) for completion in completions]


@pytest.mark.skipif(UNLIMITED_ROOT, reason="the trainer runs as root and setpriv is missing: no process limit")
def test_grpo_keeps_training_while_the_model_code_is_hostile(tool_model, monkeypatch):
    monkeypatch.setenv("FAKE_SECRET", "s3cr3t-value")
    model, tokenizer = tool_model
    args = plait.GRPOConfig(output_dir="/tmp/plait-test-sandbox", per_device_train_batch_size=8, num_generations=4,
                            max_completion_length=96, learning_rate=1e-3, max_steps=1, logging_steps=1, report_to=[],
                            save_strategy="no", disable_tqdm=True, seed=0, temperature=0.5)
    trainer = plait.GRPOTrainer(model, reward_funcs=tool_turns, args=args, processing_class=tokenizer, tools=[calculator],
                                train_dataset=[{"prompt": [{"role": "user", "content": QUESTION}]}] * 8)
    trainer.train()
    [logs] = [h for h in trainer.state.log_history if "episodes/tool_calls" in h]
    assert logs["episodes/tool_failures"] > 0 and math.isfinite(logs["loss"]) and math.isfinite(logs["grad_norm"])
    assert len(RESULTS) >= len(HOSTILE)  # each program ran at least once
    assert all("s3cr3t-value" not in result and len(result) <= SANDBOX_OUTPUT_BYTES + 200 for result in RESULTS)
    assert survivors("1000.24680") == []
    if READ_ONLY:
        assert not Path("/tmp/plait-hostile-escape").exists()
