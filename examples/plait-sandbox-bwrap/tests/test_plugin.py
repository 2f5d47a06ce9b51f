"""The bubblewrap box against hostile code; skipped where bwrap is not installed."""

import shutil
import socket
import time

import pytest
from plait_sandbox_bwrap import python_bwrap_environment

from plait.online.tools import ToolCall
from plait.plugins.environments.python_tool import PythonParams

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def run(code, **params):
    env = python_bwrap_environment(PythonParams(**({"timeout": 2.0, "memory_mb": 128} | params)))
    step = env.step("", [ToolCall("run_python", {"code": code})])
    return step.messages[0]["content"], bool(step.failures)


def test_code_runs_and_its_errors_come_back():
    assert run("print(6 * 7)") == ("42\n", False)
    assert run("1 / 0") == ("error: RuntimeError: ZeroDivisionError: division by zero", True)


def test_the_trainer_secrets_files_and_network_are_out_of_sight(monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_SECRET", "s3cr3t-value")
    text, failed = run(f"import os\nprint(dict(os.environ), os.path.exists({str(tmp_path)!r}))")
    assert not failed and "s3cr3t-value" not in text and text.endswith("} False\n")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        text, failed = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert failed and "Connection refused" in text  # its own loopback, where nothing listens
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_output_is_capped_and_an_infinite_loop_times_out():
    text, failed = run("while True: print('x' * 1000)", output_bytes=4096)
    assert not failed and text.endswith("[output truncated at 4096 bytes]") and len(text) < 4200
    start = time.monotonic()
    text, failed = run("while True: pass")
    assert failed and "did not finish within 2.0 s" in text and time.monotonic() - start < 3
