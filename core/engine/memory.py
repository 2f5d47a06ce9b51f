"""CPU memory: torch asked to page-align its large buffers, so glibc's heap does not fragment.

torch's CPU tensors come from glibc's ``posix_memalign``, 64-byte aligned. glibc's mmap threshold
rises to the largest block freed so far (up to 32 MiB), so after the first step a small model's
activations, recomputed checkpoints and gradients all come from its heap, and the heap fragments
as every step's tensors of many sizes come and go: the process holds far more than it uses.
torch's switch ``THP_MEM_ALLOC_ENABLE=1`` aligns every buffer of 2 MiB or more to a page (and
advises transparent huge pages for it), and with page-aligned blocks the heap stays close to what
is in use. Measured on SmolLM2-135M, 512 tokens, batch 4, fp32 with gradient checkpointing, peak
RSS without and with it (benchmarks/cpu_memory.py, results/cpu_memory.json): reward model 5135 ->
3256 MiB, KTO 4558 -> 3943; step times within this machine's run-to-run noise (reward model 40.4
and 44.8 s/step in one pair, 45.4 and 43.2 in another). A forward and backward alone gave the
same peak with transparent huge pages disabled for the process (prctl), so the alignment is what
does it. Holding glibc's mmap threshold at 128 KiB instead (every freed block unmapped) gave the
reward model 2725 MiB but 1.22x the step time: each block comes back as fresh pages to zero.

torch reads the switch once, at its first CPU allocation, so :func:`align_large_cpu_buffers` runs
when plait is imported (``import plait`` imports no torch): the ``plait`` command and any script
that imports plait before it creates a tensor get it. A value the user set, ``0`` included, stays.

The opposite cost remains: glibc gives freed memory at the top of its heap back to the system
(above a trim threshold, 128 KiB at first, raised as larger blocks are freed, at most 64 MiB), and a tensor
made in that memory afterwards page-faults every page in again, zeroed by the kernel. A training
step makes and frees the same activations every step, so it pays that again and again (30,000 to
230,000 page faults per SmolLM2 step). :func:`keep_freed_heap` holds on to freed heap memory instead:
it fixes glibc's mmap threshold at its largest (32 MiB: smaller blocks come from the heap), its
trim threshold near 2 GiB, and grows the heap 256 MiB at a time (``M_TOP_PAD``). A CPU training run calls it (:class:`plait.engine.trainer.PlaitTrainer`).
Measured on SmolLM2-135M, 512 tokens, batch 4, on a 2-core Xeon with AMX (benchmarks/cpu_memory.py
``--switch PLAIT_KEEP_FREED_HEAP``, docs/benchmarks.md): SFT 7.13 -> 5.29 s/step in bf16 and
10.68 -> 9.22 in fp32, the reward model 7.58 -> 6.13 (another pair level) and 14.73 -> 12.74, DPO,
KTO, ORPO, CPO and GRPO 5-22% faster, for 0-5% more peak RSS. A user's own glibc
settings (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_MMAP_MAX_``, ``MALLOC_TOP_PAD_``,
``GLIBC_TUNABLES``) are kept, and ``PLAIT_KEEP_FREED_HEAP=0`` leaves glibc's defaults.

:func:`keep_freed_heap` also turns glibc's own mappings off (``M_MMAP_MAX`` 0), so blocks of 32 MiB and more
come from the heap too. glibc serves such a block from free heap space when it has room, but where the heap
would have to grow it maps the block afresh instead, so the heap never grows to hold it and the block is
mapped again next time: a step's largest tensors were its biggest page-fault bill. One chunk of output-layer
logits (682 positions × 49,152 tokens, 134 MB in float32), its bf16 projection (67 MB), its log-softmax and
gradient, and the bf16 cast of a tied embedding (57 MB) are such blocks, made and freed every chunk of every
step. Measured on a 2-core Xeon with AMX: a 38 MB elementwise product 11.5 -> 2.0 ms, the output layer's
bf16 projection of 682 positions 0.73 -> 1.51 TFLOP/s, and a step of SFT, DPO, KTO, ORPO, CPO or GKD 15-34%
faster (SmolLM2, 512 tokens, bf16), peak RSS within 3% (DPO + LoRA: +9 to +21%).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

TORCH_SWITCH = "THP_MEM_ALLOC_ENABLE"
KEEP_FREED_HEAP = "PLAIT_KEEP_FREED_HEAP"
GLIBC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_",
                  "GLIBC_TUNABLES")
# mallopt's parameters (glibc's malloc.h) and the values keep_freed_heap sets
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
HEAP_SETTINGS = {M_MMAP_THRESHOLD: 32 * 2**20, M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 256 * 2**20, M_MMAP_MAX: 0}
# 64 MiB of float32: above glibc's largest mmap threshold, so its own mapping (after keep_freed_heap a heap
# block, where torch's 64-byte alignment lands on a page 1 time in 64: the check then stays silent)
PROBE_ELEMENTS = 16 * 2**20


def align_large_cpu_buffers() -> None:
    """Ask torch to page-align its CPU buffers of 2 MiB or more, unless the user chose already."""
    os.environ.setdefault(TORCH_SWITCH, "1")


def large_buffers_aligned() -> bool:
    """Whether this process's torch page-aligns its large CPU buffers. A 64 MiB block is glibc's
    own mapping, which starts on a page: torch's 64-byte alignment puts the data 64 bytes in,
    page alignment at the start."""
    import torch

    return torch.empty(PROBE_ELEMENTS).data_ptr() % os.sysconf("SC_PAGE_SIZE") == 0


@functools.cache
def keep_freed_heap() -> bool:
    """Have glibc keep freed heap memory for the next step's tensors instead of returning it to the system
    (see the module docstring). Once per process; False where it did nothing: not glibc, the user's own
    glibc settings, or ``PLAIT_KEEP_FREED_HEAP=0``."""
    if os.environ.get(KEEP_FREED_HEAP) == "0" or any(name in os.environ for name in GLIBC_SETTINGS):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in HEAP_SETTINGS.items())
