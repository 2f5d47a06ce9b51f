"""Advantage estimators: hand-computed values on fixed rollouts, and properties over random ones
(shape, no NaN, unscored rows get 0, all-equal groups get 0, zero mean per group where declared)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait import make_plugins
from plait.engine.batches import Rollout
from plait.errors import PlaitError
from plait.online.scoring import resolve_advantage_estimator
from plait.testing.strategies import rollouts

NAN = math.nan
EPS = 1e-4
ESTIMATORS = ["group", "batch", "none", "normalize_then_sum", "rloo"]


@pytest.fixture(scope="module")
def plugins():
    return make_plugins()


def advantage(plugins, spec, rewards, group_size, weights=None):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)
    weights = torch.ones(rewards.shape[1]) if weights is None else torch.tensor(weights)
    return resolve_advantage_estimator(spec, plugins)(Rollout(rewards, weights, group_size)).tolist()


def close(actual, expected):
    return actual == pytest.approx(expected, abs=1e-5)


# Two groups of three: R = [1, 2, 3] (mean 2, unbiased std 1) and [0, 0, 0] (no signal).
R = [1.0, 2.0, 3.0, 0.0, 0.0, 0.0]
BATCH_STD = math.sqrt(8 / 5)  # unbiased std of R over all six completions (mean 1)


def test_group(plugins):
    d = 1 + EPS
    assert close(advantage(plugins, "group", R, 3), [-1 / d, 0, 1 / d, 0, 0, 0])
    assert close(advantage(plugins, {"name": "group", "scale": False}, R, 3), [-1, 0, 1, 0, 0, 0])
    assert close(advantage(plugins, {"name": "group", "epsilon": 1.0}, R, 3), [-0.5, 0, 0.5, 0, 0, 0])


def test_batch(plugins):
    d = BATCH_STD + EPS
    assert close(advantage(plugins, "batch", R, 3), [-1 / d, 0, 1 / d, 0, 0, 0])


def test_none_is_dr_grpo(plugins):
    assert close(advantage(plugins, "advantage.none", R, 3), [-1, 0, 1, 0, 0, 0])


def test_rloo_leave_one_out_baseline(plugins):
    # b_1 = (6 − 1)/2 = 2.5, b_2 = 2, b_3 = 1.5
    assert close(advantage(plugins, "rloo", R, 3), [-1.5, 0, 1.5, 0, 0, 0])
    normalized = advantage(plugins, {"name": "rloo", "normalize": True}, R, 3)
    d = math.sqrt(4.5 / 5) + EPS  # batch std of [-1.5, 0, 1.5, 0, 0, 0]
    assert close(normalized, [-1.5 / d, 0, 1.5 / d, 0, 0, 0])


def test_normalize_then_sum_normalises_each_reward_before_summing(plugins):
    # group 1: r1 = [1, 0] (z = ±c), r2 = [0, 0] (z = 0); group 2: r1 = [0, 0], r2 = [3, 1] (z = ±d), w2 = 2
    c = 0.5 / (math.sqrt(0.5) + EPS)
    d = 1.0 / (math.sqrt(2.0) + EPS)
    s = [c, -c, 2 * d, -2 * d]
    std = math.sqrt(sum(v * v for v in s) / 3)  # batch mean of S is 0
    rewards = [[1.0, 0.0], [0.0, 0.0], [0.0, 3.0], [0.0, 1.0]]
    expected = [v / (std + EPS) for v in s]
    assert close(advantage(plugins, "normalize_then_sum", rewards, 2, weights=[1.0, 2.0]), expected)


def test_normalize_then_sum_weights_each_z_scored_reward(plugins):
    # G = 4, two binary rewards, w = [1, 3]: z1 = c·[1, −1, 1, −1], z2 = c·[−1, 1, 1, −1]
    # S = z1 + 3·z2 = c·[−2, 2, 4, −4], then the batch z-score (mean 0, std c·√(40/3))
    rewards = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    c = 0.5 / (math.sqrt(1 / 3) + EPS)
    s = [-2 * c, 2 * c, 4 * c, -4 * c]
    std = c * math.sqrt(40 / 3)
    assert close(advantage(plugins, "normalize_then_sum", rewards, 4, [1.0, 3.0]), [v / (std + EPS) for v in s])


def test_none_scores_are_left_out(plugins):
    # group 1: the middle completion has no score; group 2 has only one scored completion
    rewards = [1.0, NAN, 3.0, NAN, 5.0, NAN]
    s = math.sqrt(2) + EPS  # unbiased std of the scored [1, 3]
    assert close(advantage(plugins, "group", rewards, 3), [-1 / s, 0, 1 / s, 0, 0, 0])
    assert close(advantage(plugins, "none", rewards, 3), [-1, 0, 1, 0, 0, 0])
    assert close(advantage(plugins, "rloo", rewards, 3), [-2, 0, 2, 0, 0, 0])  # G = 2 scored: b_1 = 3
    batch_std = 2.0  # scored [1, 3, 5]: mean 3, squares 4 + 0 + 4 = 8, over 2: variance 4
    assert close(advantage(plugins, "batch", rewards, 3), [-1 / (batch_std + EPS), 0, 1 / (batch_std + EPS), 0, 0, 0])


def test_a_partly_scored_row_sums_the_rewards_it_has(plugins):
    rewards = [[1.0, NAN], [0.0, 1.0]]  # weights [1, 2]: R = [1, 2]
    assert close(advantage(plugins, "none", rewards, 2, weights=[1.0, 2.0]), [-0.5, 0.5])


@pytest.mark.parametrize("name", ESTIMATORS)
def test_wrong_grouping_is_refused(plugins, name):
    with pytest.raises(PlaitError, match="5 completions do not split into groups of 2"):
        advantage(plugins, name, [1.0] * 5, 2)


@pytest.mark.parametrize("spec, message", [
    ({"name": "group", "epsilon": 0}, r"advantage estimator 'advantage.group': epsilon=0 must be a number > 0"),
    ({"name": "group", "scale": "yes"}, r"'scale' must be <class 'bool'>"),
    ({"name": "none", "scale": False}, r"'advantage.none' takes no parameters"),
    ({"name": "rloo", "normalise": True}, r"unknown parameter 'normalise' \(did you mean 'normalize'\?\)"),
    ("gruop", r"unknown advantage estimator 'gruop' \(did you mean 'advantage.group'\?\)"),
    ({"scale": True}, r"advantage needs a name"),
])
def test_parameters_are_validated(plugins, spec, message):
    with pytest.raises(PlaitError, match=message):
        resolve_advantage_estimator(spec, plugins)


def test_every_estimator_is_registered_with_its_options(plugins):
    for name in ESTIMATORS:
        estimator = resolve_advantage_estimator(name, plugins)
        assert estimator.name == f"advantage.{name}" and estimator.zero_mean_per_group


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(rollout=rollouts(dtype=torch.float32) | rollouts(dtype=torch.float16) | rollouts(rewards=st.floats(-1e4, 1e4)))
def test_shape_no_nan_and_unscored_rows_get_zero(plugins, rollout):
    unscored = rollout.rewards.isnan().all(dim=1)
    for name in ESTIMATORS:
        out = resolve_advantage_estimator(name, plugins)(rollout)
        assert out.shape == (rollout.rewards.shape[0],), name
        assert torch.isfinite(out).all(), (name, rollout, out)
        assert (out[unscored] == 0).all(), name


@PROPERTY
@given(rollout=rollouts(all_equal=True))
def test_all_equal_groups_get_zero(plugins, rollout):
    for name in ESTIMATORS:
        out = resolve_advantage_estimator(name, plugins)(rollout)
        assert out.abs().max().item() <= 1e-4, (name, rollout, out)


@PROPERTY
@given(rollout=rollouts())
def test_zero_mean_per_group_where_declared(plugins, rollout):
    for name in ESTIMATORS:
        estimator = resolve_advantage_estimator(name, plugins)
        if not estimator.zero_mean_per_group:
            continue
        out = estimator(rollout).double().view(-1, rollout.group_size)
        tolerance = 1e-5 * rollout.group_size * max(1.0, out.abs().max().item())
        assert out.sum(dim=1).abs().max().item() <= tolerance, (name, rollout, out)


@PROPERTY
@given(rollout=rollouts(none=False))
def test_shifting_every_reward_changes_nothing_but_scaling_scales_dr_grpo(plugins, rollout):
    shifted = Rollout(rollout.rewards + 4.0, rollout.weights, rollout.group_size)
    doubled = Rollout(rollout.rewards * 2.0, rollout.weights, rollout.group_size)
    for name in ESTIMATORS:
        estimator = resolve_advantage_estimator(name, plugins)
        torch.testing.assert_close(estimator(shifted), estimator(rollout), atol=1e-3, rtol=1e-3)
    none = resolve_advantage_estimator("none", plugins)
    torch.testing.assert_close(none(doubled), 2 * none(rollout), atol=1e-4, rtol=1e-4)
