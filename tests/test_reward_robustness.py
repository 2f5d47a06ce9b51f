"""Online runs whose rewards score nothing, or never return, stop with a clear error instead of hanging.

Real GRPO/RLOO runs on the tiny model with the prompts of the bundled demo data; the rewards
are ordinary Python functions that misbehave the way real ones do (a parser that never matches,
a judge that hangs, a blocking call inside an async function).
"""

import asyncio
import logging
import math
import os
import pathlib
import subprocess
import sys
import threading
import time

import datasets
import pytest
import torch

import plait
from plait.errors import PlaitError
from plait.online.scoring import RewardFunction, compute_rewards
from plait.testing.tiny_model import tiny_model_path

DATA = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data" / "demo_sft.jsonl"
PROMPTS = datasets.load_dataset("json", data_files=str(DATA), split="train").select(range(16)).remove_columns("completion")
PLAIT = pathlib.Path(sys.executable).parent / "plait"  # the console script installed beside this python
METHODS = {"grpo": (plait.GRPOConfig, plait.GRPOTrainer), "rloo": (plait.RLOOConfig, plait.RLOOTrainer)}


def low_tokens(completion_ids, **kwargs):
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]


def never_matches(completions, **kwargs):
    """A parser that finds no answer anywhere: None for every completion."""
    return [None] * len(completions)


def nan_judge(completions, **kwargs):
    return [math.nan] * len(completions)


def hangs(completions, **kwargs):
    time.sleep(60)
    return [1.0] * len(completions)


async def hangs_async(completions, **kwargs):
    await asyncio.sleep(60)
    return [1.0] * len(completions)


def trainer(method="grpo", reward_funcs=low_tokens, **overrides):
    config_class, trainer_class = METHODS[method]
    values = dict(output_dir="/tmp/plait-test-reward-robustness", per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=4, learning_rate=1e-3, max_steps=2, logging_steps=1, report_to=[],
                  save_strategy="no", disable_tqdm=True, seed=0)
    args = config_class(**{**values, **overrides})
    return trainer_class(str(tiny_model_path()), reward_funcs=reward_funcs, args=args, train_dataset=PROMPTS)


def plait_warnings(caplog, text):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# -- every completion unscored --------------------------------------------------------------------


@pytest.mark.parametrize("method", list(METHODS))
def test_batches_with_no_score_warn_then_stop_the_run_naming_the_rewards(method, caplog):
    t = trainer(method, reward_funcs=[never_matches, nan_judge], max_unscored_batches=3, max_steps=10)
    with caplog.at_level(logging.WARNING, logger="plait"), pytest.raises(PlaitError) as err:
        t.train()
    message = str(err.value)
    assert "no completion got a score in 3 generation batches in a row" in message
    assert "every reward (never_matches, nan_judge) returned None or NaN for all 8 completions" in message
    assert "max_unscored_batches" in message and "\n" not in message
    warned = plait_warnings(caplog, "no completion of this generation batch got a score")
    assert len(warned) == 2 and "never_matches, nan_judge" in warned[0] and "2 batch(es) in a row" in warned[1]
    assert t.state.global_step == 2  # two steps trained on nothing, the third batch stopped the run


def test_a_scored_batch_resets_the_count_and_one_scoring_reward_is_enough():
    calls = []

    def every_second_batch(completions, **kwargs):
        calls.append(1)
        return [1.0 if len(calls) % 2 == 0 else None for _ in completions]

    t = trainer(reward_funcs=[every_second_batch, never_matches], max_unscored_batches=2, max_steps=4)
    t.train()  # unscored, scored (by one of the two rewards), unscored, scored: never two in a row
    assert t.state.global_step == 4


# -- rewards that never return ------------------------------------------------------------------


@pytest.mark.parametrize("reward", [hangs, hangs_async], ids=["sync", "async"])
def test_a_hung_reward_fails_the_run_within_seconds_naming_it(reward):
    t = trainer(reward_funcs=[low_tokens, reward], reward_timeout=1)
    start = time.monotonic()
    with pytest.raises(PlaitError) as err:
        t.train()
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert f"reward {reward.__name__!r} did not return within reward_timeout=1s on a batch of 8" in message
    assert "reward_error_policy='none'" in message


def test_the_plait_command_with_a_hung_reward_exits_non_zero_within_seconds(tmp_path):
    (tmp_path / "judge.py").write_text(
        "import time\n\ndef hangs(completions, **kwargs):\n    time.sleep(600)\n    return [1.0] * len(completions)\n"
    )
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(f"""method: grpo
dataset: {{path: json, data_files: {DATA}}}
reward_funcs: ["judge:hangs"]
training:
  output_dir: {tmp_path / "out"}
  num_generations: 4
  per_device_train_batch_size: 8
  max_completion_length: 4
  max_steps: 2
  reward_timeout: 1
  save_strategy: "no"
  report_to: none
""")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(PLAIT), "grpo", "--config", str(recipe), "--model", str(tiny_model_path())],
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode != 0
    assert "reward 'hangs' did not return within reward_timeout=1s" in result.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_hung_reward_under_policy_none_scores_none_and_training_goes_on(caplog):
    t = trainer(reward_funcs=[low_tokens, hangs], reward_timeout=1, reward_error_policy="none")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="plait"):
        t.train()
    assert time.monotonic() - start < 30 and t.state.global_step == 2
    logged = [h for h in t.state.log_history if "rewards/hangs/mean" in h]
    assert len(logged) == 2 and all(math.isnan(h["rewards/hangs/mean"]) for h in logged)
    assert all(math.isfinite(h["rewards/low_tokens/mean"]) for h in logged)
    warned = plait_warnings(caplog, "did not return within reward_timeout=1s")
    assert len(warned) == 2 and "'hangs'" in warned[0] and "scored as None" in warned[0]


def test_a_reward_that_only_ever_hangs_stops_as_unscored():
    t = trainer(reward_funcs=hangs, reward_timeout=1, reward_error_policy="none", max_unscored_batches=2, max_steps=5)
    start = time.monotonic()
    with pytest.raises(PlaitError, match=r"in 2 generation batches in a row: every reward \(hangs\)"):
        t.train()
    assert time.monotonic() - start < 30


def test_an_async_reward_that_blocks_the_event_loop_times_out_and_the_next_batch_gets_a_fresh_loop():
    async def blocks_the_loop(completions, **kwargs):
        time.sleep(5)  # a sync call inside an async reward: wait_for cannot interrupt it
        return [1.0] * len(completions)

    async def fine(completions, **kwargs):
        return [2.0] * len(completions)

    batch = dict(prompts=["q"] * 2, completions=["a", "b"], completion_ids=[[1], [2]], timeout=0.5)
    start = time.monotonic()
    scores = compute_rewards([RewardFunction("blocks_the_loop", blocks_the_loop)], on_error="none", **batch)
    assert time.monotonic() - start < 3 and scores.isnan().all()
    assert compute_rewards([RewardFunction("fine", fine)], **batch).tolist() == [[2.0], [2.0]]


def test_sync_rewards_run_in_the_main_thread_with_or_without_a_timeout_and_in_a_worker_elsewhere_in_one_grad_mode():
    # the main thread keeps math-verify's SIGALRM timeouts working; off it only a worker can be left behind
    seen = []

    def where(completions, **kwargs):
        seen.append((threading.current_thread(), torch.is_grad_enabled()))
        return [0.0] * len(completions)

    batch = dict(prompts=["q"], completions=["a"], completion_ids=[[1]])

    def score(timeout):
        with torch.no_grad():  # as in a rollout
            compute_rewards([RewardFunction("where", where)], timeout=timeout, **batch)

    score(None)
    score(5)
    elsewhere = threading.Thread(target=score, args=(5,))
    elsewhere.start()
    elsewhere.join()
    (first, first_grad), (second, second_grad), (third, third_grad) = seen
    assert first is threading.main_thread() and second is threading.main_thread()
    assert third not in (threading.main_thread(), elsewhere)
    assert not first_grad and not second_grad and not third_grad


def test_a_hung_reward_in_the_main_thread_is_interrupted_even_when_it_catches_every_exception():
    def stubborn(completions, **kwargs):
        try:
            time.sleep(60)
        except Exception:  # noqa: BLE001 - what a careless reward does
            pass
        return [1.0] * len(completions)

    start = time.monotonic()
    scores = compute_rewards([RewardFunction("stubborn", stubborn)], prompts=["q"], completions=["a"],
                             completion_ids=[[1]], timeout=0.5, on_error="none")
    assert time.monotonic() - start < 3 and scores.isnan().all()
    assert not [t for t in threading.enumerate() if "stubborn" in t.name]  # nothing left behind


@pytest.mark.parametrize("overrides, message", [
    ({"reward_timeout": 0}, "reward_timeout=0 must be a number > 0"),
    ({"reward_timeout": -1.5}, "reward_timeout=-1.5 must be a number > 0"),
    ({"max_unscored_batches": 0}, "max_unscored_batches=0 must be an integer >= 1"),
])
def test_bad_settings_fail_before_the_model_loads(overrides, message):
    with pytest.raises(PlaitError, match=message):
        plait.GRPOTrainer("/nonexistent/model", reward_funcs=low_tokens,
                          args=plait.GRPOConfig(output_dir="/tmp/plait-test-reward-robustness", **overrides))


# -- PPO: the same reward knobs (RewardChoice), the same guarantees ---------------------------------


def ppo_trainer(reward_model, **overrides):
    values = dict(output_dir="/tmp/plait-test-reward-robustness-ppo", per_device_train_batch_size=4, response_length=4,
                  num_ppo_epochs=1, learning_rate=1e-3, max_steps=10, logging_steps=1, report_to=[],
                  save_strategy="no", disable_tqdm=True, seed=0)
    args = plait.PPOConfig(**{**values, **overrides})
    return plait.PPOTrainer(str(tiny_model_path()), reward_model=reward_model, args=args, train_dataset=PROMPTS)


def test_ppo_stops_on_unscored_batches_and_on_a_hung_reward():
    t = ppo_trainer([never_matches], max_unscored_batches=2)
    with pytest.raises(PlaitError, match="no completion got a score in 2 generation batches in a row"):
        t.train()
    t = ppo_trainer([hangs], reward_timeout=1)
    start = time.monotonic()
    with pytest.raises(PlaitError, match="reward 'hangs' did not return within reward_timeout=1s"):
        t.train()
    assert time.monotonic() - start < 30
