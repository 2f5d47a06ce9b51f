"""KTO, SFT and reward-model losses against their formulas, computed plainly by hand."""

import importlib.metadata
import math

import pytest
import torch

import plait
from plait.engine.batches import PairwiseRewards, PreferenceLogps, TokenLogps, UnpairedLogps
from plait.engine.objective import Objective, normalise_loss_specs
from plait.errors import PlaitError


@pytest.fixture(scope="module")
def losses():
    return plait.make_plugins().losses


def sig(x):
    return 1 / (1 + math.exp(-x))


def run(losses, name, batch, **params):
    component = losses.get(name)
    return component.obj(batch, component.make_params(**params) if component.params else None)


# ---- KTO ----------------------------------------------------------------------------------------

LOGPS, REF = [-4.0, -6.0, -3.0, -8.0], [-4.5, -5.0, -3.2, -7.0]  # r = [0.5, -1.0, 0.2, -1.0]
DESIRABLE = [True, False, True, False]
Z, BETA, WD, WU = 0.25, 0.5, 1.3, 0.7


def unpaired():
    return UnpairedLogps(torch.tensor(LOGPS, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64),
                         torch.tensor(DESIRABLE), torch.tensor(Z, dtype=torch.float64))


def test_kto_matches_formula(losses):
    expected = []
    for lp, ref, good in zip(LOGPS, REF, DESIRABLE):
        r = lp - ref
        expected.append(WD * (1 - sig(BETA * (r - Z))) if good else WU * (1 - sig(BETA * (Z - r))))
    loss = run(losses, "kto.kto", unpaired(), beta=BETA, desirable_weight=WD, undesirable_weight=WU)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))


def test_kto_apo_zero_unpaired_matches_formula(losses):
    expected = []
    for lp, ref, good in zip(LOGPS, REF, DESIRABLE):
        r = lp - ref
        expected.append(WD * (1 - sig(BETA * r)) if good else WU * sig(BETA * r))
    loss = run(losses, "kto.apo_zero_unpaired", unpaired(), beta=BETA, desirable_weight=WD, undesirable_weight=WU)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))


def test_kto_defaults_weigh_both_classes_equally(losses):
    for name in ("kto.kto", "kto.apo_zero_unpaired"):
        params = losses.get(name).make_params()
        assert (params.beta, params.desirable_weight, params.undesirable_weight) == (0.1, 1.0, 1.0)


def test_kto_composes_under_the_kto_family(losses):
    objective = Objective.build(normalise_loss_specs(["kto"]), losses, family="kto", consumes=UnpairedLogps,
                                shared={"beta": BETA})
    total, parts = objective(unpaired())
    r = [lp - ref for lp, ref in zip(LOGPS, REF)]
    expected = sum(1 - sig(BETA * (x - Z)) if good else 1 - sig(BETA * (Z - x)) for x, good in zip(r, DESIRABLE)) / 4
    assert total.item() == pytest.approx(expected) and parts["kto.kto"].item() == pytest.approx(expected)


@pytest.mark.parametrize("name", ["kto.kto", "kto.apo_zero_unpaired"])
@pytest.mark.parametrize("field, value, rule", [("beta", 0.0, "> 0"), ("desirable_weight", -1.0, ">= 0"),
                                                ("undesirable_weight", -0.5, ">= 0")])
def test_kto_bad_params_name_the_loss_and_field(losses, name, field, value, rule):
    with pytest.raises(PlaitError, match=rf"loss '{name}': {field}={value} must be a number {rule}"):
        losses.get(name).make_params(**{field: value})


def test_a_kto_loss_is_refused_by_a_preference_method(losses):
    with pytest.raises(PlaitError, match="consumes UnpairedLogps but this method provides PreferenceLogps"):
        Objective.build(normalise_loss_specs(["kto.kto"]), losses, family="dpo", consumes=PreferenceLogps)


# ---- SFT ----------------------------------------------------------------------------------------

TOKEN_LOGPS = [[-0.5, -1.2, -2.0], [-0.1, -3.0, -7.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


def tokens(requires_grad=False):
    logps = torch.tensor(TOKEN_LOGPS, dtype=torch.float64, requires_grad=requires_grad)
    return TokenLogps(logps, torch.tensor(MASK))


def test_sft_losses_are_per_token(losses):
    for name in ("sft.nll", "sft.dft"):
        assert losses.get(name).options.declared() == {"consumes": TokenLogps, "output": "token"}
        assert losses.get(name).params is None


def test_sft_nll_is_minus_logp_and_reduces_over_kept_tokens(losses):
    torch.testing.assert_close(run(losses, "sft.nll", tokens()), -torch.tensor(TOKEN_LOGPS, dtype=torch.float64))
    objective = Objective.build(normalise_loss_specs(["nll"]), losses, family="sft", consumes=TokenLogps)
    batch = tokens()
    total, parts = objective(batch, mask=batch.mask)
    assert total.item() == pytest.approx((0.5 + 1.2 + 2.0 + 0.1 + 3.0) / 5)  # the masked −7.0 is ignored
    total, _ = objective(batch, mask=batch.mask, num_tokens=10)  # a global token count
    assert total.item() == pytest.approx((0.5 + 1.2 + 2.0 + 0.1 + 3.0) / 10)


def test_sft_dft_value_and_its_detached_weight(losses):
    batch = tokens(requires_grad=True)
    loss = run(losses, "sft.dft", batch)
    expected = [[-math.exp(lp) * lp for lp in row] for row in TOKEN_LOGPS]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    loss.sum().backward()
    # d/dlogp of −sg(p)·logp is −p: no p·logp term, which the weight would add if it were not detached
    grad = [[-math.exp(lp) for lp in row] for row in TOKEN_LOGPS]
    torch.testing.assert_close(batch.logps.grad, torch.tensor(grad, dtype=torch.float64))


def test_sft_losses_take_no_parameters(losses):
    with pytest.raises(PlaitError, match="loss 'sft.dft' takes no parameters"):
        losses.get("sft.dft").make_params(beta=0.1)


# ---- reward model -------------------------------------------------------------------------------

CHOSEN_R, REJECTED_R, MARGIN = [1.0, 0.2, -0.5], [0.0, 0.6, -1.5], [0.5, 0.0, 1.0]


def test_pairwise_rewards_margin_defaults_to_zeros():
    batch = PairwiseRewards(torch.tensor(CHOSEN_R), torch.tensor(REJECTED_R))
    assert torch.equal(batch.margin, torch.zeros(3)) and batch.batch_size == 3


def test_bradley_terry_matches_formula(losses):
    c = 0.01
    expected = [-math.log(sig(rc - rr - m)) + c * (rc + rr) ** 2 for rc, rr, m in zip(CHOSEN_R, REJECTED_R, MARGIN)]
    batch = PairwiseRewards(*(torch.tensor(v, dtype=torch.float64) for v in (CHOSEN_R, REJECTED_R, MARGIN)))
    loss = run(losses, "reward_model.bradley_terry", batch, center_rewards_coefficient=c)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))


def test_bradley_terry_default_is_plain_bt_without_margin(losses):
    expected = [-math.log(sig(rc - rr)) for rc, rr in zip(CHOSEN_R, REJECTED_R)]
    batch = PairwiseRewards(torch.tensor(CHOSEN_R, dtype=torch.float64), torch.tensor(REJECTED_R, dtype=torch.float64))
    torch.testing.assert_close(run(losses, "reward_model.bradley_terry", batch), torch.tensor(expected, dtype=torch.float64))
    assert losses.get("reward_model.bradley_terry").options.declared() == {"consumes": PairwiseRewards}


def test_bradley_terry_refuses_a_negative_centring_coefficient(losses):
    with pytest.raises(PlaitError, match=r"loss 'reward_model.bradley_terry': center_rewards_coefficient=-0.1 "
                                         r"must be a number >= 0"):
        losses.get("reward_model.bradley_terry").make_params(center_rewards_coefficient=-0.1)


def test_every_module_has_an_entry_point():
    modules = {ep.value for ep in importlib.metadata.entry_points(group="plait")}
    for module in ("kto", "kto_apo_zero_unpaired", "sft_nll", "sft_dft", "reward_model_bradley_terry"):
        assert f"plait.losses.{module}" in modules
