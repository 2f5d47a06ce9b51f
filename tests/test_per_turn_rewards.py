"""Per-turn rewards in multi-turn episodes (issue 33): environments reward each model turn
(``Step(reward=...)``), the rollout carries each turn's token span and reward into the Rollout, the
turn-level estimators ``advantage.turn_return`` and ``advantage.turn_gae`` credit each turn's tokens,
per-turn metrics are logged, and ``plait grpo`` trains with ``env.quiz`` and a turn-level estimator."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import plait
from plait.engine.batches import Rollout
from plait.errors import PlaitError
from plait.manager import make_plugins
from plait.online.rollouts import Step
from plait.plugins.advantages.turn_gae import TurnGAEParams, turn_gae_advantage
from plait.plugins.advantages.turn_return import TurnReturnParams, turn_return_advantage
from plait.plugins.environments.quiz import QuizEnvironment, QuizParams, last_word
from plait.testing import ContractViolation, check_turn_advantage_estimator, rollouts
from plait.testing.quiz_model import quiz_model_path, quiz_row
from plait.testing.tool_model import QUESTION

PLAIT = Path(sys.executable).parent / "plait"  # the console script installed beside this python
NAN = math.nan
ROW = {"prompt": [{"role": "user", "content": QUESTION}], "answers": [7, 7, 9], "questions": [QUESTION, QUESTION]}
QUIZ = quiz_row()  # three questions, each answered right by one letter; the quiz model answers in letters


def two_episodes() -> Rollout:
    """One group of two 2-turn episodes. Row 0: turn rewards (1, none), episode reward 0.5, so r = (1, 0.5);
    tokens [t0 t0 env t1 t1 pad]. Row 1: turn rewards (0, 1), episode reward 0, r = (0, 1); tokens [t0 env env t1]."""
    return Rollout(rewards=torch.tensor([[0.5], [0.0]]), weights=torch.ones(1), group_size=2,
                   turn_rewards=torch.tensor([[1.0, NAN], [0.0, 1.0]]),
                   turn_index=torch.tensor([[0, 0, -1, 1, 1, -1], [0, -1, -1, 1, -1, -1]]))


def test_turn_return_by_hand():
    # γ = 0.5: G(row 0) = (1 + 0.5·0.5, 0.5) = (1.25, 0.5), G(row 1) = (0 + 0.5·1, 1) = (0.5, 1);
    # turn 0's mean 0.875, turn 1's 0.75; centred: row 0 (+0.375, −0.25), row 1 (−0.375, +0.25).
    out = turn_return_advantage(two_episodes(), TurnReturnParams(gamma=0.5, scale=False))
    assert out.tolist() == [[0.375, 0.375, 0.0, -0.25, -0.25, 0.0], [-0.375, 0.0, 0.0, 0.25, 0.0, 0.0]]
    # scaled by each turn's group std (unbiased, two rows): 0.75/√2 at turn 0, 0.5/√2 at turn 1
    scaled = turn_return_advantage(two_episodes(), TurnReturnParams(gamma=0.5))
    assert scaled[0, 0].item() == pytest.approx(0.375 / (0.75 / math.sqrt(2) + 1e-4))
    assert scaled[1, 3].item() == pytest.approx(0.25 / (0.5 / math.sqrt(2) + 1e-4))


def test_turn_gae_by_hand():
    # V = (0.875, 0.75, 0). Row 0: δ1 = 0.5 − 0.75 = −0.25, δ0 = 1 + 0.5·0.75 − 0.875 = 0.5,
    # A0 = 0.5 + 0.25·(−0.25) = 0.4375. Row 1: δ1 = 0.25, δ0 = −0.5, A0 = −0.5 + 0.25·0.25 = −0.4375.
    out = turn_gae_advantage(two_episodes(), TurnGAEParams(gamma=0.5, lam=0.5, scale=False))
    assert out.tolist() == [[0.4375, 0.4375, 0.0, -0.25, -0.25, 0.0], [-0.4375, 0.0, 0.0, 0.25, 0.0, 0.0]]


def test_a_row_without_per_turn_rewards_keeps_its_episode_reward_on_its_last_turn():
    # Row 0 has per-turn rewards, row 1 none: its episode reward 1 counts on its last turn (γ = 0 keeps it there).
    rollout = Rollout(rewards=torch.tensor([[0.0], [1.0]]), weights=torch.ones(1), group_size=2,
                      turn_rewards=torch.tensor([[1.0, 0.0], [NAN, NAN]]), turn_index=torch.tensor([[0, 1], [0, 1]]))
    out = turn_return_advantage(rollout, TurnReturnParams(gamma=0.0, scale=False))
    assert out.tolist() == [[0.5, -0.5], [-0.5, 0.5]]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(rollouts(turn_level=True), st.sampled_from([0.0, 0.5, 1.0]), st.booleans())
def test_turn_gae_with_lambda_one_is_the_discounted_return_estimator(rollout, gamma, scale):
    gae = turn_gae_advantage(rollout, TurnGAEParams(gamma=gamma, lam=1.0, scale=scale))
    returns = turn_return_advantage(rollout, TurnReturnParams(gamma=gamma, scale=scale))
    assert torch.allclose(gae, returns, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, reduces_with", [("advantage.turn_return", {"gamma": 1.0}),
                                                ("advantage.turn_gae", {"gamma": 1.0, "lam": 1.0})])
def test_turn_level_estimators_pass_the_turn_contract(name, reduces_with):
    checked = check_turn_advantage_estimator(name, reduces_with=reduces_with, max_examples=12)
    assert {"constant within a turn", "0 outside model turns", "episode level without per-turn rewards"} <= set(checked)


def test_the_turn_contract_names_an_estimator_that_varies_within_a_turn():
    class Plugin:
        @plait.hookimpl
        def register_advantage_estimators(self, register):
            register("advantage.positional", lambda rollout, p: torch.arange(rollout.turn_index.shape[1]).float()
                     .expand(rollout.turn_index.shape) * (rollout.turn_index >= 0), token_level=True)

    with pytest.raises(ContractViolation, match="constant within a turn"):
        check_turn_advantage_estimator("advantage.positional", make_plugins(plugins=[Plugin()]), max_examples=12)


def test_the_quiz_environment_rewards_each_turn_at_once_or_only_at_the_end():
    env = QuizEnvironment(QuizParams())
    assert env.reset(ROW) == ROW["prompt"]
    assert env.step("The answer is 7.", []) == Step([{"role": "user", "content": QUESTION}], reward=1 / 3)
    assert env.step("8", []).reward == 0.0
    assert env.step("It is 9!", []) == Step(done=True, reward=1 / 3) and env.reward() == 0.0
    end = QuizEnvironment(QuizParams(per_turn=False))
    end.reset(ROW)
    assert [end.step(t, []).reward for t in ("7", "7", "1")] == [None] * 3 and end.reward() == 2 / 3
    assert last_word("  ") is None
    with pytest.raises(PlaitError, match="finite number"):
        Step(reward=math.inf)


@pytest.fixture(scope="module")
def trainer():
    args = plait.GRPOConfig(output_dir="/tmp/plait-test-per-turn", per_device_train_batch_size=8, num_generations=4,
                            max_completion_length=96, learning_rate=1e-3, max_steps=1, logging_steps=1, report_to=[],
                            save_strategy="no", disable_tqdm=True, seed=0,
                            environment={"name": "quiz"}, advantage_estimator="turn_return")
    return plait.GRPOTrainer(str(quiz_model_path()), args=args, train_dataset=[QUIZ] * 8)


def test_a_real_rollout_carries_each_turns_span_and_reward_into_the_advantages(trainer):
    judged: dict[int, list[tuple[str, float]]] = {}  # per episode (the first turns come in row order)
    step = QuizEnvironment.step

    def noting(self, text, calls):
        out = step(self, text, calls)
        judged.setdefault(id(self), []).append((text, out.reward))
        return out

    inputs = next(iter(trainer.get_train_dataloader()))
    QuizEnvironment.step = noting
    try:
        draft = trainer.sample(inputs)
    finally:
        QuizEnvironment.step = step
    episodes, batch = draft.generations, draft.batch
    assert episodes.stats["turns"] == [3] * 8  # every episode ran its three questions
    for i, (spans, turn_rewards, seen) in enumerate(zip(episodes.turn_spans, episodes.turn_rewards, judged.values())):
        assert len(spans) == episodes.stats["turns"][i] == len(turn_rewards)
        index = batch["turn_index"][i]
        for k, (start, end) in enumerate(spans):
            assert episodes.trainable[i][start:end] == [1] * (end - start)  # a turn is the model's own tokens
            assert (index[start:end] == k).all()
            if turn_rewards[k] is not None:  # the environment judged this turn: its reward, in order
                text, reward = seen[k]
                assert turn_rewards[k] == reward == (1 / 3 if last_word(text) == QUIZ["answers"][k].lower() else 0.0)
                assert batch["turn_rewards"][i, k].item() == pytest.approx(reward)
        assert ((index >= 0) == batch["completion_mask"][i].bool()).all()  # inserted tokens and padding: −1
    trainer.score(draft)
    trainer.estimate(draft)
    out = trainer.record_rollout(draft)
    advantages, index = out["advantages"], batch["turn_index"]
    assert advantages.shape == out["completion_mask"].shape
    for k in range(int(index.max()) + 1):  # one advantage per turn, 0 outside model turns
        at = advantages.masked_fill(index != k, NAN)
        assert torch.allclose(at.nan_to_num(-1e9).amax(1)[(index == k).any(1)],
                              at.nan_to_num(1e9).amin(1)[(index == k).any(1)])
    assert (advantages[index < 0] == 0).all()
    metrics = trainer._metrics["eval"]  # the trainer is not training: its rollouts log as evaluation
    assert metrics["rewards/turns/mean"][-1] == 3
    for k in range(3):
        assert metrics[f"rewards/turn_{k + 1}/mean"][-1] == pytest.approx(sum(row[k] for row in episodes.turn_rewards) / 8)
    assert metrics["rewards/return/mean"][-1] == pytest.approx(sum(map(sum, episodes.turn_rewards)) / 8)
    assert len({r for row in episodes.turn_rewards for r in row}) == 2  # right and wrong turns both occur


def test_episodes_without_per_turn_rewards_log_no_per_turn_metrics(tmp_path):
    args = plait.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=96, max_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                            seed=0, environment={"name": "quiz", "per_turn": False})
    end = plait.GRPOTrainer(str(quiz_model_path()), args=args, train_dataset=[QUIZ] * 4)
    end.rollout(next(iter(end.get_train_dataloader())))
    metrics = end._metrics["eval"]
    assert "rewards/environment/mean" in metrics and not any(name.startswith("rewards/turn") for name in metrics)


def test_plait_grpo_trains_with_per_turn_rewards_and_a_turn_level_estimator(tmp_path):
    (tmp_path / "quiz.jsonl").write_text(json.dumps(QUIZ) + "\n")
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump({
        "method": "grpo", "model": str(quiz_model_path()),
        "dataset": {"path": "json", "data_files": str(tmp_path / "quiz.jsonl")},
        "training": {"environment": {"name": "quiz"}, "advantage_estimator": {"name": "turn_gae", "lam": 0.9},
                     "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 96,
                     "learning_rate": 1e-3, "max_steps": 2, "logging_steps": 1,
                     "save_strategy": "no", "report_to": "none", "seed": 0},
    }))
    done = subprocess.run([str(PLAIT), "grpo", "--config", str(recipe), "--output_dir", str(tmp_path / "out")],
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [entry for entry in logged if "rewards/turns/mean" in entry]
    assert len(steps) == 2 and all(entry["rewards/turns/mean"] == 3 for entry in steps)
