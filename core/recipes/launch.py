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

Several machines: ``--num_machines M --machine_rank R --main_process_ip IP [--main_process_port P]``
(flags, top-level recipe keys, or the same keys of an accelerate config file; the command line wins),
the same command on every machine but for R. ``--num_processes`` then counts the processes of all
machines, as accelerate's does, M of them sharing it equally. plait builds no rendezvous of its own:
the CPU path passes the machines to torch.distributed.run's static rendezvous (``--nnodes --node_rank
--master_addr --master_port``), the GPU path to ``accelerate launch``, which does the same. A process
that dies takes the job down: its gloo/NCCL peers fail on the closed connection, and each machine's
torch.distributed.run stops its own processes and exits non-zero (tests/test_multinode.py).
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
# the several-machines settings: flags, top-level recipe keys and accelerate config keys alike
MACHINE_SETTINGS = {"num_machines": int, "machine_rank": int, "main_process_ip": str, "main_process_port": int}
DEFAULT_PORT = 29500  # torch.distributed.run's and accelerate's


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
class Machines:
    """The machines of a launch: how many, which one this is, and where machine 0 listens."""

    count: int = 1
    rank: int = 0
    main_ip: str | None = None
    main_port: int = DEFAULT_PORT

    @classmethod
    def of(cls, preset: dict, given: dict) -> Machines:
        """From the flags (or recipe keys) ``given``, else the accelerate config ``preset``; the one-line
        refusal of a combination that could not meet."""
        value = {key: given[key] if given.get(key) is not None else preset.get(key) for key in MACHINE_SETTINGS}
        defaults = {"num_machines": 1, "machine_rank": 0, "main_process_port": DEFAULT_PORT}
        value = {key: defaults.get(key) if v is None else v for key, v in value.items()}
        count, rank, ip, port = value["num_machines"], value["machine_rank"], value["main_process_ip"] or None, \
            value["main_process_port"]
        if count < 1:
            raise PlaitError(f"--num_machines {count}: must be 1 or more")
        if not 0 <= rank < count:
            raise PlaitError(f"--machine_rank {rank}: must be from 0 to --num_machines - 1 ({count - 1}); "
                             "give each machine its own rank, 0 on the one at --main_process_ip")
        if count > 1 and not ip:
            raise PlaitError(f"--num_machines {count}: needs --main_process_ip, the address of machine 0 that every "
                             "machine can reach (e.g. --main_process_ip 10.0.0.1)")
        if not 1 <= port <= 65535:
            raise PlaitError(f"--main_process_port {port}: must be a TCP port from 1 to 65535 (default {DEFAULT_PORT})")
        return cls(count, rank, ip, port)

    def describe(self) -> str:
        return f" on machine {self.rank} of {self.count} (machine 0 at {self.main_ip}:{self.main_port})" \
            if self.count > 1 else ""


@attrs.frozen
class LaunchPlan:
    """How a launch will start on this machine: the preset file, its settings and the process count."""

    path: Path
    preset: dict
    processes: int  # of all machines, as accelerate counts them
    on_cpu: bool  # a CPU preset (cpu_ddp): torch.distributed.run with gloo
    fsdp_on_cpu: bool  # a GPU FSDP2 preset on a machine without GPUs: the same, plus accelerate's FSDP settings
    machines: Machines = Machines()

    @property
    def processes_here(self) -> int:
        return self.processes // self.machines.count

    def describe(self) -> str:
        where = "CPU processes (torch.distributed.run, gloo)" if self.on_cpu or self.fsdp_on_cpu else \
            "processes (accelerate launch)"
        return (f"{self.processes_here} {where}{self.machines.describe()}, "
                f"preset {self.path.stem if self.path.parent == PRESETS else self.path}")


def launch_plan(num_processes: int | None = None, accelerate_config: str | None = None,
                gpus: int | None = None, **machines) -> LaunchPlan:
    """What :func:`launch_command` will start on a machine with ``gpus`` GPUs (default: this one's), or
    the one-line refusal of a launch that cannot start here. ``plait <method> --check`` calls it too.
    ``machines``: the :data:`MACHINE_SETTINGS` given on the command line or in the recipe."""
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
    where = Machines.of(preset, machines)
    if preset.get("distributed_type") == "NO":  # single_gpu: one process whatever the machine has
        if num_processes not in (None, 1) or where.count > 1:
            raise PlaitError(f"--num_processes {num_processes or where.count}: --accelerate_config {path.stem} "
                             "runs one process; use multi_gpu (or fsdp2, zero2 ...) for more")
        num_processes = 1
    # without --num_processes, each machine runs what the preset runs on one machine (or one per GPU)
    per_machine = (preset.get("num_processes") or 1) // (preset.get("num_machines") or 1)
    n = num_processes or (per_machine if on_cpu else gpus or per_machine or 1) * where.count
    if n % where.count:
        raise PlaitError(f"--num_processes {n}: counts the processes of all {where.count} machines, so must be a "
                         f"multiple of --num_machines {where.count} (e.g. {where.count * max(1, n // where.count)})")
    return LaunchPlan(path, preset, n, on_cpu, fsdp_on_cpu, where)


def launch_command(argv: list[str], num_processes: int | None = None, accelerate_config: str | None = None,
                   environ: dict | None = None, gpus: int | None = None, **machines) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``plait <argv>`` on ``num_processes`` processes
    (on a machine with ``gpus`` GPUs; default: this one's), as :func:`launch_plan` plans them."""
    plan = launch_plan(num_processes, accelerate_config, gpus, **machines)
    where = plan.machines
    env = dict(os.environ if environ is None else environ)
    # `python -m` puts the working directory first on sys.path, so a stray pluggy.py (or torch.py)
    # there would run in every process. PYTHONSAFEPATH is `python -P` for this process and every one
    # it starts (Python >= 3.11); the `plait` console script never looks in the working directory either.
    env["PYTHONSAFEPATH"] = "1"
    n = plan.processes_here
    module = ["-m", "plait.cli", *argv]
    if plan.fsdp_on_cpu:
        env.update(_fsdp_environment(plan.path, plan.processes))
    if plan.on_cpu or plan.fsdp_on_cpu:
        env["ACCELERATE_USE_CPU"] = "true"  # -> accelerate picks MULTI_CPU with gloo in every process
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        # one machine: a rendezvous on a free local port; several: torch's static one at machine 0
        rendezvous = ["--standalone"] if where.count == 1 else [
            f"--nnodes={where.count}", f"--node_rank={where.rank}", f"--master_addr={where.main_ip}",
            f"--master_port={where.main_port}"]
        command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={n}", *module]
    else:
        rendezvous = [] if where.count == 1 else [
            "--num_machines", str(where.count), "--machine_rank", str(where.rank),
            "--main_process_ip", where.main_ip, "--main_process_port", str(where.main_port)]
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(plan.path),
                   "--num_processes", str(plan.processes), *rendezvous, *module]
    return command, env


def launch(argv: list[str], num_processes: int | None = None, accelerate_config: str | None = None,
           **machines) -> int:
    """Run ``plait <argv>`` on ``num_processes`` processes and wait; returns the exit status."""
    command, env = launch_command(argv, num_processes, accelerate_config, **machines)
    print(f"plait: {shlex.join(masked_argv(command))}", file=sys.stderr)  # echoed, so secrets as their markers
    return subprocess.run(command, env=env).returncode
