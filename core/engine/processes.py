"""The processes of a launched run (``plait <method> --num_processes N``, ``torchrun``, ``accelerate
launch``), from inside the trainer: leaving the process group cleanly at exit, and FSDP over CPU
processes, which accelerate leaves off (the launcher, :mod:`plait.recipes.launch`, sets them up)."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import weakref

_group_holders: weakref.WeakSet = weakref.WeakSet()


def leave_process_group_at_exit(holder) -> None:
    """When the interpreter exits, call ``holder.release_process_group()`` and leave the group.

    For any script that builds a trainer in a launched process (``torchrun train.py``), not only
    ``plait <method>``. Leaving is not enough while a DDP wrapper still holds the group: gloo's
    threads then outlive the interpreter and abort the process after the run saved ("terminate
    called without an active exception"), so the holder drops its wrappers first."""
    if not _group_holders:
        atexit.unregister(_leave_at_exit)  # once per process, however many trainers come and go
        atexit.register(_leave_at_exit)
    _group_holders.add(holder)


def _leave_at_exit() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # a single process: nothing to leave, and no collection to pay for at exit
    for holder in list(_group_holders):
        holder.release_process_group()
    gc.collect()  # the wrappers' last references, so the group's threads are joined when it is left
    if dist.is_initialized():  # an in-process vLLM engine that made the group leaves it as it closes
        dist.destroy_process_group()


def shard_on_cpu(accelerator) -> bool:
    """In a CPU process started for an FSDP preset, turn accelerate's FSDP on (before the model is
    prepared); True if it did. accelerate 1.15 reads the FSDP settings but keeps a CPU process on
    DDP; torch's FSDP (fully_shard) runs over gloo, so only the switch is missing."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU or os.environ.get("ACCELERATE_USE_FSDP") != "true":
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables, as accelerate would build it
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as accelerate does for GPU FSDP
    if accelerator.is_main_process:
        print(f"plait: FSDP{plugin.fsdp_version} over {accelerator.num_processes} CPU processes (gloo)", file=sys.stderr)
    return True
