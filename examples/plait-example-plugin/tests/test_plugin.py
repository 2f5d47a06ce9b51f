"""The example plugin's own tests: one-line contract checks from plait.testing, then exact values."""

import math

import pytest
import torch

from plait.engine.batches import PreferenceLogps, Rollout
from plait.testing import check_advantage_estimator, check_environment, check_loss, check_reward


def test_simpo_contract():
    check_loss("dpo.simpo")


def test_concise_contract():
    check_reward("reward.concise")


def test_centered_rank_contract():
    check_advantage_estimator("advantage.centered_rank")


def test_guess_number_contract():
    # episodes driven through the transformers backend on plait's tiny model
    check_environment("env.guess_number", [{"secret": 7}, {"secret": 93}], max_completion_length=24)


def test_simpo_by_hand(plait_plugins):
    loss = plait_plugins.losses.get("dpo.simpo")
    batch = PreferenceLogps(
        chosen_logps=torch.tensor([-4.0, -9.0]), rejected_logps=torch.tensor([-12.0, -3.0]),
        ref_chosen_logps=torch.tensor([-100.0, 0.0]), ref_rejected_logps=torch.tensor([0.0, -100.0]),
        chosen_lengths=torch.tensor([2.0, 3.0]), rejected_lengths=torch.tensor([4.0, 0.0]),
    )
    # pair 0: 2·(−2 − (−3)) − 1 = 1;  pair 1: 2·(−3 − (−3/1)) − 1 = −1  (empty rejected: length 1)
    expected = [math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.0))]
    out = loss.obj(batch, loss.make_params(beta=2.0, gamma=1.0))
    assert out.tolist() == pytest.approx(expected, rel=1e-6)


def test_simpo_rejects_a_negative_margin(plait_plugins):
    with pytest.raises(ValueError, match=r"gamma=-0.5"):
        plait_plugins.losses.get("dpo.simpo").make_params(gamma=-0.5)


def test_concise_by_hand(plait_plugins):
    reward = plait_plugins.rewards.get("reward.concise")
    score = reward.obj(reward.make_params(max_words=2))
    completions = ["one two", "one two three four", "", [{"role": "assistant", "content": "a b c"}]]
    assert score(completions=completions, prompts=["p"] * 4, solution=["s"] * 4) == [1.0, 0.5, None, 2 / 3]


def test_centered_rank_by_hand(plait_plugins):
    estimator = plait_plugins.advantage_estimators.get("advantage.centered_rank")
    nan = math.nan
    rollout = Rollout(
        rewards=torch.tensor([[3.0], [1.0], [1.0], [0.0],      # group 1: ranks 3, 1.5, 1.5, 0 of 3
                              [2.0], [nan], [5.0], [nan],      # group 2: two scored rows
                              [7.0], [7.0], [7.0], [7.0]]),    # group 3: all equal
        weights=torch.tensor([1.0]), group_size=4,
    )
    out = estimator.obj(rollout, None)
    assert out.tolist() == pytest.approx([0.5, 0.0, 0.0, -0.5, -0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
