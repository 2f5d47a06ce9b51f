"""A NaN/inf loss or gradient norm never reaches the weights: the run stops naming the step, the
loss part and the likely cause (or, with on_nonfinite_loss="skip", drops that update), nothing
non-finite is saved, and `plait <method>` exits non-zero. Real tiny-model runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

import plait
from plait import make_plugins
from plait.engine.batches import PolicyTokens, PreferenceLogps, ValueTokens
from plait.engine.trainer import NonFiniteLossError
from plait.errors import PlaitError
from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
from plait.plugins.methods.ppo import PPOConfig, PPOTrainer
from plait.plugins.methods.sft import SFTConfig, SFTTrainer
from plait.testing.tiny_model import tiny_model_path

PLAIT = Path(sys.executable).parent / "plait"
WORDS = ["apple", "river", "stone", "cloud", "music", "garden", "window", "paper"]


class NanAt:
    """A loss plugin whose losses turn NaN on one training call, as a buggy plugin's would.

    Each loss counts its calls with gradient: one per micro-batch in these runs, so call 2 is
    step 2 without gradient accumulation and call 3 is step 2's first micro-batch with 2."""

    def __init__(self, call: int):
        self.call, self.calls = call, {}

    def _at_step(self, name: str, loss: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.calls[name] == self.call:
                return loss * float("nan")
        return loss

    def dpo(self, batch: PreferenceLogps, p) -> torch.Tensor:
        return self._at_step("dpo", -torch.nn.functional.logsigmoid(0.1 * batch.margin))

    def grpo(self, batch: PolicyTokens, p) -> torch.Tensor:
        loss = -(batch.logps * batch.token_advantages * batch.mask).sum() / batch.mask.sum().clamp(min=1)
        return self._at_step("grpo", loss)

    def ppo_value(self, batch: ValueTokens, p) -> torch.Tensor:
        return self._at_step("ppo_value", 0.5 * (batch.values - batch.returns) ** 2)

    @plait.hookimpl
    def register_losses(self, register):
        register("dpo.nan_at_step", self.dpo, consumes=PreferenceLogps)
        register("grpo.nan_at_step", self.grpo, consumes=PolicyTokens, output="scalar")
        register("ppo.nan_value_at_step", self.ppo_value, consumes=ValueTokens, output="token")


def pairs() -> Dataset:
    return Dataset.from_list([{"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.",
                               "rejected": f" The {w} is bad."} for w in WORDS])


def texts() -> Dataset:
    return Dataset.from_list([{"prompt": f"Tell me about the {w}.", "completion": f" The {w} is good."} for w in WORDS])


def dpo_run(tmp_path, accumulation: int = 1, **overrides) -> DPOTrainer:
    """4 steps of 4 pairs (in 1 or 2 micro-batches); the part dpo.nan_at_step is NaN in step 2."""
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4 // accumulation,
                  gradient_accumulation_steps=accumulation, max_steps=4, learning_rate=1e-3,
                  loss_type=["sigmoid", "nan_at_step"], save_strategy="steps", save_steps=1, logging_steps=1,
                  report_to="none", seed=0, max_length=64, disable_tqdm=True)
    return DPOTrainer(str(tiny_model_path()), args=DPOConfig(**{**values, **overrides}), train_dataset=pairs(),
                      plugins=make_plugins(plugins=[NanAt(call=accumulation + 1)]))


def sft_run(tmp_path, **overrides) -> SFTTrainer:
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, max_length=64, disable_tqdm=True)
    return SFTTrainer(str(tiny_model_path()), args=SFTConfig(**{**values, **overrides}), train_dataset=texts())


def weights(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def all_finite(tensors) -> bool:
    return all(torch.isfinite(t).all() for t in tensors)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_nan_loss_part_stops_the_run_before_the_update(tmp_path, accumulation):
    trainer = dpo_run(tmp_path, accumulation)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.train()
    message = str(err.value)
    assert isinstance(err.value, PlaitError) and "\n" not in message
    assert message.startswith("step 2: the loss is NaN/inf in loss/dpo.nan_at_step (plugin ")
    assert "distribution (not installed)" in message and "loss/dpo.sigmoid" not in message  # sigmoid stayed finite
    assert "likely cause: the loss plugin(s) 'dpo.nan_at_step' producing NaN/inf on this batch" in message
    assert "on_nonfinite_loss: skip" in message
    # the step-1 checkpoint is the last thing saved, and the weights are still exactly its weights
    assert trainer.state.global_step == 1
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    saved = load_file(tmp_path / "checkpoint-1" / "model.safetensors")
    now = weights(trainer.model)
    assert all_finite(saved.values()) and all_finite(now.values())
    assert all(torch.equal(saved[name], now[name]) for name in saved if name in now)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_skip_drops_only_the_nonfinite_update_and_finishes(tmp_path, caplog, accumulation):
    trainer = dpo_run(tmp_path, accumulation, on_nonfinite_loss="skip", save_strategy="no")
    trainer.train()
    assert trainer.state.global_step == 4 and trainer.nonfinite_steps_skipped == 1
    assert [h["nonfinite_steps_skipped"] for h in trainer.state.log_history if "loss" in h] == [0, 1, 1, 1]
    assert "step 2: the loss is NaN/inf in loss/dpo.nan_at_step" in caplog.text and "skipped this update" in caplog.text
    # the optimizer moved the weights on 3 of the 4 steps: step 2 never reached it
    steps = {int(state["step"]) for state in trainer.optimizer.state.values()}
    assert steps == {3}
    assert all_finite(weights(trainer.model).values())
    trainer.save_model()
    assert all_finite(load_file(tmp_path / "model.safetensors").values())


def test_the_skipped_steps_count_continues_after_a_resume(tmp_path):
    # step 2 is skipped; the run is cut after step 3's checkpoint and resumed by a fresh trainer
    first = dpo_run(tmp_path, on_nonfinite_loss="skip", max_steps=3)
    first.train()
    assert first.nonfinite_steps_skipped == 1
    resumed = dpo_run(tmp_path, on_nonfinite_loss="skip")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.state.global_step == 4 and resumed.nonfinite_steps_skipped == 1
    assert [h["nonfinite_steps_skipped"] for h in resumed.state.log_history if "loss" in h][-1] == 1


def test_a_nonfinite_gradient_with_a_finite_loss_stops_the_run(tmp_path):
    # lr = 1e30: step 1's update leaves finite but enormous weights; step 2's loss is still finite
    # (a uniform distribution) while its gradient overflows to NaN
    trainer = sft_run(tmp_path, learning_rate=1e30)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.train()
    message = str(err.value)
    assert message.startswith("step 2: the gradient norm is nan although the loss (loss/sft.nll) is finite")
    assert "likely cause: learning_rate=1e+30 too high, so the model diverged (lower it)" in message
    assert trainer.state.global_step == 1 and all_finite(weights(trainer.model).values())


def test_weights_that_overflow_are_never_saved(tmp_path):
    # lr = 1e39: step 1's Adam update (≈ lr per weight) overflows float32, so the weights are inf
    # while every loss and gradient of step 1 was finite; the step-1 checkpoint is refused
    trainer = sft_run(tmp_path, learning_rate=1e39, save_strategy="steps", save_steps=1)
    with pytest.raises(NonFiniteLossError, match=r"^step 1: the weights hold NaN/inf, so they are not saved to "):
        trainer.train()
    assert not list(tmp_path.glob("checkpoint-*")) and not list(tmp_path.rglob("*.safetensors"))
    # "skip" cannot undo an update that already happened: the final save is refused too
    trainer = sft_run(tmp_path / "skip", learning_rate=1e39, on_nonfinite_loss="skip")
    trainer.train()
    assert trainer.nonfinite_steps_skipped == 2  # steps 2 and 3
    with pytest.raises(NonFiniteLossError, match="the weights hold NaN/inf"):
        trainer.save_model()
    assert not list((tmp_path / "skip").rglob("*.safetensors"))


def test_an_online_method_stops_on_a_nan_loss(tmp_path):
    def reward(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    args = plait.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=4, learning_rate=1e-3, max_steps=3, save_strategy="no",
                            report_to="none", seed=0, disable_tqdm=True, loss_type="nan_at_step")
    trainer = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=reward, args=args,
                                train_dataset=[{"prompt": f"The {w}"} for w in WORDS],
                                plugins=make_plugins(plugins=[NanAt(call=2)]))
    with pytest.raises(NonFiniteLossError, match=r"^step 2: the loss is NaN/inf in loss/grpo.nan_at_step \(plugin "):
        trainer.train()
    assert all_finite(weights(trainer.model).values())


def test_ppo_names_its_value_loss(tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1,
                     max_steps=3, response_length=4, learning_rate=1e-3, save_strategy="no", report_to="none",
                     seed=0, value_loss=["nan_value_at_step"], disable_tqdm=True)
    prompts = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say something about {w}."}]}
                                 for w in WORDS])
    trainer = PPOTrainer(str(tiny_model_path()), reward_model=lambda completions, **kw: [1.0] * len(completions),
                         args=args, train_dataset=prompts, plugins=make_plugins(plugins=[NanAt(call=2)]))
    with pytest.raises(NonFiniteLossError) as err:
        trainer.train()
    message = str(err.value)
    assert message.startswith("step 2: the loss is NaN/inf in loss/ppo.nan_value_at_step (plugin ")
    assert "loss/ppo.policy" not in message
    assert "likely cause: the loss plugin(s) 'ppo.nan_value_at_step' producing NaN/inf" in message


def test_an_unknown_policy_is_refused():
    with pytest.raises(PlaitError, match=r"on_nonfinite_loss='ignore' is not valid; use 'error' .* or 'skip'"):
        SFTConfig(output_dir="unused", on_nonfinite_loss="ignore")


PLUGIN = '''
import torch
import plait
from plait.engine.batches import PreferenceLogps

calls = 0


def nan_at_step_2(batch, p):
    """The DPO sigmoid loss, NaN on the second training step (a plugin bug)."""
    global calls
    loss = -torch.nn.functional.logsigmoid(0.1 * batch.margin)
    if torch.is_grad_enabled():
        calls += 1
        if calls == 2:
            return loss * float("nan")
    return loss


@plait.hookimpl
def register_losses(register):
    register("dpo.nan_at_step_2", nan_at_step_2, consumes=PreferenceLogps)
'''


def test_the_plait_command_exits_nonzero_and_saves_no_nan(tmp_path):
    """A third-party loss plugin, installed as pip would leave it, goes NaN at step 2 of a recipe."""
    site = tmp_path / "site"
    files = {
        site / "nan_losses.py": PLUGIN,
        site / "nan_losses-0.1.dist-info" / "METADATA": "Metadata-Version: 2.1\nName: nan-losses\nVersion: 0.1\n",
        site / "nan_losses-0.1.dist-info" / "entry_points.txt": "[plait]\nnan_losses = nan_losses\n",
        tmp_path / "prefs.jsonl": "".join(json.dumps(row) + "\n" for row in pairs()),
        tmp_path / "recipe.yaml": f"""\
            method: dpo
            model: {tiny_model_path()}
            dataset: {{path: json, data_files: prefs.jsonl}}
            loss: [sigmoid, nan_at_step_2]
            training: {{output_dir: out, max_steps: 4, per_device_train_batch_size: 4, learning_rate: 1.0e-3,
                        max_length: 64, save_strategy: steps, save_steps: 1, report_to: none}}
            """,
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([str(PLAIT), "dpo", "--config", "recipe.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("plait: error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "plait: error: step 2: the loss is NaN/inf in loss/dpo.nan_at_step_2 (plugin nan_losses, distribution "
        "nan-losses 0.1)"), done.stderr[-3000:]
    out = tmp_path / "out"
    assert not (out / "model.safetensors").exists()  # no final save
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert all_finite(load_file(out / "checkpoint-1" / "model.safetensors").values())
