"""advantage.gae: a hand-computed trajectory, the λ = 0 and γ = λ = 1 limits, masks, and the kit's contract."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait import PlaitError, make_plugins
from plait.engine.batches import Rollout
from plait.online.scoring import resolve_advantage_estimator
from plait.plugins.advantages.gae import GAEParams, gae_advantage
from plait.testing import check_advantage_estimator

FEW = settings(max_examples=25, deadline=None)


def rollout(rewards, values, mask) -> Rollout:
    rewards, values = torch.tensor(rewards), torch.tensor(values)
    return Rollout(rewards=rewards.sum(-1, keepdim=True), weights=torch.ones(1), group_size=1,
                   token_rewards=rewards, values=values, mask=torch.tensor(mask, dtype=torch.bool))


def test_a_hand_computed_trajectory():
    # γ = 0.9, λ = 0.8, so γλ = 0.72. Row 0 ends after three tokens: its fourth value (9) must not bootstrap.
    # Row 0: δ = (0 + .9·.4 − .5, 0 + .9·.3 − .4, 1 + 0 − .3) = (−.14, −.13, .7)
    #        A2 = .7, A1 = −.13 + .72·.7 = .374, A0 = −.14 + .72·.374 = .12928
    # Row 1: δ = (2 + 0 − 1, −1 + .9 − 0, 0 + 0 − 1, .5) = (1, −.1, −1, .5)
    #        A3 = .5, A2 = −1 + .36 = −.64, A1 = −.1 − .4608 = −.5608, A0 = 1 − .403776 = .596224
    r = rollout([[0.0, 0.0, 1.0, 5.0], [2.0, -1.0, 0.0, 0.5]],
                [[0.5, 0.4, 0.3, 9.0], [1.0, 0.0, 1.0, 0.0]],
                [[1, 1, 1, 0], [1, 1, 1, 1]])
    out = gae_advantage(r, GAEParams(gamma=0.9, lam=0.8))
    expected = torch.tensor([[0.12928, 0.374, 0.7, 0.0], [0.596224, -0.5608, -0.64, 0.5]])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_the_registry_resolves_gae_with_its_parameters():
    estimator = resolve_advantage_estimator({"name": "gae", "gamma": 0.9, "lam": 0.8}, make_plugins())
    assert estimator.name == "advantage.gae" and estimator.params == GAEParams(0.9, 0.8)
    assert estimator.component.options.token_level is True


@st.composite
def trajectories(draw):
    n, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    grid = lambda: torch.tensor(draw(st.lists(st.floats(-5, 5), min_size=n * t, max_size=n * t))).view(n, t)  # noqa: E731
    lengths = torch.tensor(draw(st.lists(st.integers(0, t), min_size=n, max_size=n)))
    mask = torch.arange(t) < lengths[:, None]
    return Rollout(rewards=torch.zeros(n, 1), weights=torch.ones(1), group_size=1, token_rewards=grid(),
                   values=grid(), mask=mask)


@FEW
@given(trajectories())
def test_gamma_lambda_one_is_the_return_to_go_minus_the_value(r):
    """γ = λ = 1: A_t = Σ_{k≥t} r_k − V_t over the kept tokens (Monte Carlo with a baseline)."""
    m = r.mask.float()
    to_go = (r.token_rewards * m).flip(-1).cumsum(-1).flip(-1)
    expected = (to_go - r.values) * m
    torch.testing.assert_close(gae_advantage(r, GAEParams(1.0, 1.0)), expected, rtol=1e-5, atol=1e-5)


@FEW
@given(trajectories(), st.floats(0.0, 1.0))
def test_lambda_zero_is_the_one_step_td_error(r, gamma):
    m = r.mask.float()
    next_values = torch.cat([(r.values * m)[:, 1:], torch.zeros(m.shape[0], 1)], dim=1)
    expected = (r.token_rewards + gamma * next_values - r.values) * m
    torch.testing.assert_close(gae_advantage(r, GAEParams(gamma, 0.0)), expected, rtol=1e-5, atol=1e-5)


@FEW
@given(trajectories(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_what_lies_past_the_mask_changes_nothing(r, gamma, lam):
    noise = torch.randn(r.values.shape) * 100
    changed = Rollout(rewards=r.rewards, weights=r.weights, group_size=1, mask=r.mask,
                      token_rewards=torch.where(r.mask, r.token_rewards, noise),
                      values=torch.where(r.mask, r.values, noise))
    p = GAEParams(gamma, lam)
    out = gae_advantage(r, p)
    torch.testing.assert_close(gae_advantage(changed, p), out)
    assert bool((out[~r.mask] == 0).all())


def test_it_passes_the_kits_contract():
    checked = check_advantage_estimator("advantage.gae", make_plugins())
    assert {"shape preserved", "finite advantages", "permutation equivariance"} <= set(checked)


def test_a_sequence_level_rollout_is_refused_with_the_fix():
    with pytest.raises(PlaitError, match="token_rewards, values and mask"):
        gae_advantage(Rollout(rewards=torch.zeros(2, 1), weights=torch.ones(1), group_size=1), GAEParams())


@pytest.mark.parametrize("field, value", [("gamma", 1.5), ("lam", -0.1), ("gamma", math.nan)])
def test_parameters_are_validated(field, value):
    with pytest.raises(PlaitError, match=field):
        make_plugins().advantage_estimators.get("advantage.gae").make_params(**{field: value})
