"""Several machines on one host: two ``plait`` commands, ``--num_machines 2 --machine_rank 0|1`` on
loopback (gloo, one process each), as two nodes of a cluster would run them (plait.recipes.launch)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from plait.errors import PlaitError
from plait.recipes.launch import launch_command
from plait.recipes.run import launch_settings
from plait.testing.tiny_model import tiny_model_path

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"
PLAIT = Path(sys.executable).parent / "plait"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # lines as they are printed


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def sft(output: Path, *extra: str) -> list[str]:
    return [str(PLAIT), "sft", "--config", str(RECIPES / "sft_tiny.yaml"), "--model", str(tiny_model_path()),
            "--learning_rate", "1e-2", "--per_device_train_batch_size", "4", "--output_dir", str(output), *extra]


def machine(rank: int, port: int, output: Path, *extra: str, command=sft, env=ENV) -> subprocess.Popen:
    """``plait sft`` (or ``command``) as machine ``rank`` of two would run it."""
    command = command(output, "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(rank),
                      "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *extra)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def power_off(process: subprocess.Popen) -> None:
    """Kill a machine's every process at once: ``plait``, its torch.distributed.run and the training
    process, which torch.distributed.run starts in a session of its own (so not one process group)."""
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for each in tree:
        try:
            each.kill()
        except psutil.NoSuchProcess:
            pass


def test_machines_reach_the_launchers_and_bad_combinations_stop_before_them(tmp_path):
    two = {"num_machines": 2, "main_process_ip": "10.0.0.1"}
    cpu, _ = launch_command(["sft"], 4, "cpu_ddp", gpus=0, machine_rank=1, **two)
    assert cpu[1:7] == ["-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1",
                        "--master_port=29500"] and "--nproc_per_node=2" in cpu  # 4 processes of two machines
    gpu, _ = launch_command(["sft"], None, "multi_gpu", gpus=8, machine_rank=1, main_process_port=6000, **two)
    assert gpu[gpu.index("--num_processes"):gpu.index("-m", 2)] == [  # one per GPU of each machine
        "--num_processes", "16", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1",
        "--main_process_port", "6000"]
    (tmp_path / "cluster.yaml").write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 16\n"
                                           "machine_rank: 0\nmain_process_ip: 10.0.0.1\n")
    from_file, _ = launch_command(["sft"], None, str(tmp_path / "cluster.yaml"), gpus=8, machine_rank=1)
    assert from_file[from_file.index("--num_processes"):][:6] == gpu[gpu.index("--num_processes"):][:6]
    (tmp_path / "recipe.yaml").write_text("method: sft\nnum_machines: 2\nmachine_rank: 1\n")
    assert launch_settings(tmp_path / "recipe.yaml") == {"num_machines": 2, "machine_rank": 1}

    refused = {"--machine_rank 2: must be from 0 to --num_machines - 1 (1)": {"machine_rank": 2, **two},
               "--num_machines 2: needs --main_process_ip": {"num_machines": 2},
               "--num_processes 3: counts the processes of all 2 machines": {"num_processes": 3, **two},
               "--main_process_port 0: must be a TCP port": {"main_process_port": 0, **two},
               "--num_machines 0: must be 1 or more": {"num_machines": 0}}
    for message, settings in refused.items():
        with pytest.raises(PlaitError, match=message.replace("(", r"\(").replace(")", r"\)")):
            launch_command(["sft"], accelerate_config="cpu_ddp", gpus=0, **settings)
    (tmp_path / "bad.yaml").write_text("method: sft\nmachine_rank: one\n")
    with pytest.raises(PlaitError, match="machine_rank"):
        launch_settings(tmp_path / "bad.yaml")


@pytest.fixture
def machines():
    """The started machines; whatever still runs at the end of the test is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        power_off(process)
        process.communicate()


SPREAD_REWARD = """
def spread(completion_ids, **kwargs):  # rewards that differ within a group, so a GRPO step moves the weights
    return [float(sum(ids) % 7) for ids in completion_ids]
"""


@pytest.mark.slow
def test_a_grpo_step_across_two_machines_equals_two_processes_on_one(tmp_path, machines):
    """Generation, group scoring across ranks and the step: the same two ranks reduce in the same order over
    gloo whether they share a host or not, so the weights are bit-identical (the launcher is the same for
    every method; SFT across two machines was measured equal too, and is not repeated here for time)."""
    (tmp_path / "spread_reward.py").write_text(SPREAD_REWARD)
    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"prompt": "{p}"}}\n' for p in ("The river", "Python is")))
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(f"method: grpo\nmodel: {tiny_model_path()}\ndataset: {{path: json, data_files: prompts.jsonl}}\n"
                      "reward_funcs: [spread_reward:spread]\ntraining: {per_device_train_batch_size: 2, "
                      "num_generations: 2, max_completion_length: 5, learning_rate: 1.0e-2, max_steps: 1, "
                      "save_strategy: 'no', report_to: none, seed: 0}\n")
    env = {**ENV, "PYTHONPATH": str(tmp_path)}

    def grpo(output: Path, *extra: str) -> list[str]:
        return [str(PLAIT), "grpo", "--config", str(recipe), "--output_dir", str(output), *extra]

    port = free_port()
    machines += [machine(rank, port, tmp_path / f"machine{rank}", command=grpo, env=env) for rank in (0, 1)]
    outputs = [process.communicate(timeout=300)[0] for process in machines]
    assert [p.returncode for p in machines] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "--nnodes=2 --node_rank=1 --master_addr=127.0.0.1" in outputs[1]  # torch's rendezvous, not plait's
    assert "'train_runtime'" in outputs[0] and "'train_runtime'" not in outputs[1]  # logged once, by global rank 0
    assert not (tmp_path / "machine1" / "model.safetensors").exists()  # saved once, by global rank 0
    one = subprocess.run(grpo(tmp_path / "one", "--num_processes", "2"), env=env, capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    across, here = (load_file(tmp_path / run / "model.safetensors") for run in ("machine0", "one"))
    initial = load_file(tiny_model_path() / "model.safetensors")
    assert any((here[k] != initial[k]).any() for k in here)  # the step moved the weights
    assert all((across[k] == here[k]).all() for k in here)  # generation, scoring and the step: bit-identical


@pytest.mark.slow
def test_a_dead_machine_takes_the_job_down_within_seconds(tmp_path, machines):
    port = free_port()
    machines += [machine(rank, port, tmp_path / f"machine{rank}", "--max_steps", "1000", "--logging_steps", "1")
                 for rank in (0, 1)]
    main, other = machines
    stuck = threading.Timer(300, lambda: [power_off(process) for process in machines])
    stuck.start()  # a test that cannot hang the suite: the reading below ends when the processes do
    for line in main.stdout:  # training is under way once machine 0 logs a loss
        if "'loss'" in line:
            break
    else:
        pytest.fail(f"machine 0 ended before training (exit {main.wait()})")
    power_off(other)
    killed = time.monotonic()
    main.communicate(timeout=120)
    took = time.monotonic() - killed
    stuck.cancel()
    # its peer's gloo connection is reset, so machine 0's process fails and its torch.distributed.run ends
    assert main.returncode != 0 and took < 60, (main.returncode, took)  # seen: exit 1 after ~12 s
