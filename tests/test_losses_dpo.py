"""Every DPO loss variant against the formula of the DPO table, computed plainly by hand.

Three pairs with hand-picked log-probs; each variant that uses s = f(r) is checked under every
f-divergence, and the ones that use raw log-ratios or log-probs must ignore the divergence.
The semantics are TRL 1.16's (docs/trl-differences.md lists where plait differs on purpose).
"""

import importlib.metadata
import math

import attrs
import pytest
import torch

import plait
from plait.engine.batches import PreferenceLogps
from plait.engine.divergences import f_divergence
from plait.engine.objective import Objective, normalise_loss_specs
from plait.errors import PlaitError
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
    return {"reverse_kl": r, "forward_kl": 1 - math.exp(-r), "js_divergence": math.log(2 / (1 + math.exp(-r))),
            "alpha_divergence": (math.exp((alpha - 1) * r) - 1) / (alpha - 1)}[divergence]


def sig(x):
    return 1 / (1 + math.exp(-x))


def logsig(x):
    return math.log(sig(x))


def pairs(divergence):
    for i in range(3):
        rc, rr = CHOSEN[i] - REF_CHOSEN[i], REJECTED[i] - REF_REJECTED[i]
        yield dict(rc=rc, rr=rr, sc=f(divergence, rc), sr=f(divergence, rr), lc=LEN_C[i], lr=LEN_R[i], lpc=CHOSEN[i])


SFT_BY_HAND = -sum(CHOSEN) / sum(LEN_C)  # the batch's chosen tokens, each weighing the same

# name -> (params, per-pair loss by hand)
PER_PAIR = {
    "dpo.sigmoid": ({"beta": B}, lambda p: -logsig(B * (p["sc"] - p["sr"]))),
    "dpo.cdpo": ({"beta": B, "label_smoothing": 0.1},
                 lambda p: -0.9 * logsig(B * (p["sc"] - p["sr"])) - 0.1 * logsig(-B * (p["sc"] - p["sr"]))),
    "dpo.hinge": ({"beta": B}, lambda p: max(0.0, 1 - B * (p["sc"] - p["sr"]))),
    "dpo.ipo": ({"beta": B}, lambda p: (p["sc"] / p["lc"] - p["sr"] / p["lr"] - 1 / (2 * B)) ** 2),
    "dpo.exo_pair": ({"beta": B, "label_smoothing": 0.05}, lambda p: (
        sig(B * (p["sc"] - p["sr"])) * (logsig(B * (p["sc"] - p["sr"])) - math.log(0.95))
        + sig(-B * (p["sc"] - p["sr"])) * (logsig(-B * (p["sc"] - p["sr"])) - math.log(0.05)))),
    # nca_pair, bco_pair, sppo_hard, apo_zero, apo_down read raw log-ratios r (no f-divergence applies to them)
    "dpo.nca_pair": ({"beta": B}, lambda p: -logsig(B * p["rc"]) - 0.5 * logsig(-B * p["rc"]) - 0.5 * logsig(-B * p["rr"])),
    "dpo.robust": ({"beta": B, "label_smoothing": 0.2}, lambda p: (
        -0.8 * logsig(B * (p["sc"] - p["sr"])) + 0.2 * logsig(-B * (p["sc"] - p["sr"]))) / 0.6),
    "dpo.bco_pair": ({"beta": B}, lambda p: -logsig(B * p["rc"]) - logsig(-B * p["rr"])),
    "dpo.sppo_hard": ({"beta": B}, lambda p: (p["rc"] - 1 / (2 * B)) ** 2 + (p["rr"] + 1 / (2 * B)) ** 2),
    "dpo.apo_zero": ({"beta": B}, lambda p: 1 - sig(B * p["rc"]) + sig(B * p["rr"])),
    "dpo.apo_down": ({"beta": B}, lambda p: sig(B * p["rc"]) + 1 - sig(B * (p["rc"] - p["rr"]))),
    "dpo.discopop": ({"beta": B, "discopop_tau": 0.05}, lambda p: (
        (1 - sig(B * (p["sc"] - p["sr"]) / 0.05)) * -logsig(B * (p["sc"] - p["sr"]))
        + sig(B * (p["sc"] - p["sr"]) / 0.05) * math.exp(-B * (p["sc"] - p["sr"])))),
    "dpo.sft": ({}, lambda p: SFT_BY_HAND),
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


def test_f_divergence_constants_reach_the_length_normalised_losses(losses):
    # TRL 1.16's shifted transforms: with JS, s = log 2 + log σ(r); the log 2 survives s_c/|y_c| − s_r/|y_r|
    rc, rr = CHOSEN[0] - REF_CHOSEN[0], REJECTED[0] - REF_REJECTED[0]
    normalised = (math.log(2) + logsig(rc)) / LEN_C[0] - (math.log(2) + logsig(rr)) / LEN_R[0]
    ipo = compute(losses, "dpo.ipo", {"beta": B}, "js_divergence")[0].item()
    assert ipo == pytest.approx((normalised - 1 / (2 * B)) ** 2)
    without_constant = logsig(rc) / LEN_C[0] - logsig(rr) / LEN_R[0]
    assert ipo != pytest.approx((without_constant - 1 / (2 * B)) ** 2)  # the constant changes the value


def test_sft_is_the_token_mean_over_the_batch_not_the_mean_of_sequence_means(losses):
    value = compute(losses, "dpo.sft", {})
    assert torch.equal(value, torch.full((3,), value[0].item(), dtype=torch.float64))
    assert value[0].item() == pytest.approx((5.0 + 12.0 + 3.5) / (4 + 10 + 3))
    assert value[0].item() != pytest.approx((5.0 / 4 + 12.0 / 10 + 3.5 / 3) / 3)


def test_sft_reads_the_unweighted_log_probs_when_the_method_weights_tokens(losses):
    # LD-DPO down-weights the tail in chosen_logps; the NLL anchor keeps the plain sum
    data = attrs.evolve(batch(), unweighted_chosen_logps=torch.tensor([-6.0, -14.0, -4.0], dtype=torch.float64))
    component = losses.get("dpo.sft")
    assert component.obj(data, None)[0].item() == pytest.approx(24.0 / 17)


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
    assert {n for n in MY_LOSSES if losses.get(n).options.monotone == "non_increasing_in_margin"} \
        == {"dpo.sigmoid", "dpo.hinge", "dpo.robust"}
    assert {n for n in MY_LOSSES if losses.get(n).options.batch_coupled} \
        == {"dpo.aot", "dpo.aot_unpaired", "dpo.aot_pair", "dpo.sft"}
    assert {n for n in MY_LOSSES if losses.get(n).options.sorts_batch} \
        == {"dpo.aot", "dpo.aot_unpaired", "dpo.aot_pair"}
    # TRL 1.16's list of losses a non-default f-divergence applies to (plus cdpo, a margin loss)
    assert {n for n in MY_LOSSES if losses.get(n).options.f_divergence} \
        == {"dpo.sigmoid", "dpo.cdpo", "dpo.sigmoid_norm", "dpo.hinge", "dpo.ipo", "dpo.exo_pair", "dpo.robust",
            "dpo.discopop", "dpo.sft"}
    assert all(losses.get(n).options.consumes is PreferenceLogps for n in MY_LOSSES)


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


def test_cdpo_rises_past_its_target_margin(losses):
    assert (margin_sweep(losses, "dpo.cdpo", beta=B, label_smoothing=0.1).diff() > 1e-9).any()


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
    sft = SFT_BY_HAND
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
    ("dpo.cdpo", 0.6, r"\[0.0, 0.5\]"), ("dpo.cdpo", -0.1, r"\[0.0, 0.5\]"),
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
    # TRL 1.16's sigmoid reads no label smoothing; conservative DPO is its own loss, dpo.cdpo
    with pytest.raises(PlaitError, match="loss 'dpo.sigmoid': unknown parameter 'label_smoothing'"):
        losses.get("dpo.sigmoid").make_params(label_smoothing=0.1)
    with pytest.raises(PlaitError, match="loss 'dpo.sft' takes no parameters"):
        losses.get("dpo.sft").make_params(beta=0.1)


# ---- what the DPO method checks against each loss's declaration ------------------------------

NOT_ON_THE_MARGIN = ["nca_pair", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down"]


def dpo_trainer(tmp_path, **config):
    """A DPOTrainer on a model folder that does not exist: validation must refuse before any load."""
    from plait.plugins.methods.dpo import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), report_to="none", **config)
    return DPOTrainer(str(tmp_path / "no-model-here"), args=args, train_dataset=[{"prompt": "a", "chosen": "b",
                                                                                  "rejected": "c"}])


@pytest.mark.parametrize("divergence", ["forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("loss_type", NOT_ON_THE_MARGIN)
def test_a_non_default_divergence_is_refused_where_it_does_not_apply(tmp_path, loss_type, divergence):
    with pytest.raises(PlaitError, match=rf"f_divergence_type='{divergence}' does not apply to \['dpo.{loss_type}'\]"):
        dpo_trainer(tmp_path, loss_type=["sigmoid", loss_type], f_divergence_type=divergence)


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired"])
def test_weighting_is_refused_for_losses_that_sort_the_batch(tmp_path, loss_type):
    with pytest.raises(PlaitError, match=rf"use_weighting=True .* \['dpo.{loss_type}'\] sort the batch"):
        dpo_trainer(tmp_path, loss_type=loss_type, use_weighting=True)


def test_label_smoothing_no_loss_reads_is_flagged(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="plait"), pytest.raises(PlaitError, match="no such folder"):
        dpo_trainer(tmp_path, loss_type="sigmoid", label_smoothing=0.1)  # accepted: it got as far as loading
    assert "label_smoothing=0.1 is read by none of ['dpo.sigmoid']" in caplog.text and "loss_type='cdpo'" in caplog.text


def test_label_smoothing_reaches_cdpo(losses):
    specs = normalise_loss_specs("cdpo")
    objective = Objective.build(specs, losses, family="dpo", consumes=PreferenceLogps,
                                shared={"beta": B, "label_smoothing": 0.2})
    assert objective.params_of("dpo.cdpo").label_smoothing == 0.2


class TokenStats:
    """What token_logprobs returns, reduced to the two fields WPO reads."""

    def __init__(self, logps, collision):
        self.logps, self.collision = torch.tensor(logps).log(), torch.tensor(collision).log()


def test_wpo_weights_are_not_capped_by_default_as_in_trl():
    from plait.plugins.methods.dpo import DPOTrainer

    # one pair of one token each: p(y) = 0.9 on a two-way distribution, Σ p² = 0.82, so each side weighs
    # 0.9 / 0.82 = 1.0976 and the pair 1.2047 > 1; the rejected side p = 0.5 of a uniform pair weighs 1
    out = TokenStats([[0.9], [0.5]], [[0.82], [0.5]])
    mask = torch.ones(2, 1)
    assert DPOTrainer._wpo_weights(out, mask, None).item() == pytest.approx(0.9 / 0.82)
    chosen_only = TokenStats([[0.9], [0.9]], [[0.82], [0.82]])
    assert DPOTrainer._wpo_weights(chosen_only, mask, None).item() == pytest.approx((0.9 / 0.82) ** 2)
    assert DPOTrainer._wpo_weights(chosen_only, mask, 1.0).item() == 1.0  # the WPO authors' cap
