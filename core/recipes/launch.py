"""Start one ``plait <method>`` command on N processes: the same recipe, unchanged, on 1 or N.

``--num_processes N`` / ``--accelerate_config NAME|PATH`` (flags, or top-level keys of the recipe)
relaunch the command as ``python -m plait.cli ...`` in every process, which, like the ``plait``
script, never imports from the working directory. Presets live in ``plait/accelerate_configs/``
(cpu_ddp, single_gpu, multi_gpu, fsdp1, fsdp2, zero1, zero2, zero3; TRL's names, and ``fsdp`` is
fsdp2); any accelerate config file works too. GPU presets go through ``accelerate launch``.
CPU processes go through ``torch.distributed.run`` instead, because ``accelerate launch --cpu``
expects mpirun and starts a single process; the processes are told to use the CPU
(``ACCELERATE_USE_CPU``), so accelerate joins them with gloo, and each gets an equal share of
the cores. That is cpu_ddp, and fsdp2 on a machine without GPUs: its processes also get the
FSDP settings ``accelerate launch`` would give them, and :func:`plait.engine.processes.shard_on_cpu` turns FSDP on in
them (accelerate 1.15 enables it for GPU-type backends only; torch's fully_shard runs over gloo).
The other GPU presets refuse to start without a GPU: multi_gpu and DeepSpeed processes would
each train alone, and FSDP1 wants an accelerator device (accelerate: "There are currently no
available devices found"; torch: "Inconsistent compute device and `device_id`"). Every refusal is
:func:`launch_plan`'s, which ``plait <method> --check`` calls too, so a check passes only a launch
that can start on this machine.
"""

from __future__ import annotations

import difflib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import attrs
import yaml

from plait.engine.redact import masked_argv
from plait.errors import PlaitError

PRESETS = Path(__file__).with_name("accelerate_configs")
CPU_PRESET, GPU_PRESET = "cpu_ddp", "multi_gpu"
OTHER_NAMES = {"fsdp": "fsdp2"}  # plait's earlier name of the FSDP2 preset


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def preset_path(name_or_path: str) -> Path:
    """A preset by name, or an accelerate config file by path."""
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml", ".json") and path.is_file():
        return path
    name_or_path = OTHER_NAMES.get(name_or_path, name_or_path)
    if (PRESETS / f"{name_or_path}.yaml").is_file():
        return PRESETS / f"{name_or_path}.yaml"
    match = difflib.get_close_matches(name_or_path, presets(), n=1, cutoff=0.5)
    hint = f"did you mean {match[0]!r}? " if match else ""
    raise PlaitError(f"--accelerate_config {name_or_path!r}: no such preset or file; {hint}"
                     f"presets: {', '.join(presets())}, or the path of an accelerate config file")


def inside_launched_process() -> bool:
    """Inside a process that torchrun/accelerate started (so never relaunch from here)."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _fsdp_environment(path: Path, n: int) -> dict[str, str]:
    """The FSDP_* / ACCELERATE_* variables ``accelerate launch --config_file path`` gives its processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "--num_processes", str(n), "plait"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_")) and os.environ.get(k) != v}


@attrs.frozen
class LaunchPlan:
    """How a launch will start on this machine: the preset file, its settings and the process count."""

    path: Path
    preset: dict
    processes: int
    on_cpu: bool  # a CPU preset (cpu_ddp): torch.distributed.run with gloo
    fsdp_on_cpu: bool  # a GPU FSDP2 preset on a machine without GPUs: the same, plus accelerate's FSDP settings

    def describe(self) -> str:
        where = "CPU processes (torch.distributed.run, gloo)" if self.on_cpu or self.fsdp_on_cpu else \
            "processes (accelerate launch)"
        return f"{self.processes} {where}, preset {self.path.stem if self.path.parent == PRESETS else self.path}"


def launch_plan(num_processes: int | None = None, accelerate_config: str | None = None,
                gpus: int | None = None) -> LaunchPlan:
    """What :func:`launch_command` will start on a machine with ``gpus`` GPUs (default: this one's), or
    the one-line refusal of a launch that cannot start here. ``plait <method> --check`` calls it too."""
    if num_processes is not None and num_processes < 1:
        raise PlaitError(f"--num_processes {num_processes}: must be 1 or more")
    gpus = _gpus() if gpus is None else gpus
    path = preset_path(accelerate_config or (GPU_PRESET if gpus else CPU_PRESET))
    try:
        preset = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise PlaitError(f"--accelerate_config {str(path)!r} is not valid YAML ({err}); fix the file") from err
    if not isinstance(preset, dict):
        raise PlaitError(f"--accelerate_config {str(path)!r}: expected an accelerate config mapping; fix the file")
    on_cpu = bool(preset.get("use_cpu")) or preset.get("distributed_type") == "MULTI_CPU"
    fsdp_on_cpu = preset.get("distributed_type") == "FSDP" and not gpus and not on_cpu
    if fsdp_on_cpu and str((preset.get("fsdp_config") or {}).get("fsdp_version", 1)) == "1":
        raise PlaitError(f"--accelerate_config {path.stem}: FSDP1 needs GPUs and this machine has none (its "
                         "sync_module_states and torch's FullyShardedDataParallel want an accelerator device); "
                         "use fsdp2, which shards over CPU processes too, or cpu_ddp")
    if preset.get("distributed_type") in ("MULTI_GPU", "DEEPSPEED") and not gpus and not on_cpu:
        raise PlaitError(f"--accelerate_config {path.stem}: needs GPUs and this machine has none (each process "
                         "would train alone); use cpu_ddp, or fsdp2, which shards over CPU processes too")
    if preset.get("distributed_type") == "NO":  # single_gpu: one process whatever the machine has
        if num_processes not in (None, 1):
            raise PlaitError(f"--num_processes {num_processes}: --accelerate_config {path.stem} runs one process; "
                             "use multi_gpu (or fsdp2, zero2 ...) for more")
        num_processes = 1
    n = num_processes or (preset.get("num_processes") if on_cpu else gpus or preset.get("num_processes")) or 1
    return LaunchPlan(path, preset, n, on_cpu, fsdp_on_cpu)


def launch_command(argv: list[str], num_processes: int | None = None, accelerate_config: str | None = None,
                   environ: dict | None = None, gpus: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``plait <argv>`` on ``num_processes`` processes
    (on a machine with ``gpus`` GPUs; default: this one's), as :func:`launch_plan` plans them."""
    plan = launch_plan(num_processes, accelerate_config, gpus)
    env = dict(os.environ if environ is None else environ)
    # `python -m` puts the working directory first on sys.path, so a stray pluggy.py (or torch.py)
    # there would run in every process. PYTHONSAFEPATH is `python -P` for this process and every one
    # it starts (Python >= 3.11); the `plait` console script never looks in the working directory either.
    env["PYTHONSAFEPATH"] = "1"
    n = plan.processes
    module = ["-m", "plait.cli", *argv]
    if plan.fsdp_on_cpu:
        env.update(_fsdp_environment(plan.path, n))
    if plan.on_cpu or plan.fsdp_on_cpu:
        env["ACCELERATE_USE_CPU"] = "true"  # -> accelerate picks MULTI_CPU with gloo in every process
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *module]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(plan.path),
                   "--num_processes", str(n), *module]
    return command, env


def launch(argv: list[str], num_processes: int | None = None, accelerate_config: str | None = None) -> int:
    """Run ``plait <argv>`` on ``num_processes`` processes and wait; returns the exit status."""
    command, env = launch_command(argv, num_processes, accelerate_config)
    print(f"plait: {shlex.join(masked_argv(command))}", file=sys.stderr)  # echoed, so secrets as their markers
    return subprocess.run(command, env=env).returncode
