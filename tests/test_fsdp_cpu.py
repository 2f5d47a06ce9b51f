"""The fsdp2 preset beyond DDP, on this CPU: ``plait sft --accelerate_config fsdp2 --num_processes 2``
shards the model over two gloo processes (torch's fully_shard, switched on by plait because
accelerate 1.15 enables FSDP only for GPU backends) and ends with the weights the cpu_ddp run
ends with, saved as the same ordinary safetensors folder. Presets that cannot run without a GPU
refuse in one line; their commands on a GPU machine are tested in test_run / test_trl_cli."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from plait.errors import PlaitError
from plait.recipes.launch import launch_command
from plait.testing.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
PLAIT = Path(sys.executable).parent / "plait"


def test_fsdp2_without_gpus_starts_cpu_processes_with_accelerate_s_fsdp_settings():
    command, env = launch_command(["sft", "--config", "r.yaml"], 2, "fsdp2", environ={}, gpus=0)
    assert command == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       "-m", "plait.cli", "sft", "--config", "r.yaml"]
    # what `accelerate launch --config_file fsdp2.yaml` would set, plus gloo on the CPU
    assert {k: env[k] for k in ("ACCELERATE_USE_CPU", "ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_STATE_DICT_TYPE",
                                "FSDP_AUTO_WRAP_POLICY", "FSDP_CPU_RAM_EFFICIENT_LOADING")} == {
        "ACCELERATE_USE_CPU": "true", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
        "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
    # with GPUs the same preset goes through accelerate launch, which sets all that up itself
    command, env = launch_command(["sft"], 2, "fsdp2", environ={}, gpus=2)
    assert "accelerate.commands.launch" in command and "ACCELERATE_USE_FSDP" not in env


@pytest.mark.parametrize("preset, message", [
    ("fsdp1", "--accelerate_config fsdp1: FSDP1 needs GPUs and this machine has none"),
    ("multi_gpu", "--accelerate_config multi_gpu: needs GPUs and this machine has none .each process would train alone"),
    ("zero2", "--accelerate_config zero2: needs GPUs and this machine has none"),
])
def test_presets_that_cannot_run_without_a_gpu_refuse_in_one_line(preset, message):
    # without the refusal, accelerate launch would start N processes that each train alone and exit 0
    with pytest.raises(PlaitError, match=message):
        launch_command(["sft"], 2, preset, environ={}, gpus=0)


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_ends_with_the_ddp_run_s_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    common = ["sft", "--config", str(ROOT / "examples" / "recipes" / "sft_tiny.yaml"), "--model", str(tiny_model_path()),
              "--max_steps", "4", "--logging_steps", "2", "--learning_rate", "1e-2",
              "--per_device_train_batch_size", "4", "--num_processes", "2",
              # fp32 on every CPU: under bf16 FSDP2 casts the parameters and reduces the gradients in bf16
              # (accelerate's MixedPrecisionPolicy) while DDP autocasts and reduces in fp32, so the two runs
              # would differ by bf16 rounding, which hides what this compares
              "--bf16", "false"]
    runs = {}
    for preset in ("cpu_ddp", "fsdp2"):
        run = subprocess.run([str(PLAIT), *common, "--accelerate_config", preset, "--output_dir", str(tmp_path / preset)],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[preset] = run
    assert "plait: FSDP2 over 2 CPU processes (gloo)" in runs["fsdp2"].stderr  # sharded, not a DDP fallback
    assert "FSDP" not in runs["cpu_ddp"].stderr
    assert runs["fsdp2"].stdout.count("'loss'") == 2  # logged once, by the main process

    ddp, fsdp = load_file(tmp_path / "cpu_ddp" / "model.safetensors"), load_file(tmp_path / "fsdp2" / "model.safetensors")
    initial = load_file(tiny_model_path() / "model.safetensors")
    assert set(fsdp) == set(ddp) == set(initial)  # one ordinary folder: the tied lm_head is not saved twice
    for name in ddp:
        # Same global batch, same data order, same update; only float summation order differs (FSDP
        # reduce-scatters gradient shards, DDP all-reduces buckets). Measured: at most 1.2e-7 (one
        # ulp at |w| ~ 1) after 4 steps at lr 1e-2. The bound leaves room for Adam magnifying
        # ulp-level gradient differences, yet is far below one update (lr 1e-2 moves weights by up to
        # 2.5e-2), so a lost, doubled or unsynchronised gradient fails it.
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=0, atol=1e-5)
    assert any(not torch.equal(ddp[k], initial[k]) for k in ddp)  # it trained

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp2")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # tied again on load
    for name, param in reloaded.state_dict().items():
        if name in fsdp:
            assert torch.equal(param, fsdp[name])
