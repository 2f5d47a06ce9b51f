"""The f-divergence transforms of f-DPO against the table's formulas, by hand, and their fp16/bf16 safety.

The transforms are TRL 1.16's: f'(u) at u = e^r, shifted so that s(0) = 0 (forward KL 1 − e^{−r},
JS log 2 + log σ(r), α: (e^{(α−1)r} − 1)/(α−1)).
"""

import math

import pytest
import torch

from plait.engine.batches import PreferenceLogps
from plait.engine.divergences import DIVERGENCES, f_divergence
from plait.errors import PlaitError

R = [-2.0, -0.5, 0.0, 0.7, 3.0]


def by_hand(name, r, alpha=0.5):
    return {
        "reverse_kl": lambda: r,
        "forward_kl": lambda: 1 - math.exp(-r),
        "js_divergence": lambda: math.log(2) + math.log(1 / (1 + math.exp(-r))),
        "alpha_divergence": lambda: (math.exp((alpha - 1) * r) - 1) / (alpha - 1),
    }[name]()


# The generators f of each divergence (Wang et al. 2024, Table 1); s must be f'(e^r) − f'(1).
GENERATORS = {
    "reverse_kl": lambda u: u * math.log(u),
    "forward_kl": lambda u: -math.log(u),
    "js_divergence": lambda u: u * math.log(u) - (u + 1) * math.log((u + 1) / 2),
    # the paper's (u^{1−a} − (1−a)·u − a)/(a(a−1)) with a = 1 − α (TRL's and plait's α), at α = a = 0.5
    "alpha_divergence": lambda u: (u ** 0.5 - 0.5 * u - 0.5) / (0.5 * (0.5 - 1)),
}


def test_the_table_holds_exactly_the_four_transforms():
    assert set(DIVERGENCES) == {"reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"}


@pytest.mark.parametrize("name", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
def test_transform_matches_formula(name):
    s = f_divergence(name)(torch.tensor(R, dtype=torch.float64))
    torch.testing.assert_close(s, torch.tensor([by_hand(name, r) for r in R], dtype=torch.float64))


@pytest.mark.parametrize("alpha", [0.3, 0.5, 2.0, -1.0])
def test_alpha_divergence_uses_its_coefficient(alpha):
    s = f_divergence("alpha_divergence", alpha=alpha)(torch.tensor(R, dtype=torch.float64))
    torch.testing.assert_close(s, torch.tensor([by_hand("alpha_divergence", r, alpha) for r in R], dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_transform_is_the_shifted_derivative_of_the_generator(name):
    def derivative(u, h=1e-6):
        return (GENERATORS[name](u + h) - GENERATORS[name](u - h)) / (2 * h)

    s = f_divergence(name)(torch.tensor(R, dtype=torch.float64))
    expected = [derivative(math.exp(r)) - derivative(1.0) for r in R]
    torch.testing.assert_close(s, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_a_policy_equal_to_its_reference_scores_zero(name):
    assert f_divergence(name)(torch.zeros(3, dtype=torch.float64)).abs().max().item() < 1e-15


@pytest.mark.parametrize("alpha", [1.0, 1.0 + 1e-9])
def test_alpha_near_one_falls_back_to_reverse_kl(alpha):
    r = torch.tensor(R)
    assert torch.equal(f_divergence("alpha_divergence", alpha=alpha)(r), r)


def test_forward_kl_is_alpha_zero():
    r = torch.tensor(R, dtype=torch.float64)
    torch.testing.assert_close(f_divergence("forward_kl")(r), f_divergence("alpha_divergence", alpha=0.0)(r))


def test_unknown_name_suggests_the_closest():
    with pytest.raises(PlaitError, match=r"f_divergence_type='revers_kl'.*did you mean 'reverse_kl'"):
        f_divergence("revers_kl")
    with pytest.raises(PlaitError, match="use one of alpha_divergence, forward_kl, js_divergence, reverse_kl"):
        f_divergence("wasserstein")


def test_non_finite_alpha_is_refused():
    with pytest.raises(PlaitError, match="f_alpha_divergence_coef=nan"):
        f_divergence("alpha_divergence", alpha=float("nan"))


def test_transform_fills_the_batch_scores():
    batch = PreferenceLogps(
        chosen_logps=torch.tensor([-3.0]), rejected_logps=torch.tensor([-5.0]),
        ref_chosen_logps=torch.tensor([-4.0]), ref_rejected_logps=torch.tensor([-4.5]),
        chosen_lengths=torch.tensor([3]), rejected_lengths=torch.tensor([4]),
        divergence=f_divergence("forward_kl"),
    )  # r_c = 1, r_r = -0.5
    assert batch.chosen_scores.item() == pytest.approx(1 - math.exp(-1.0))
    assert batch.margin.item() == pytest.approx(-math.exp(-1.0) + math.exp(0.5))


LARGE = [-6e4, -1e3, -60.0, -12.0, 0.0, 12.0, 60.0, 1e3, 6e4]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [0.5, 0.0, 0.9, 2.0, -1.0])
def test_alpha_divergence_stays_finite_in_half_precision(dtype, alpha):
    r = torch.tensor(LARGE, dtype=dtype, requires_grad=True)
    s = f_divergence("alpha_divergence", alpha=alpha)(r)
    assert s.dtype == dtype and torch.isfinite(s).all()
    assert torch.isfinite(s[:, None] - s[None, :]).all()  # every pairwise margin, too
    torch.nn.functional.logsigmoid(0.1 * (s[:, None] - s[None, :])).sum().backward()
    assert torch.isfinite(r.grad).all()


def test_without_the_clamp_fp16_would_overflow():
    # guards the test above against being vacuous: the raw formula does overflow at these inputs
    r = torch.tensor(LARGE, dtype=torch.float16)
    assert not torch.isfinite(torch.exp(-0.5 * r) / -0.5).all()


def test_clamp_does_not_touch_ordinary_values_in_fp16():
    r = torch.tensor(R, dtype=torch.float16)
    expected = torch.tensor([by_hand("alpha_divergence", x) for x in R], dtype=torch.float32)
    torch.testing.assert_close(f_divergence("alpha_divergence")(r).float(), expected, rtol=2e-3, atol=2e-3)
