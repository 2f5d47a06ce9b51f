"""TRL 1.16's own scripts run on plait with only the import changed.

Each script below is TRL's text, as its documentation gives it (the quickstart of every stable
trainer, a GRPO script with several of TRL's reward functions, an SFT script with a
formatting_func and a LogCompletionsCallback). :func:`as_plait` makes the only changes a plait
user makes, `from trl` -> `from plait`, plus the two this offline suite needs: the Hub model
becomes the tiny test model and each Hub dataset a small local file of the same shape (columns
as the Hub dataset has them). Each script then runs as a real ``python script.py`` process, with
a short epilogue that saves the model and writes the log history for the test to read.

TRL's command lines and flat recipes are in tests/test_trl_cli.py; the recipe here adds a full
training run of a flat recipe with a ``datasets:`` mixture through ``plait sft --config``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
PLAIT = Path(sys.executable).parent / "plait"  # the console script installed beside this python
DEMO_SFT = [json.loads(line) for line in (ROOT / "examples" / "data" / "demo_sft.jsonl").read_text().splitlines()]
DEMO_PREFERENCES = [json.loads(line)
                    for line in (ROOT / "examples" / "data" / "demo_preferences.jsonl").read_text().splitlines()]

# What the test reads back: TRL's scripts end at trainer.train(); a user would save the model next.
EPILOGUE = """
# -- the test's epilogue (not TRL's text) --
import json
json.dump({"output_dir": trainer.args.output_dir, "log_history": trainer.state.log_history},
          open("run.json", "w"))
trainer.save_model()
"""

# ---------------------------------------------------------------------------------------------
# TRL 1.16's documentation, as it writes them
# ---------------------------------------------------------------------------------------------

SFT_QUICKSTART = """
from trl import SFTTrainer
from datasets import load_dataset

trainer = SFTTrainer(
    model="Qwen/Qwen3-0.6B",
    train_dataset=load_dataset("trl-lib/Capybara", split="train"),
)
trainer.train()
"""

DPO_QUICKSTART = """
from trl import DPOTrainer
from datasets import load_dataset

trainer = DPOTrainer(
    model="Qwen/Qwen3-0.6B",
    train_dataset=load_dataset("trl-lib/ultrafeedback_binarized", split="train"),
)
trainer.train()
"""

REWARD_QUICKSTART = """
from trl import RewardTrainer
from datasets import load_dataset

trainer = RewardTrainer(
    model="Qwen/Qwen3-0.6B",
    train_dataset=load_dataset("trl-lib/ultrafeedback_binarized", split="train"),
)
trainer.train()
"""

KTO_QUICKSTART = """
# train_kto.py
from datasets import load_dataset
from trl import KTOConfig, KTOTrainer
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2-0.5B-Instruct")
tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen2-0.5B-Instruct")
train_dataset = load_dataset("trl-lib/kto-mix-14k", split="train")

training_args = KTOConfig(output_dir="Qwen2-0.5B-KTO")
trainer = KTOTrainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=train_dataset)
trainer.train()
"""

GRPO_QUICKSTART = """
# train_grpo.py
from datasets import load_dataset
from trl import GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
"""

RLOO_QUICKSTART = """
# train_rloo.py
from datasets import load_dataset
from trl import RLOOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = RLOOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
"""

# Several of trl.rewards' functions and factories, weighted, with a custom reward function as
# TRL's GRPO guide writes one, and generation by transformers (use_vllm=False).
GRPO_WITH_TRL_REWARDS = """
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")


def reward_num_unique_letters(completions, **kwargs):
    \"\"\"Reward function that rewards completions with more unique letters.\"\"\"
    completion_contents = [completion[0]["content"] for completion in completions]
    return [float(len(set(content))) for content in completion_contents]


training_args = GRPOConfig(
    output_dir="Qwen2-0.5B-GRPO",
    use_vllm=False,
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=16,
    reward_weights=[1.0, 0.5, 1.0, 0.1],
    max_steps=2,
    logging_steps=1,
    report_to="none",
)
trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=[
        accuracy_reward,
        think_format_reward,
        get_soft_overlong_punishment(max_completion_len=16, soft_punish_cache=4),
        reward_num_unique_letters,
    ],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
"""

SFT_WITH_FORMATTING_FUNC_AND_COMPLETIONS = """
from datasets import load_dataset
from trl import LogCompletionsCallback, SFTConfig, SFTTrainer

dataset = load_dataset("openai/gsm8k", "main")


def formatting_func(example):
    return f"Question: {example['question']}\\nAnswer: {example['answer']}"


training_args = SFTConfig(
    output_dir="Qwen3-0.6B-gsm8k",
    per_device_train_batch_size=4,
    max_steps=4,
    eval_strategy="steps",
    eval_steps=2,
    logging_steps=2,
    report_to="none",
)
trainer = SFTTrainer(
    model="Qwen/Qwen3-0.6B",
    args=training_args,
    train_dataset=dataset["train"],
    eval_dataset=dataset["test"],
    formatting_func=formatting_func,
)
completions_callback = LogCompletionsCallback(trainer, num_prompts=2)
trainer.add_callback(completions_callback)
trainer.train()
"""

HUB_MODELS = ("Qwen/Qwen3-0.6B", "Qwen/Qwen2-0.5B-Instruct")


# ---------------------------------------------------------------------------------------------
# Local stand-ins for the Hub datasets, with their columns
# ---------------------------------------------------------------------------------------------


def capybara(n: int) -> list[dict]:  # trl-lib/Capybara: conversations under "messages"
    return [{"source": "demo", "messages": row["prompt"] + row["completion"]} for row in DEMO_SFT[:n]]


def ultrafeedback(n: int) -> list[dict]:  # trl-lib/ultrafeedback_binarized: implicit prompt, scores
    return [{"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"],
             "score_chosen": 8.0, "score_rejected": 3.0} for row in DEMO_PREFERENCES[:n]]


def kto_mix(n: int) -> list[dict]:  # trl-lib/kto-mix-14k: unpaired, half desirable
    return [{"prompt": row["prompt"], "completion": row["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
            for i, row in enumerate(DEMO_PREFERENCES[:n])]


def deepmath(n: int) -> list[dict]:  # trl-lib/DeepMath-103K: a conversational prompt and its solution
    return [{"prompt": [{"role": "user", "content": f"What is {a} plus {a + 1}?"}], "solution": str(2 * a + 1)}
            for a in range(n)]


def gsm8k(n: int, start: int = 0) -> list[dict]:  # openai/gsm8k, config "main"
    return [{"question": f"Tom has {a} apples and buys {a + 2} more. How many does he have?",
             "answer": f"He has {a} + {a + 2} = {2 * a + 2} apples.\n#### {2 * a + 2}"} for a in range(start, start + n)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path.name


def as_plait(script: str, tiny_model: Path, datasets: dict[str, str]) -> str:
    """TRL's script as a plait user runs it: the import changed; offline, the tiny model for the
    Hub model and a local file for each Hub dataset (``datasets``: TRL's ``load_dataset(...`` call
    opening -> the local one)."""
    script = script.replace("from trl import", "from plait import").replace("from trl.", "from plait.")
    for name in HUB_MODELS:
        script = script.replace(f'"{name}"', f'"{tiny_model}"')
    for trl_call, local_call in datasets.items():
        assert trl_call in script, trl_call
        script = script.replace(trl_call, local_call)
    assert "trl" not in script.replace("trl-lib", "").lower(), script  # nothing of TRL is left to import
    return script + EPILOGUE


def run_script(tmp_path: Path, name: str, script: str) -> tuple[dict, Path, str]:
    """Run ``script`` as ``python name`` in ``tmp_path``; return what the epilogue wrote, the saved
    model's folder and the process's stdout."""
    (tmp_path / name).write_text(script)
    result = subprocess.run([PYTHON, name], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    run = json.loads((tmp_path / "run.json").read_text())
    return run, tmp_path / run["output_dir"], result.stdout


def train_loss(run: dict) -> float:
    [summary] = [entry for entry in run["log_history"] if "train_loss" in entry]
    assert math.isfinite(summary["train_loss"])
    return summary["train_loss"]


def assert_trained(saved: Path, tiny_model: Path, method: str, updated: bool = True) -> None:
    """The saved weights differ from the tiny model's (an update happened; or, with ``updated=False``,
    they are the tiny model's exactly), and the card names the method."""
    before, after = load_file(tiny_model / "model.safetensors"), load_file(saved / "model.safetensors")
    shared = [name for name in after if name in before and before[name].shape == after[name].shape]
    assert shared and any(not torch.equal(before[name], after[name]) for name in shared) == updated
    card = (saved / "README.md").read_text()
    assert yaml.safe_load(card.split("---\n")[1])["tags"] == ["generated_from_trainer", "plait", method]


def logged(run: dict, key: str) -> list[float]:
    return [entry[key] for entry in run["log_history"] if key in entry]


# ---------------------------------------------------------------------------------------------
# The quickstarts
# ---------------------------------------------------------------------------------------------


def test_sft_quickstart(tiny_model_path, tmp_path):
    files = {'load_dataset("trl-lib/Capybara"':
             f'load_dataset("json", data_files="{write_jsonl(tmp_path / "capybara.jsonl", capybara(8))}"'}
    run, saved, _ = run_script(tmp_path, "sft.py", as_plait(SFT_QUICKSTART, tiny_model_path, files))
    # TRL's defaults: 8 rows, batch size 8, 3 epochs -> 3 steps
    assert run["log_history"][-1]["step"] == 3 and train_loss(run) > 0
    assert_trained(saved, tiny_model_path, "sft")


@pytest.mark.slow
def test_dpo_quickstart(tiny_model_path, tmp_path):
    files = {'load_dataset("trl-lib/ultrafeedback_binarized"':
             f'load_dataset("json", data_files="{write_jsonl(tmp_path / "uf.jsonl", ultrafeedback(8))}"'}
    run, saved, _ = run_script(tmp_path, "dpo.py", as_plait(DPO_QUICKSTART, tiny_model_path, files))
    assert run["log_history"][-1]["step"] == 3
    assert 0 < train_loss(run) < math.log(2) + 0.05  # the sigmoid loss starts at log 2 (policy = reference)
    assert_trained(saved, tiny_model_path, "dpo")


@pytest.mark.slow
def test_reward_quickstart(tiny_model_path, tmp_path):
    files = {'load_dataset("trl-lib/ultrafeedback_binarized"':
             f'load_dataset("json", data_files="{write_jsonl(tmp_path / "uf.jsonl", ultrafeedback(8))}"'}
    run, saved, _ = run_script(tmp_path, "reward.py", as_plait(REWARD_QUICKSTART, tiny_model_path, files))
    assert run["log_history"][-1]["step"] == 3 and train_loss(run) > 0
    config = json.loads((saved / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1  # num_labels
    assert_trained(saved, tiny_model_path, "reward_model")


@pytest.mark.slow
def test_kto_quickstart(tiny_model_path, tmp_path):
    files = {'load_dataset("trl-lib/kto-mix-14k"':
             f'load_dataset("json", data_files="{write_jsonl(tmp_path / "kto.jsonl", kto_mix(8))}"'}
    run, saved, _ = run_script(tmp_path, "kto.py", as_plait(KTO_QUICKSTART, tiny_model_path, files))
    assert saved.name == "Qwen2-0.5B-KTO"  # the script's own output_dir
    assert run["log_history"][-1]["step"] == 3 and train_loss(run) > 0
    assert_trained(saved, tiny_model_path, "kto")


@pytest.mark.slow
@pytest.mark.parametrize("method, script, prompts", [("grpo", GRPO_QUICKSTART, 1), ("rloo", RLOO_QUICKSTART, 4)])
def test_online_quickstarts(tiny_model_path, tmp_path, method, script, prompts):
    # TRL's defaults: batch 8 of num_generations completions (GRPO 8, RLOO 2), 256 tokens, 3 epochs
    files = {'load_dataset("trl-lib/DeepMath-103K"':
             f'load_dataset("json", data_files="{write_jsonl(tmp_path / "math.jsonl", deepmath(prompts))}"'}
    run, saved, _ = run_script(tmp_path, f"{method}.py", as_plait(script, tiny_model_path, files))
    assert run["log_history"][-1]["step"] == 3
    train_loss(run)
    assert logged(run, "rewards/accuracy_reward/mean") == [0.0]  # the tiny model does no arithmetic
    # every reward ties, so every advantage is 0 and (beta 0, no weight decay) so is every gradient: as in TRL
    assert_trained(saved, tiny_model_path, method, updated=False)


# ---------------------------------------------------------------------------------------------
# Longer scripts
# ---------------------------------------------------------------------------------------------


def test_grpo_script_with_trls_reward_functions(tiny_model_path, tmp_path):
    files = {'load_dataset("trl-lib/DeepMath-103K"':
             f'load_dataset("json", data_files="{write_jsonl(tmp_path / "math.jsonl", deepmath(2))}"'}
    run, saved, _ = run_script(tmp_path, "grpo.py", as_plait(GRPO_WITH_TRL_REWARDS, tiny_model_path, files))
    steps = [entry for entry in run["log_history"] if "reward" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    names = ("accuracy_reward", "think_format_reward", "soft_overlong_punishment_reward", "reward_num_unique_letters")
    for entry in steps:
        means = [entry[f"rewards/{name}/mean"] for name in names]
        assert means[:2] == [0.0, 0.0]  # no arithmetic, no <think>...</think> from the tiny model
        assert means[3] > 0  # every completion has some letters
        if entry["completions/min_length"] > 12:  # every completion inside the punished last 4 of 16 tokens:
            assert means[2] == pytest.approx((12 - entry["completions/mean_length"]) / 4)  # (16 - 4 - L) / 4
        # the logged reward is the weighted sum of the functions' rewards (its mean, the sum of their means)
        assert entry["reward"] == pytest.approx(sum(w * m for w, m in zip([1.0, 0.5, 1.0, 0.1], means)), rel=1e-5)
    assert_trained(saved, tiny_model_path, "grpo")


@pytest.mark.slow
def test_sft_script_with_formatting_func_and_log_completions(tiny_model_path, tmp_path):
    data = {"train": write_jsonl(tmp_path / "train.jsonl", gsm8k(8)),
            "test": write_jsonl(tmp_path / "test.jsonl", gsm8k(2, start=50))}
    files = {'load_dataset("openai/gsm8k", "main"': f'load_dataset("json", data_files={data!r}'}
    script = as_plait(SFT_WITH_FORMATTING_FUNC_AND_COMPLETIONS, tiny_model_path, files)
    run, saved, stdout = run_script(tmp_path, "sft_gsm8k.py", script)
    assert len(logged(run, "eval_loss")) == 2 and train_loss(run) > 0  # evaluated at steps 2 and 4
    assert "Question: Tom has 50 apples" in stdout  # the callback's table: an eval prompt, as formatting_func made it
    assert_trained(saved, tiny_model_path, "sft")


# ---------------------------------------------------------------------------------------------
# A TRL-style flat recipe, trained through the command line
# ---------------------------------------------------------------------------------------------


def test_flat_trl_recipe_with_a_dataset_mixture_trains_through_plait_sft(tiny_model_path, tmp_path):
    first = tmp_path / "capybara.jsonl"
    second = tmp_path / "more.jsonl"
    write_jsonl(first, capybara(4))
    write_jsonl(second, capybara(8)[4:])
    # TRL's CLI config shape: every key at the top level, the data as a datasets: mixture
    recipe = tmp_path / "sft_recipe.yaml"
    recipe.write_text(f"""
model_name_or_path: {tiny_model_path}
datasets:
  - path: {first}
    columns: [messages]
  - path: {second}
    columns: [messages]
output_dir: out
learning_rate: 1.0e-3
lr_scheduler_type: cosine
per_device_train_batch_size: 4
max_steps: 2
logging_steps: 1
report_to: none
""")
    result = subprocess.run([str(PLAIT), "sft", "--config", str(recipe)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert f"plait: saved the sft model to out" in result.stdout
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert_trained(out, tiny_model_path, "sft")
    card = (out / "README.md").read_text()
    assert f"on `{first}`, `{second}`" in card  # the recipe's datasets, named on the card
    assert "- learning_rate: 0.001" in card and "- lr_scheduler_type: cosine" in card


# ---------------------------------------------------------------------------------------------
# TRL's experimental import paths (trl.experimental.<name>)
# ---------------------------------------------------------------------------------------------

# A script in the shape TRL's ORPO and CPO pages give (their trainers live under trl.experimental in 1.16)
EXPERIMENTAL_PREFERENCE = """
from datasets import load_dataset
from trl.experimental.{module} import {name}Config, {name}Trainer

dataset = load_dataset("trl-lib/ultrafeedback_binarized", split="train")
args = {name}Config(output_dir="{module}-run", max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3)
trainer = {name}Trainer(model="Qwen/Qwen2-0.5B-Instruct", args=args, train_dataset=dataset)
trainer.train()
"""


@pytest.mark.parametrize("module, name", [("orpo", "ORPO"), ("cpo", "CPO")])
def test_experimental_imports_port_with_the_rest(tiny_model_path, tmp_path, module, name):
    files = {'load_dataset("trl-lib/ultrafeedback_binarized"':
             f'load_dataset("json", data_files="{write_jsonl(tmp_path / "uf.jsonl", ultrafeedback(8))}"'}
    script = as_plait(EXPERIMENTAL_PREFERENCE.format(module=module, name=name), tiny_model_path, files)
    assert f"from plait.experimental.{module} import" in script
    run, saved, _ = run_script(tmp_path, f"{module}.py", script)
    assert run["log_history"][-1]["step"] == 2 and train_loss(run) > 0
    assert_trained(saved, tiny_model_path, module)


def test_every_experimental_path_of_trl_that_plait_implements_imports():
    import importlib

    import plait
    from plait.experimental import PATHS

    for module, names in PATHS.items():
        imported = importlib.import_module(f"plait.experimental.{module}")
        assert [getattr(imported, name) for name in names] == [getattr(plait, name) for name in names]
    with pytest.raises(ImportError, match="cannot import name 'ORPOTrainerX'"):
        exec("from plait.experimental.orpo import ORPOTrainerX")
