"""Shared test setup: no model hub, no tokenizer thread pools, no PLAIT_* switches leaking in."""

import os
import platform
import tempfile

# Set before transformers/huggingface_hub are imported by any test module: an accidental hub
# call must fail fast instead of hanging on a network that is not there.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The registry catalog (plait.catalog) of this test session, not the user's ~/.cache/plait.
os.environ.setdefault("PLAIT_CACHE_DIR", tempfile.mkdtemp(prefix="plait-test-cache-"))

# The suite's numbers and learning thresholds hold at fp32; plait picks bf16 autocast by default
# on a CPU with AVX-512 BF16 (plait.engine.config.cpu_bf16_support), so on such a machine every default-
# precision test would run another precision. Torch's kernels at AVX2 (its own switch, read when
# torch loads, inherited by every subprocess) keep the default fp32 on any x86 box; bf16 itself is
# tested with bf16=True (test_precision.py, test_logprobs.py).
def _has_avx2() -> bool:  # torch takes the switch on trust: never name a level the CPU lacks
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and " avx2" in line for line in info)
    except OSError:
        return False


if platform.machine() in ("x86_64", "AMD64") and _has_avx2():
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import pytest  # noqa: E402

def pytest_sessionstart(session):
    """Suites before 2026-12 installed the example plugin into the venv itself (test_example_plugin.py
    now installs it per test process); remove such a copy once, before any worker starts, or the
    uninstall test would still find it there."""
    import importlib.metadata
    import subprocess
    import sys

    if hasattr(session.config, "workerinput"):
        return
    try:
        importlib.metadata.distribution("plait-example-plugin")
    except importlib.metadata.PackageNotFoundError:
        return
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", "plait-example-plugin"], check=True)


PLAIT_SWITCHES = ("PLAIT_DISABLE_PLUGINS", "PLAIT_DISABLE_PLUGIN_AUTOLOAD", "PLAIT_ON_PLUGIN_ERROR", "PLAIT_TRACE_HOOKS")


@pytest.fixture(autouse=True)
def _no_plait_switches(monkeypatch):
    """Each test sees the plugin switches unset unless it sets them itself (with monkeypatch)."""
    for name in PLAIT_SWITCHES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tool_model():
    """The tiny model taught the calculator's call format (plait.testing.tool_model), with its
    tokenizer; one torch thread while the module runs (several times faster on a busy machine),
    restored after it so later modules run as they would alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.testing.tool_model import tool_model_path

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tool_model_path()
    yield AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    torch.set_num_threads(threads)
