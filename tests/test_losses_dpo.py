"""Every DPO loss variant against the formula of the DPO table, computed plainly by hand.

Three pairs with hand-picked log-probs; each variant that uses s = f(r) is checked under every
f-divergence, and the ones that use raw log-ratios or log-probs must ignore the divergence.
"""

import importlib.metadata
import math

import pytest
import torch

import plait
from plait.batches import PreferenceLogps
from plait.divergences import f_divergence
from plait.errors import PlaitError
from plait.objective import Objective, normalise_loss_specs
from plait.registry import UnknownComponentError

CHOSEN = [-5.0, -12.0, -3.5]
REJECTED = [-7.0, -10.0, -9.0]
REF_CHOSEN = [-9.0, -11.0, -3.8]
REF_REJECTED = [-6.0, -10.5, -8.2]
LEN_C, LEN_R = [4, 10, 3], [5, 8, 7]
# r_c = [4.0, -1.0, 0.3], r_r = [-1.0, 0.5, -0.8]; sorting over the batch permutes both the
# policy margins [2, -2, 5.5] and the reference ones [-3, -0.5, 4.4] differently, so AOT ≠ DPO.
DIVERGENCES = ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]
B = 0.3  # beta


@pytest.fixture(scope="module")
def losses():
    return plait.make_plugins().losses


def batch(divergence="reverse_kl", dtype=torch.float64, **override):
    values = {**dict(chosen_logps=CHOSEN, rejected_logps=REJECTED, ref_chosen_logps=REF_CHOSEN,
                     ref_rejected_logps=REF_REJECTED), **override}
    tensors = {k: torch.tensor(v, dtype=dtype) for k, v in values.items()}
    return PreferenceLogps(**tensors, chosen_lengths=torch.tensor(LEN_C), rejected_lengths=torch.tensor(LEN_R),
                           divergence=f_divergence(divergence))


def f(divergence, r, alpha=0.5):
    return {"reverse_kl": r, "forward_kl": -math.exp(-r), "js_divergence": math.log(1 / (1 + math.exp(-r))),
            "alpha_divergence": math.exp((alpha - 1) * r) / (alpha - 1)}[divergence]


def sig(x):
    return 1 / (1 + math.exp(-x))


def logsig(x):
    return math.log(sig(x))


def pairs(divergence):
    for i in range(3):
        rc, rr = CHOSEN[i] - REF_CHOSEN[i], REJECTED[i] - REF_REJECTED[i]
        yield dict(rc=rc, rr=rr, sc=f(divergence, rc), sr=f(divergence, rr), lc=LEN_C[i], lr=LEN_R[i], lpc=CHOSEN[i])


# name -> (params, per-pair loss by hand)
PER_PAIR = {
    "dpo.sigmoid": ({"beta": B, "label_smoothing": 0.1},
                    lambda p: -0.9 * logsig(B * (p["sc"] - p["sr"])) - 0.1 * logsig(-B * (p["sc"] - p["sr"]))),
    "dpo.hinge": ({"beta": B}, lambda p: max(0.0, 1 - B * (p["sc"] - p["sr"]))),
    "dpo.ipo": ({"beta": B}, lambda p: (p["sc"] / p["lc"] - p["sr"] / p["lr"] - 1 / (2 * B)) ** 2),
    "dpo.exo_pair": ({"beta": B, "label_smoothing": 0.05}, lambda p: (
        sig(B * (p["sc"] - p["sr"])) * (logsig(B * (p["sc"] - p["sr"])) - math.log(0.95))
        + sig(-B * (p["sc"] - p["sr"])) * (logsig(-B * (p["sc"] - p["sr"])) - math.log(0.05)))),
    "dpo.nca_pair": ({"beta": B}, lambda p: -logsig(B * p["sc"]) - 0.5 * logsig(-B * p["sc"]) - 0.5 * logsig(-B * p["sr"])),
    "dpo.robust": ({"beta": B, "label_smoothing": 0.2}, lambda p: (
        -0.8 * logsig(B * (p["sc"] - p["sr"])) + 0.2 * logsig(-B * (p["sc"] - p["sr"]))) / 0.6),
    "dpo.bco_pair": ({"beta": B}, lambda p: -logsig(B * p["sc"]) - logsig(-B * p["sr"])),
    "dpo.sppo_hard": ({"beta": B}, lambda p: (p["sc"] - 1 / (2 * B)) ** 2 + (p["sr"] + 1 / (2 * B)) ** 2),
    "dpo.apo_zero": ({"beta": B}, lambda p: 1 - sig(B * p["rc"]) + sig(B * p["rr"])),
    "dpo.apo_down": ({"beta": B}, lambda p: sig(B * p["rc"]) + 1 - sig(B * (p["sc"] - p["sr"]))),
    "dpo.discopop": ({"beta": B, "discopop_tau": 0.05}, lambda p: (
        (1 - sig(B * (p["sc"] - p["sr"]) / 0.05)) * -logsig(B * (p["sc"] - p["sr"]))
        + sig(B * (p["sc"] - p["sr"]) / 0.05) * math.exp(-B * (p["sc"] - p["sr"])))),
    "dpo.sft": ({}, lambda p: -p["lpc"] / p["lc"]),
    "dpo.sigmoid_norm": ({"beta": B}, lambda p: -logsig(B * (p["sc"] / p["lc"] - p["sr"] / p["lr"]))),
}


def compute(losses, name, params, divergence="reverse_kl"):
    component = losses.get(name)
    return component.obj(batch(divergence), component.make_params(**params))


@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("name", sorted(PER_PAIR))
def test_per_pair_variant_matches_formula(losses, name, divergence):
    params, by_hand = PER_PAIR[name]
    expected = torch.tensor([by_hand(p) for p in pairs(divergence)], dtype=torch.float64)
    torch.testing.assert_close(compute(losses, name, params, divergence), expected)


def aot_by_hand(deltas, eps):
    return [-(1 - eps) * logsig(B * d) - eps * logsig(-B * d) for d in deltas]


@pytest.mark.parametrize("divergence", DIVERGENCES)  # AOT uses raw log-probs: f must not matter
def test_aot_sorts_policy_and_reference_margins(losses, divergence):
    policy = sorted(c - r for c, r in zip(CHOSEN, REJECTED))
    reference = sorted(c - r for c, r in zip(REF_CHOSEN, REF_REJECTED))
    expected = aot_by_hand([p - q for p, q in zip(policy, reference)], 0.1)
    loss = compute(losses, "dpo.aot", {"beta": B, "label_smoothing": 0.1}, divergence)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("name", ["dpo.aot_unpaired", "dpo.aot_pair"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_aot_unpaired_sorts_chosen_and_rejected_log_ratios(losses, name, divergence):
    chosen = sorted(c - r for c, r in zip(CHOSEN, REF_CHOSEN))
    rejected = sorted(c - r for c, r in zip(REJECTED, REF_REJECTED))
    expected = aot_by_hand([c - r for c, r in zip(chosen, rejected)], 0.1)
    loss = compute(losses, name, {"beta": B, "label_smoothing": 0.1}, divergence)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))


def test_aot_differs_from_dpo_on_this_batch(losses):
    # guards the two tests above: the data must make sorting matter
    aot = compute(losses, "dpo.aot", {"beta": B})
    dpo = compute(losses, "dpo.sigmoid", {"beta": B})
    assert not torch.allclose(aot.sort().values, dpo.sort().values)


def test_exo_pair_defaults_to_epsilon_1e3_and_reads_zero_as_default(losses):
    component = losses.get("dpo.exo_pair")
    assert component.make_params().label_smoothing == 1e-3
    assert component.make_params(label_smoothing=0.0).label_smoothing == 1e-3


def test_discopop_is_finite_for_huge_negative_margins(losses):
    component = losses.get("dpo.discopop")
    huge = batch(chosen_logps=[-5000.0, -12.0, -3.5])
    loss = component.obj(huge, component.make_params(beta=B))
    assert torch.isfinite(loss).all() and loss[0] > 1000  # ≈ −log σ(z) = −z for z ≪ 0


# ---- registration flags -----------------------------------------------------------------------

MY_LOSSES = sorted(PER_PAIR) + ["dpo.aot", "dpo.aot_unpaired", "dpo.aot_pair"]


def test_flags(losses):
    assert {n for n in MY_LOSSES if losses.get(n).options.get("monotone") == "non_increasing_in_margin"} \
        == {"dpo.sigmoid", "dpo.hinge", "dpo.robust"}
    assert {n for n in MY_LOSSES if losses.get(n).options.get("batch_coupled")} \
        == {"dpo.aot", "dpo.aot_unpaired", "dpo.aot_pair"}
    assert all(losses.get(n).options["consumes"] is PreferenceLogps for n in MY_LOSSES)


def margin_sweep(losses, name, **params):
    """The loss of one pair as Δ sweeps −40..40 with every other input fixed (reverse KL)."""
    grid = torch.linspace(-40, 40, 1601, dtype=torch.float64)
    zeros = torch.zeros_like(grid)
    sweep = PreferenceLogps(grid, zeros, zeros, zeros, torch.full_like(grid, 5), torch.full_like(grid, 5))
    component = losses.get(name)
    return component.obj(sweep, component.make_params(**params))


@pytest.mark.parametrize("name, params", [("dpo.hinge", {}), ("dpo.robust", {}), ("dpo.robust", {"label_smoothing": 0.45}),
                                          ("dpo.sigmoid", {})])
def test_monotone_flag_is_true(losses, name, params):
    assert (margin_sweep(losses, name, beta=B, **params).diff() <= 1e-12).all()


@pytest.mark.parametrize("name", ["dpo.discopop", "dpo.exo_pair", "dpo.ipo", "dpo.sppo_hard", "dpo.nca_pair"])
def test_unflagged_losses_really_rise_somewhere(losses, name):
    assert (margin_sweep(losses, name, beta=B).diff() > 1e-9).any()


def test_every_module_has_an_entry_point():
    modules = {ep.value for ep in importlib.metadata.entry_points(group="plait")}
    for module in ["dpo_hinge", "dpo_ipo", "dpo_exo_pair", "dpo_nca_pair", "dpo_robust", "dpo_bco_pair",
                   "dpo_sppo_hard", "dpo_aot", "dpo_aot_unpaired", "dpo_apo_zero", "dpo_apo_down",
                   "dpo_discopop", "dpo_sft", "dpo_sigmoid_norm"]:
        assert f"plait.losses.{module}" in modules


# ---- composition ------------------------------------------------------------------------------


def test_composition_is_the_weighted_sum_of_named_parts(losses):
    specs = normalise_loss_specs(["sigmoid", "sft", {"name": "hinge", "beta": 0.5}], loss_weights=[1.0, 0.2, 0.5])
    objective = Objective.build(specs, losses, family="dpo", consumes=PreferenceLogps, shared={"beta": B})
    total, parts = objective(batch())

    sigmoid = sum(-logsig(B * (p["sc"] - p["sr"])) for p in pairs("reverse_kl")) / 3
    sft = sum(-p["lpc"] / p["lc"] for p in pairs("reverse_kl")) / 3
    hinge = sum(max(0.0, 1 - 0.5 * (p["sc"] - p["sr"])) for p in pairs("reverse_kl")) / 3  # own beta wins
    assert list(parts) == ["dpo.sigmoid", "dpo.sft", "dpo.hinge"]
    assert parts["dpo.sigmoid"].item() == pytest.approx(sigmoid)
    assert parts["dpo.sft"].item() == pytest.approx(sft)
    assert parts["dpo.hinge"].item() == pytest.approx(hinge)
    assert total.item() == pytest.approx(1.0 * sigmoid + 0.2 * sft + 0.5 * hinge)
    assert objective.params_of("dpo.sigmoid").beta == B


def test_loss_weights_must_match_the_losses():
    with pytest.raises(PlaitError, match="loss_weights has 1 values for 2 losses"):
        normalise_loss_specs(["sigmoid", "sft"], loss_weights=[1.0])


def test_unknown_full_name_suggests_the_variant(losses):
    with pytest.raises(UnknownComponentError, match="did you mean 'dpo.sigmoid'"):
        Objective.build(normalise_loss_specs(["dpo.sigmod"]), losses, family="dpo", consumes=PreferenceLogps)


def test_unknown_bare_variant_is_refused_with_a_suggestion(losses):
    with pytest.raises(UnknownComponentError, match="unknown loss 'sigmod' .*did you mean '(dpo\\.)?sigmoid'"):
        Objective.build(normalise_loss_specs(["sigmod"]), losses, family="dpo", consumes=PreferenceLogps)


def test_unknown_bare_variant_suggests_the_full_name(losses):
    with pytest.raises(UnknownComponentError, match="did you mean 'dpo.sigmoid'"):
        Objective.build(normalise_loss_specs(["sigmod"]), losses, family="dpo", consumes=PreferenceLogps)


# ---- parameter validation ---------------------------------------------------------------------

WITH_BETA = [n for n in MY_LOSSES if n != "dpo.sft"]


@pytest.mark.parametrize("name", WITH_BETA)
@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_beta_must_be_positive(losses, name, beta):
    with pytest.raises(PlaitError, match=rf"loss '{name}': beta={beta} must be a number > 0"):
        losses.get(name).make_params(beta=beta)


@pytest.mark.parametrize("name, value, valid", [
    ("dpo.sigmoid", 0.6, r"\[0.0, 0.5\]"), ("dpo.sigmoid", -0.1, r"\[0.0, 0.5\]"),
    ("dpo.robust", 0.5, r"\[0.0, 0.5\)"), ("dpo.robust", -0.1, r"\[0.0, 0.5\)"),
    ("dpo.exo_pair", -0.1, r"\(0.0, 0.5\]"), ("dpo.exo_pair", 0.7, r"\(0.0, 0.5\]"),
    ("dpo.aot", 0.6, r"\[0.0, 0.5\]"), ("dpo.aot_unpaired", 0.6, r"\[0.0, 0.5\]"),
])
def test_label_smoothing_range(losses, name, value, valid):
    with pytest.raises(PlaitError, match=rf"loss '{name}': label_smoothing={value} must be in {valid}"):
        losses.get(name).make_params(label_smoothing=value)


@pytest.mark.parametrize("tau", [0.0, -0.05])
def test_discopop_tau_must_be_positive(losses, tau):
    with pytest.raises(PlaitError, match=rf"loss 'dpo.discopop': discopop_tau={tau} must be a number > 0"):
        losses.get("dpo.discopop").make_params(discopop_tau=tau)


def test_label_smoothing_is_refused_where_the_formula_has_none(losses):
    with pytest.raises(PlaitError, match="loss 'dpo.hinge': unknown parameter 'label_smoothing'"):
        losses.get("dpo.hinge").make_params(label_smoothing=0.1)
    with pytest.raises(PlaitError, match="loss 'dpo.sft' takes no parameters"):
        losses.get("dpo.sft").make_params(beta=0.1)
