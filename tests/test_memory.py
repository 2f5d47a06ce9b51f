"""plait.engine.memory: importing plait asks torch to page-align its large CPU buffers (glibc's heap then
fragments far less: benchmarks/cpu_memory.py), before torch's first tensor, which is when torch
reads the switch; a user's own value stays, and a CPU trainer says when it came too late. A CPU
trainer also has glibc keep freed heap memory, so the next step's tensors do not page-fault it back
in; ``PLAIT_KEEP_FREED_HEAP=0`` and a user's own glibc settings leave glibc's defaults.

Each check runs in a fresh process: torch reads the switch once per process."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torch page-aligns large buffers on Linux only")

ALIGNED = "from plait.engine.memory import large_buffers_aligned; print('aligned', large_buffers_aligned())"
TRAIN = """
import logging
from datasets import Dataset
from plait import SFTConfig, SFTTrainer
from plait.testing.tiny_model import tiny_model_path
logging.basicConfig(level=logging.INFO)
args = SFTConfig(output_dir={out!r}, max_steps=1, save_strategy="no", report_to="none", per_device_train_batch_size=2)
SFTTrainer(str(tiny_model_path()), args=args, train_dataset=Dataset.from_list([{{"text": "the river"}}] * 2)).train()
"""


# Tensors made and freed round after round, then the median page faults of a round and the bytes glibc held
# as mappings of their own while a round's tensors lived. Eight 12 MiB tensors (REUSE): glibc trims the freed
# top of its heap (96 MiB, above its trim threshold) after each round, unless told to keep it; then every
# round page-faults it back in. Three rounds first: a kept heap still grows in its first rounds, as small
# allocations settle in the space the large tensors freed (measured: 0 faults a round after them, 12 of 12
# runs, where the first rounds faulted up to 4,288), and the median of ten rounds, not the sum, is compared.
ROUNDS = """
import ctypes, resource, statistics, torch
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def round_of_tensors():
    tensors = [torch.ones({elements}) for _ in range({count})]
    mapped = libc.mallinfo2().hblkhd
    del tensors
    return mapped
for _ in range(3):
    round_of_tensors()
per_round = []
for _ in range(10):
    before = faults()
    mapped = round_of_tensors()
    per_round.append(faults() - before)
print("mapped", mapped)
print("faults", statistics.median(per_round), per_round)
"""
REUSE = ROUNDS.format(elements=3 * 2**20, count=8)
KEEP = "from plait.engine.memory import keep_freed_heap\nprint('kept', keep_freed_heap())\n"


def run_python(code: str, switch: str | None = None, **env: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "PLAIT_KEEP_FREED_HEAP")},
           **env}
    if switch is not None:
        env["THP_MEM_ALLOC_ENABLE"] = switch
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_importing_plait_page_aligns_torchs_large_buffers():
    # torch reads the switch at its first tensor: plait imported after it changes nothing
    without = run_python("import torch; torch.ones(1)\n" + ALIGNED)
    assert "aligned False" in without.stdout  # torch's own 64-byte alignment: 64 bytes into glibc's mapping
    assert "aligned True" in run_python("import plait, torch\n" + ALIGNED).stdout


def test_a_users_own_value_stays():
    out = run_python("import os, plait\nprint('switch', os.environ['THP_MEM_ALLOC_ENABLE'])\n" + ALIGNED, switch="0")
    assert "switch 0" in out.stdout and "aligned False" in out.stdout


def test_a_cpu_trainer_says_when_plait_came_after_torchs_first_tensor(tmp_path):
    late = run_python("import torch; torch.ones(1)\n" + TRAIN.format(out=str(tmp_path / "late")))
    early = run_python(TRAIN.format(out=str(tmp_path / "early")))
    assert "not page-aligned" in late.stderr and "import plait first" in late.stderr
    assert "not page-aligned" not in early.stderr


def faults(out: subprocess.CompletedProcess) -> float:
    return float(out.stdout.split("faults ")[-1].split()[0])


def mapped(out: subprocess.CompletedProcess) -> int:
    return int(out.stdout.split("mapped ")[-1].split()[0])


def test_a_cpu_training_run_reuses_freed_memory_instead_of_faulting_it_back_in(tmp_path):
    kept = run_python(TRAIN.format(out=str(tmp_path / "kept")) + REUSE)
    trimmed = run_python(TRAIN.format(out=str(tmp_path / "trimmed")) + REUSE, PLAIT_KEEP_FREED_HEAP="0")
    assert faults(trimmed) > 10 * max(faults(kept), 100), (trimmed.stdout, kept.stdout)


# Eight 48 MiB tensors made and freed round after round in a fresh process. glibc serves a block from free heap
# space when it has room (up to the 256 MiB it pads each growth with); where the heap would have to grow, a
# block above glibc's largest mmap threshold (32 MiB) becomes a mapping of its own instead, unmapped when
# freed and faulted in page by page the next time, so the heap never grows to hold it (in a training step:
# chunks of output-layer logits). 384 MiB a round is more than the pad, so some blocks always need growth.
REUSE_LARGE = ROUNDS.format(elements=12 * 2**20, count=8)


def test_kept_heap_serves_blocks_above_glibcs_mmap_threshold_too():
    kept = run_python(KEEP + REUSE_LARGE)
    trimmed = run_python(KEEP + REUSE_LARGE, PLAIT_KEEP_FREED_HEAP="0")
    assert "kept True" in kept.stdout and "kept False" in trimmed.stdout
    # glibc's own mappings: none of the round's blocks kept (392 KiB mapped before keep_freed_heap remain);
    # left on, the blocks the heap had no room for (388 MiB measured)
    block = 48 * 2**20
    assert mapped(kept) < block <= mapped(trimmed), (kept.stdout, trimmed.stdout)
    # measured, median faults a round: kept 0; with glibc's mappings left on 2,680-4,288
    assert faults(trimmed) > 10 * max(faults(kept), 100), (trimmed.stdout, kept.stdout)


def test_a_users_own_glibc_settings_are_kept():
    assert "kept True" in run_python(KEEP).stdout
    assert "kept False" in run_python(KEEP, MALLOC_TRIM_THRESHOLD_="131072").stdout
    assert "kept False" in run_python(KEEP, MALLOC_MMAP_MAX_="65536").stdout
    assert "kept False" in run_python(KEEP, PLAIT_KEEP_FREED_HEAP="0").stdout
