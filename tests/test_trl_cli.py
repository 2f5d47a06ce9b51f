"""A TRL user's commands and recipes run on plait unchanged: TRL's script flags on ``plait <method>``,
TRL's flat YAML recipes beside plait's sectioned ones, TRL's command names (``plait reward``,
``plait distillation``, ``plait env``), its script helpers (ModelConfig, TrlParser ...) and its
accelerate presets. Training runs go through the installed ``plait`` console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import plait
from plait.cli import main
from plait.errors import PlaitError
from plait.recipes.launch import PRESETS, launch_command, preset_path
from plait.recipes.run import load_recipe
from plait.testing.tiny_model import tiny_model_path
from plait.trl.script_args import DatasetConfig, ModelConfig, ScriptArguments, load_mixture

ROOT = Path(__file__).resolve().parents[1]
PLAIT = Path(sys.executable).parent / "plait"  # the console script installed beside this python
SFT_DATA = ROOT / "examples" / "data" / "demo_sft.jsonl"
PREFERENCES = ROOT / "examples" / "data" / "demo_preferences.jsonl"


def plait_command(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(PLAIT), *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def rows(path: Path, n: int, tag: str) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{tag}{i}", "completion": "ok", "extra": i}) + "\n" for i in range(n)))
    return path


# -- the command line ----------------------------------------------------------------------------


def test_trl_sft_command_trains_lora_adapters_from_a_local_file(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sft.jsonl").write_text(SFT_DATA.read_text())
    out = tmp_path / "out"
    # the dataset path is relative to the working directory, as TRL reads it
    result = plait_command("sft", "--model_name_or_path", str(tiny_model_path()), "--dataset_name", "data/sft.jsonl",
                           "--use_peft", "--lora_r", "8", "--max_steps", "2", "--output_dir", str(out),
                           "--max_length", "64", "--report_to", "none", "--learning_rate", "1e-2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = json.loads((out / "adapter_config.json").read_text())
    # --lora_r 8 given; alpha, dropout, task type are TRL's ModelConfig defaults
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"], adapter["task_type"]) == (8, 32, 0.05, "CAUSAL_LM")
    weights = load_file(out / "adapter_model.safetensors")
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b and all(w.shape[1] == 8 for w in lora_b)
    assert any(w.abs().sum() > 0 for w in lora_b)  # B starts at 0: two steps moved it


def test_trl_flags_are_typed_and_checked_before_any_model_loads(capsys, tmp_path):
    data = rows(tmp_path / "d.jsonl", 4, "p")
    base = ["sft", "--model_name_or_path", str(tiny_model_path()), "--dataset_name", str(data), "--check"]
    assert main([*base, "--lora_r", "eight"]) == 2
    assert "--lora_r: expected int, got 'eight'" in capsys.readouterr().err
    assert main([*base, "--lora_rr", "8"]) == 2
    assert "did you mean --lora_r" in capsys.readouterr().err
    assert main([*base, "--dataset_streaming"]) == 2  # a stream trains for max_steps (tests/test_streaming.py)
    assert "dataset.streaming: a stream has no length to count epochs by; set max_steps" in capsys.readouterr().err
    assert main([*base, "--load_in_4bit"]) == 2 and "load_in_4bit: quantized loading needs the bitsandbytes" \
        in capsys.readouterr().err
    # a misspelt key of a TRL recipe is named, not ignored as TRL's scripts ignore it
    recipe = write(tmp_path / "trl.yaml", f"model_name_or_path: {tiny_model_path()}\ndataset_name: {data}\n"
                                          "learning_rat: 1.0e-4\n")
    assert main(["sft", "--config", str(recipe), "--check"]) == 2
    assert "did you mean 'learning_rate'?" in capsys.readouterr().err


def test_trl_grpo_flags_reach_the_grpo_config(capsys):
    argv = ["grpo", "--model_name_or_path", str(tiny_model_path()), "--dataset_name", str(PREFERENCES),
            "--reward_funcs", "accuracy_reward", "--use_vllm", "--vllm_mode", "colocate", "--num_generations", "4",
            "--per_device_train_batch_size", "4"]
    config = load_recipe(None, {"model_name_or_path": str(tiny_model_path()), "dataset_name": str(PREFERENCES),
                                "reward_funcs": "accuracy_reward", "reward_model_name_or_path": "my/rm",
                                "use_vllm": True, "vllm_mode": "colocate"}, method="grpo")
    assert config.reward_funcs == ["my/rm", "accuracy_reward"]  # the reward model first, as TRL orders them
    assert (config.training["use_vllm"], config.training["vllm_mode"]) == (True, "colocate")
    assert main([*argv, "--check"]) == 0
    assert capsys.readouterr().out == "plait: the command line is a valid grpo recipe\n"


# -- TRL's flat recipes --------------------------------------------------------------------------


def test_a_flat_trl_recipe_and_a_sectioned_one_give_the_same_config(tmp_path):
    tiny, data = tiny_model_path(), rows(tmp_path / "d.jsonl", 4, "p")
    flat = write(tmp_path / "trl.yaml", f"""
model_name_or_path: {tiny}
model_revision: main
dtype: float32
attn_implementation: eager
dataset_name: {data}
dataset_test_split: train
use_peft: true
lora_r: 8
lora_target_modules: [q_proj, v_proj]
learning_rate: 1.0e-4
max_steps: 3
eval_strategy: steps
""")
    sectioned = write(tmp_path / "plait.yaml", f"""
method: sft
model: {tiny}
model_init_kwargs: {{revision: main, dtype: float32, attn_implementation: eager}}
dataset: {{path: json, data_files: {data}, split: train}}
eval_dataset: {{path: json, data_files: {data}, split: train}}
peft: {{task_type: CAUSAL_LM, r: 8, target_modules: [q_proj, v_proj], lora_alpha: 32, lora_dropout: 0.05,
        use_rslora: false, use_dora: false, modules_to_save: null, bias: none}}
training: {{learning_rate: 1.0e-4, max_steps: 3, eval_strategy: steps}}
""")
    assert load_recipe(flat, method="sft") == load_recipe(sectioned, method="sft")
    # the command line's TRL flags win over the file's
    config = load_recipe(flat, {"lora_r": 4, "use_rslora": True, "max_steps": 5}, method="sft")
    assert (config.peft["r"], config.peft["use_rslora"], config.training["max_steps"]) == (4, True, 5)


def test_a_trl_dataset_mixture_and_plaits_list_of_datasets_are_the_same(tmp_path):
    a, b = rows(tmp_path / "a.jsonl", 10, "a"), rows(tmp_path / "b.jsonl", 4, "b")
    flat = write(tmp_path / "trl.yaml", f"""
model_name_or_path: m
datasets:
  - {{path: {a}, columns: [prompt, completion], fraction: 0.5}}
  - {{path: {b}, columns: [prompt, completion], fraction: 0.5}}
""")
    sectioned = write(tmp_path / "plait.yaml", f"""
model: m
dataset:
  - {{path: json, data_files: {a}, columns: [prompt, completion], fraction: 0.5}}
  - {{path: json, data_files: {b}, columns: [prompt, completion], fraction: 0.5}}
""")
    config = load_recipe(flat, method="sft")
    assert config == load_recipe(sectioned, method="sft")
    # equal shares of 10 and 4 rows without repeating any: N = min(10/0.5, 4/0.5) = 8, 4 rows from each
    train = load_mixture(config.dataset)["train"]
    assert train.column_names == ["prompt", "completion"]
    assert train["prompt"] == ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    # without fractions every row is kept; test_split_size holds a share out
    splits = load_mixture([json_file(a), json_file(b)], test_split_size=0.25)
    assert (len(splits["train"]), len(splits["test"])) == (10, 4)  # 14 rows, ceil(0.25 * 14) = 4 held out


def json_file(path: Path) -> DatasetConfig:
    return DatasetConfig(path="json", data_files=str(path))


def test_mixing_the_two_recipe_shapes_is_refused_in_one_line(tmp_path):
    recipe = write(tmp_path / "mixed.yaml", f"method: sft\nmodel: {tiny_model_path()}\ndataset: d.jsonl\n"
                                            "learning_rate: 1.0e-4\n")
    result = plait_command("sft", "--config", str(recipe), "--check")
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("plait: error: mixed.yaml mixes plait's sections (method, model, dataset) with TRL's "
                           "top-level keys (learning_rate)")


def test_accelerate_config_and_env_are_read_from_the_recipe(capsys, tmp_path, monkeypatch):
    data = rows(tmp_path / "d.jsonl", 4, "p")
    recipe = write(tmp_path / "trl.yaml", f"model_name_or_path: {tiny_model_path()}\ndataset_name: {data}\n"
                                          f"output_dir: {tmp_path / 'out'}\naccelerate_config: zero4\n"
                                          "env: {PLAIT_TEST_FROM_RECIPE: 7}\n")
    monkeypatch.delenv("PLAIT_TEST_FROM_RECIPE", raising=False)
    assert main(["sft", "--config", str(recipe)]) == 2  # the recipe's preset is looked up, and does not exist
    assert "--accelerate_config 'zero4': no such preset or file; did you mean 'zero3'?" in capsys.readouterr().err
    assert os.environ["PLAIT_TEST_FROM_RECIPE"] == "7"


# -- TRL's command names ---------------------------------------------------------------------------


def test_plait_reward_trains_a_reward_model(tmp_path):
    out = tmp_path / "rm"
    result = plait_command("reward", "--model_name_or_path", str(tiny_model_path()), "--dataset_name", str(PREFERENCES),
                           "--max_steps", "1", "--per_device_train_batch_size", "4", "--max_length", "256",
                           "--output_dir", str(out), "--report_to", "none")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"plait: saved the reward_model model to {out}" in result.stdout
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForSequenceClassification"] and len(saved["id2label"]) == 1  # one score


def test_plait_distillation_is_distill_and_env_reports_what_a_bug_report_needs():
    result = plait_command("distillation", "--model_name_or_path", str(tiny_model_path()), "--dataset_name",
                           str(PREFERENCES), "--teacher_model_name_or_path", str(tiny_model_path()), "--check")
    assert (result.returncode, result.stdout) == (0, "plait: the command line is a valid distill recipe\n"), result.stderr
    env = plait_command("env")
    assert env.returncode == 0, env.stderr
    info = dict(line.strip().split(": ", 1) for line in env.stdout.splitlines())
    for dist in ("plait", "torch", "transformers", "accelerate", "peft", "datasets"):
        assert info[dist] == plait_version(dist)
    assert info["cpu_bf16"].split()[0] in ("yes", "no") and "vllm" in info and "platform" in info
    assert f"plait {plait.__version__} (" in info["plugins"]


def test_vllm_serve_takes_trls_flag_spellings():
    from plait.cli import build_parser

    parser = build_parser(plait.make_plugins(), selected="vllm-serve")
    args = parser.parse_args(["vllm-serve", "--model", "m", "--tensor_parallel_size", "2", "--data_parallel_size", "3",
                              "--gpu_memory_utilization", "0.5", "--max_model_len", "128", "--enforce_eager"])
    assert (args.tensor_parallel_size, args.data_parallel_size, args.gpu_memory_utilization, args.max_model_len,
            args.enforce_eager) == (2, 3, 0.5, 128, True)


def plait_version(dist: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(dist)


# -- TRL's script helpers --------------------------------------------------------------------------


def test_trl_parser_reads_yaml_then_the_command_line(tmp_path, monkeypatch):
    from plait import TrlParser

    monkeypatch.delenv("PLAIT_TEST_PARSER", raising=False)
    recipe = write(tmp_path / "c.yaml", "model_name_or_path: a\nlora_r: 4\ndataset_name: d\nenv: {PLAIT_TEST_PARSER: x}\n")
    script, model = TrlParser((ScriptArguments, ModelConfig)).parse_args_and_config(
        ["--config", str(recipe), "--lora_r", "12", "--use_peft"])
    assert (model.model_name_or_path, model.lora_r, model.use_peft, script.dataset_name) == ("a", 12, True, "d")
    assert os.environ["PLAIT_TEST_PARSER"] == "x"
    write(recipe, "model_name_or_path: a\nnot_a_field: 1\n")
    with pytest.raises(PlaitError, match=r"keys no dataclass has: \['--not_a_field'\]"):
        TrlParser((ModelConfig,)).parse_args_and_config(["--config", str(recipe)])
    *_, unknown = TrlParser((ModelConfig,)).parse_args_and_config(["--config", str(recipe), "--other", "2"],
                                                                  return_remaining_strings=True)
    assert unknown == ["--not_a_field", "1", "--other", "2"]


def test_peft_and_quantization_configs_from_model_config():
    from plait import get_kbit_device_map, get_peft_config, get_quantization_config

    assert get_peft_config(ModelConfig()) is None and get_quantization_config(ModelConfig()) is None
    lora = get_peft_config(ModelConfig(use_peft=True, lora_r=4, lora_target_modules=["all-linear"]))
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.target_modules, lora.bias) == (4, 32, 0.05, "all-linear", "none")
    four = get_quantization_config(ModelConfig(load_in_4bit=True, dtype="bfloat16", use_bnb_nested_quant=True))
    assert four.load_in_4bit and four.bnb_4bit_quant_type == "nf4" and four.bnb_4bit_use_double_quant
    assert four.bnb_4bit_compute_dtype == torch.bfloat16
    with pytest.raises(PlaitError, match="load_in_8bit and load_in_4bit are both true"):
        ModelConfig(load_in_4bit=True, load_in_8bit=True)
    assert get_kbit_device_map() == (None if not torch.cuda.is_available() else {"": 0})


# -- accelerate presets ----------------------------------------------------------------------------


def test_trl_preset_names_and_the_commands_they_launch():
    from accelerate.commands.config.config_args import ClusterConfig

    fsdp2 = ClusterConfig.from_yaml_file(str(preset_path("fsdp2")))
    assert (fsdp2.distributed_type.value, fsdp2.fsdp_config["fsdp_version"]) == ("FSDP", 2)
    assert ClusterConfig.from_yaml_file(str(preset_path("fsdp1"))).fsdp_config["fsdp_version"] == 1
    assert preset_path("fsdp") == PRESETS / "fsdp2.yaml"  # plait's earlier name
    command, _ = launch_command(["sft", "--config", "r.yaml"], 2, "fsdp2", environ={}, gpus=2)  # without: test_fsdp_cpu
    assert command[3:7] == ["--config_file", str(PRESETS / "fsdp2.yaml"), "--num_processes", "2"]
    command, _ = launch_command(["sft"], None, "single_gpu", environ={})
    assert command[3:7] == ["--config_file", str(PRESETS / "single_gpu.yaml"), "--num_processes", "1"]
    with pytest.raises(PlaitError, match="--num_processes 2: --accelerate_config single_gpu runs one process"):
        launch_command(["sft"], 2, "single_gpu", environ={})
