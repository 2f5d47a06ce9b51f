"""Exact resume for every method: those that learn from their own samples (GRPO, RLOO, PPO,
distillation, GKD, online DPO) and the offline ones (SFT, DPO, KTO, reward model, ORPO, CPO, PRM).

Each test trains N steps straight through, and again with the run cut after a checkpoint and
resumed from it in a fresh trainer: the final weights must be bit-identical (max |Δ| = 0.0) and
the running counters (num_tokens, episode) must carry on. The checkpoints are placed on purpose
in the middle of a rollout (and of a pass over it), across epoch boundaries, with
steps_per_generation > 1 and num_iterations > 1. GRPO goes through the real path a user takes:
the installed ``plait`` command, killed with SIGKILL mid-rollout, then ``--resume_from_checkpoint``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

import plait
from plait.plugins.methods.distill import DistillConfig, DistillTrainer
from plait.plugins.methods.ppo import PPOConfig, PPOTrainer
from plait.testing.tiny_model import noisy_tiny_model, tiny_model_path

PLAIT = Path(sys.executable).parent / "plait"  # the console script installed beside this python
WORDS = ("The river", "A good answer", "What is 7 plus 5?", "Python is", "The weather today", "Numbers such as",
         "The children", "Nobody could")
COMMON = dict(learning_rate=1e-2, max_steps=6, save_strategy="steps", save_steps=3, logging_steps=1,
              report_to="none", disable_tqdm=True, seed=0)


def low_tokens(completion_ids, **kwargs):
    """A reward that varies between completions: the number of tokens with id < 100."""
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]


def prompts(n: int) -> Dataset:
    return Dataset.from_list([{"prompt": w} for w in WORDS[:n]])


class StopAt(TrainerCallback):
    """Ends the run right after step ``step`` (its checkpoint written), as a crash there would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    found = {f"policy.{k}": v for k, v in load_file(checkpoint / "model.safetensors").items()}
    value = checkpoint / "value_model" / "model.safetensors"  # PPO's value model is trained too
    if value.exists():
        found.update({f"value.{k}": v for k, v in load_file(value).items()})
    return found


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def history(checkpoint: Path, key: str) -> list:
    log = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return [(h["step"], h[key]) for h in log if key in h]


def straight_and_resumed(tmp_path: Path, build, stop: int, steps: int = 6) -> tuple[Path, Path]:
    """Train ``build(output_dir)`` straight; again stopped after ``stop`` and resumed by a new trainer."""
    build(tmp_path / "straight").train()
    cut = build(tmp_path / "cut")
    cut.add_callback(StopAt(stop))
    cut.train()
    assert sorted(p.name for p in (tmp_path / "cut").glob("checkpoint-*")) == [f"checkpoint-{stop}"]
    build(tmp_path / "cut").train(resume_from_checkpoint=str(tmp_path / "cut" / f"checkpoint-{stop}"))
    return tmp_path / "straight" / f"checkpoint-{steps}", tmp_path / "cut" / f"checkpoint-{steps}"


def assert_same_run(straight: Path, resumed: Path, method: str, counters: tuple[str, ...]) -> None:
    difference = max_difference(weights(straight), weights(resumed))
    print(f"{method}: max |weight difference| straight vs resumed = {difference}")
    assert difference == 0.0
    assert history(resumed, "loss") == history(straight, "loss")  # every step, before and after the cut
    for counter in counters:
        logged = history(resumed, counter)
        assert logged == history(straight, counter) and len(logged) >= 2 and logged[-1][1] > logged[0][1]


# ---------------------------------------------------------------------------------------------
# GRPO through the console script: SIGKILL mid-rollout, then --resume_from_checkpoint
# ---------------------------------------------------------------------------------------------

HANGING_REWARD = '''
import os, time

def low_tokens(completion_ids, trainer_state=None, **kwargs):
    """low_tokens; with PLAIT_TEST_HANG_AT set, it hangs from that step on (the test kills the run there)."""
    hang = os.environ.get("PLAIT_TEST_HANG_AT")
    if hang and trainer_state.global_step >= int(hang):
        open(os.environ["PLAIT_TEST_HANG_MARKER"], "w").close()
        time.sleep(600)
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]
'''


def test_grpo_killed_with_sigkill_resumes_bit_identically(tmp_path):
    # 4 prompts × 2 generations = one generation batch of 8 = one epoch; steps_per_generation 2 ×
    # num_iterations 2 → each rollout serves 4 optimizer steps. The checkpoint at step 3 is in the
    # middle of the first rollout's second pass; the kill lands while the second rollout (epoch 2)
    # is being scored.
    (tmp_path / "resume_rewards.py").write_text(HANGING_REWARD)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS[:4]))
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump({
        "method": "grpo", "model": str(tiny_model_path()),
        "dataset": {"path": "json", "data_files": "prompts.jsonl"},
        "reward_funcs": ["resume_rewards:low_tokens"],
        "training": {**COMMON, "per_device_train_batch_size": 4, "num_generations": 2, "steps_per_generation": 2,
                     "num_iterations": 2, "beta": 0.04, "max_completion_length": 6},
    }))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}

    def plait_grpo(output: Path, *extra: str, **more_env: str):
        command = [str(PLAIT), "grpo", "--config", str(recipe), "--output_dir", str(output), *extra]
        return subprocess.Popen(command, env={**env, **more_env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def finish(process) -> str:
        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0, out[-3000:]
        return out

    finish(plait_grpo(tmp_path / "straight"))

    marker = tmp_path / "hanging"
    killed = plait_grpo(tmp_path / "killed", PLAIT_TEST_HANG_AT="4", PLAIT_TEST_HANG_MARKER=str(marker))
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert killed.poll() is None, killed.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run never reached step 5"
        time.sleep(0.2)
    os.kill(killed.pid, signal.SIGKILL)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (tmp_path / "killed").glob("checkpoint-*")) == ["checkpoint-3"]

    finish(plait_grpo(tmp_path / "killed", "--resume_from_checkpoint", str(tmp_path / "killed" / "checkpoint-3")))
    assert_same_run(tmp_path / "straight" / "checkpoint-6", tmp_path / "killed" / "checkpoint-6", "grpo",
                    ("num_tokens",))
    final = {k: load_file(tmp_path / run / "model.safetensors") for k, run in (("a", "straight"), ("b", "killed"))}
    assert max_difference(final["a"], final["b"]) == 0.0  # the saved model, too


# ---------------------------------------------------------------------------------------------
# RLOO, PPO and distillation: stopped after a checkpoint, resumed by a fresh trainer
# ---------------------------------------------------------------------------------------------


def test_rloo_resumes_bit_identically_from_a_checkpoint_mid_rollout(tmp_path):
    # gradient_accumulation 2 = steps_per_generation, num_iterations 2: a rollout of 4 prompts × 2
    # serves 2 optimizer steps (one epoch); the checkpoint at step 3 is between its two passes.
    def build(output):
        args = plait.RLOOConfig(output_dir=str(output), **COMMON, per_device_train_batch_size=4,
                                gradient_accumulation_steps=2, num_generations=2, num_iterations=2,
                                max_completion_length=6)
        return plait.RLOOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=args, train_dataset=prompts(4))

    straight, resumed = straight_and_resumed(tmp_path, build, stop=3)
    assert_same_run(straight, resumed, "rloo", ("num_tokens",))


def test_ppo_resumes_bit_identically_with_the_value_model_and_the_kl_coefficient(tmp_path):
    # 2 minibatches × 2 PPO epochs: a rollout of 8 prompts serves 4 optimizer steps (one epoch);
    # the checkpoint at step 3 is in the middle of the second pass. The adaptive KL controller's
    # coefficient moves every rollout, so it must come back from the checkpoint too.
    def build(output):
        args = PPOConfig(output_dir=str(output), **COMMON, per_device_train_batch_size=4, num_mini_batches=2,
                         num_ppo_epochs=2, response_length=5, temperature=1.0, target_kl=0.01, kl_horizon=10)
        return PPOTrainer(str(tiny_model_path()), reward_model=low_tokens, args=args, train_dataset=prompts(8))

    straight, resumed = straight_and_resumed(tmp_path, build, stop=3)
    assert_same_run(straight, resumed, "ppo", ("episode",))
    coefs = history(resumed, "objective/kl_coef")
    assert coefs == history(straight, "objective/kl_coef") and coefs[-1][1] != coefs[0][1]


PAIRS = [{"prompt": w, "chosen": " yes, kindly.", "rejected": " no way, never ever."} for w in WORDS]
UNPAIRED = [{"prompt": w, "completion": c, "label": ok} for w in WORDS
            for c, ok in ((" yes, kindly.", True), (" no way, never ever.", False))]
OFFLINE = {  # method -> (extra config fields, training rows, running counters that must carry on)
    "dpo": ({"beta": 0.1}, PAIRS, ()),
    "kto": ({"beta": 0.1}, UNPAIRED, ()),
    "reward_model": ({}, PAIRS, ()),
    "sft": ({}, [{"prompt": r["prompt"], "completion": r["completion"]} for r in UNPAIRED], ("num_tokens",)),
    "orpo": ({"beta": 0.1}, PAIRS, ()),
    "cpo": ({"beta": 0.1}, PAIRS, ()),
    "prm": ({}, [{"prompt": w, "completions": [" first step.", " second step."], "labels": [True, i % 2 == 0]}
                 for i, w in enumerate(WORDS)], ()),
}


@pytest.mark.parametrize("method", sorted(OFFLINE))
def test_offline_methods_resume_bit_identically(tmp_path, method):
    # shuffled data over two epochs with dropout-free tiny models: the cut at step 3 is mid-epoch
    extra, rows, counters = OFFLINE[method]
    record = plait.default_plugins().methods.get(method, family="method").obj

    def build(output):
        args = record.config(output_dir=str(output), **COMMON, per_device_train_batch_size=2, max_length=32, **extra)
        return record.trainer(str(tiny_model_path()), args=args, train_dataset=Dataset.from_list(rows))

    straight, resumed = straight_and_resumed(tmp_path, build, stop=3)
    assert_same_run(straight, resumed, method, counters)


def test_distill_resumes_bit_identically(tmp_path):
    # gradient_accumulation 2: each optimizer step samples 8 prompts (the whole data set: one epoch)
    teacher = noisy_tiny_model()

    def build(output):
        args = DistillConfig(output_dir=str(output), **COMMON, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_completion_length=6)
        return DistillTrainer(str(tiny_model_path()), teacher_model=teacher, args=args, train_dataset=prompts(8))

    straight, resumed = straight_and_resumed(tmp_path, build, stop=3)
    assert_same_run(straight, resumed, "distill", ())


def test_gkd_resumes_bit_identically(tmp_path):
    # lmbda 0.5: the student samples the completions of about half the batches (a coin per batch, from
    # the run's random state), the others are the dataset's; the cut at step 3 must replay the same coins
    teacher = noisy_tiny_model()
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": w}],
                               "completion": [{"role": "assistant", "content": " it is near."}]} for w in WORDS])

    def build(output):
        args = plait.GKDConfig(output_dir=str(output), **COMMON, per_device_train_batch_size=2, max_new_tokens=6,
                               lmbda=0.5)
        return plait.GKDTrainer(str(tiny_model_path()), teacher_model=teacher, args=args, train_dataset=rows)

    straight, resumed = straight_and_resumed(tmp_path, build, stop=3)
    assert_same_run(straight, resumed, "gkd", ())


def test_online_dpo_resumes_bit_identically(tmp_path):
    # pairs sampled at each step from the policy: the cut at step 3 must resume its sampler's random state
    def build(output):
        args = plait.OnlineDPOConfig(output_dir=str(output), **COMMON, per_device_train_batch_size=4,
                                     max_new_tokens=6)
        return plait.OnlineDPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=args,
                                      train_dataset=prompts(8))

    straight, resumed = straight_and_resumed(tmp_path, build, stop=3)
    assert_same_run(straight, resumed, "online_dpo", ())


@pytest.mark.slow
def test_async_grpo_resumes_bit_identically(tmp_path):
    # The rollout worker (its own process) samples generation batch i with seed + i from the weights of
    # the step that trains on it (max_staleness 0: which older weights a staler bound would give depends
    # on timing). steps_per_generation 2 × num_iterations 2: the checkpoint at step 3 is mid-rollout, and
    # the resumed trainer starts a fresh worker that must sample what the uninterrupted one did.
    def build(output):
        args = plait.AsyncGRPOConfig(output_dir=str(output), **COMMON, per_device_train_batch_size=4,
                                     num_generations=2, steps_per_generation=2, num_iterations=2,
                                     max_completion_length=6, max_staleness=0)
        return plait.AsyncGRPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=args,
                                      train_dataset=prompts(4))

    straight, resumed = straight_and_resumed(tmp_path, build, stop=3)
    assert_same_run(straight, resumed, "async_grpo", ("num_tokens",))


def test_a_resumed_run_without_saved_rollout_state_warns(tmp_path, caplog):
    """A checkpoint without the rollout state (an older plait's) resumes, but says it is not exact."""
    def build(output):
        args = plait.GRPOConfig(output_dir=str(output), **{**COMMON, "max_steps": 2, "save_steps": 1},
                                per_device_train_batch_size=4, num_generations=2, steps_per_generation=2,
                                max_completion_length=4)
        return plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=args, train_dataset=prompts(4))

    cut = build(tmp_path)
    cut.add_callback(StopAt(1))
    cut.train()
    checkpoint = tmp_path / "checkpoint-1"
    (checkpoint / "plait_resume_state_0.pt").unlink()
    with caplog.at_level("WARNING", logger="plait"):
        build(tmp_path).train(resume_from_checkpoint=str(checkpoint))
    assert "has no plait_resume_state_0.pt" in caplog.text and "will not match an uninterrupted run" in caplog.text


# ---------------------------------------------------------------------------------------------
# The precomputed reference log-prob cache follows the numbers' inputs, not the model's path
# ---------------------------------------------------------------------------------------------

PAIRS = [{"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.", "rejected": f" The {w} is bad."}
         for w in ("apple", "river", "stone", "cloud")]
CACHED = {  # method: (trainer, config, data, one cached column)
    "dpo": (plait.DPOTrainer, plait.DPOConfig, PAIRS, "ref_chosen_logps"),
    "kto": (plait.KTOTrainer, plait.KTOConfig,
            [{"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
             for i, r in enumerate(PAIRS)], "ref_logps"),
}


@pytest.mark.parametrize("method", sorted(CACHED))
def test_a_model_replaced_at_the_same_path_does_not_reuse_cached_reference_logps(tmp_path, monkeypatch, method):
    trainer_class, config_class, rows, column = CACHED[method]
    data = Dataset.from_list(rows)
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path(), folder)

    def reference_logps(cache: str = "cache", **overrides) -> torch.Tensor:
        monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / cache))
        settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_length=64,
                        precompute_ref_log_probs=True, report_to="none")
        args = config_class(**{**settings, **overrides})
        return torch.tensor(trainer_class(str(folder), args=args, train_dataset=data).train_dataset[column])

    def entries() -> list[str]:
        return sorted(p.name for p in (tmp_path / "cache" / "ref_logps").iterdir())

    before = reference_logps()
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    model.save_pretrained(folder)  # new weights, same path

    after = reference_logps()
    assert not torch.equal(after, before)
    assert torch.equal(after, reference_logps(cache="empty"))  # what the new weights give, computed afresh
    assert len(entries()) == 2
    kept = entries()
    assert torch.equal(reference_logps(), after) and entries() == kept  # same weights and settings: reused
    reference_logps(max_length=16)  # truncation changes the numbers: an entry of its own
    assert len(entries()) == 3


# ---------------------------------------------------------------------------------------------
# Two processes: each saves and restores its own share of the rollout
# ---------------------------------------------------------------------------------------------

DDP_SCRIPT = '''
import atexit, os, sys
from pathlib import Path

def threads_at_exit():  # registered before any trainer, so it runs after plait's exit handler
    names = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    Path(sys.argv[1], f"threads_at_exit_{os.environ['RANK']}").write_text(" ".join(names))

atexit.register(threads_at_exit)

import plait
from transformers import TrainerCallback
from plait.testing.tiny_model import tiny_model_path

output, mode = sys.argv[1], sys.argv[2]

def low_tokens(completion_ids, **kwargs):
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]

class StopAt3(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == 3

args = plait.GRPOConfig(output_dir=output, per_device_train_batch_size=2, num_generations=2, steps_per_generation=2,
                        num_iterations=2, max_completion_length=5, learning_rate=1e-2, max_steps=6,
                        save_strategy="steps", save_steps=3, logging_steps=1, report_to=[], disable_tqdm=True,
                        use_cpu=True, seed=0)
prompts = [{"prompt": p} for p in ["The river", "A good answer", "Python is", "The children"]]
t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=args, train_dataset=prompts,
                      callbacks=[StopAt3()] if mode == "cut" else None)
t.train(resume_from_checkpoint=output + "/checkpoint-3" if mode == "resume" else None)
'''


@pytest.mark.slow
def test_two_processes_resume_bit_identically(tmp_path):
    """Each process keeps its own rows of a generation batch; each saves and restores its own state."""
    script = tmp_path / "ddp_resume.py"
    script.write_text(DDP_SCRIPT)
    torchrun = Path(sys.executable).parent / "torchrun"

    def launch(output: Path, mode: str) -> None:
        done = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(output), mode],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]

    launch(tmp_path / "straight", "straight")
    for rank in (0, 1):  # the process group was left: gloo's threads outliving the interpreter abort it
        assert "gloo" not in (tmp_path / "straight" / f"threads_at_exit_{rank}").read_text()
    launch(tmp_path / "cut", "cut")
    checkpoint = tmp_path / "cut" / "checkpoint-3"
    assert (checkpoint / "plait_resume_state_0.pt").exists() and (checkpoint / "plait_resume_state_1.pt").exists()
    launch(tmp_path / "cut", "resume")
    assert_same_run(tmp_path / "straight" / "checkpoint-6", tmp_path / "cut" / "checkpoint-6", "grpo, 2 processes",
                    ("num_tokens",))
