"""Each GRPO loss type (and RLOO's clip) against values computed by hand on one fixed batch.

The batch (B = 2, T = 4) is written as token log-ratios so every ratio is a round number:

    row 0: A = +1, ρ = [1.5, 0.9, (5), (5)],  mask [1, 1, 0, 0]  (|y| = 2)
    row 1: A = −1, ρ = [0.5, 1.1, 3.0, (2)],  mask [1, 1, 1, 0]  (|y| = 3)

With ε = 0.2 the clipped surrogate −min(ρA, clip(ρ, 0.8, 1.2)A) is, per counted token,
row 0: [−1.2, −0.9] (sum −2.1); row 1: [0.8, 1.1, 3.0] (sum 4.9); 5 tokens, Σ = 2.8.
"""

import math

import pytest
import torch

from plait.engine.batches import PolicyTokens
from plait.errors import PlaitError
from plait.manager import make_plugins

LOGPS = [[-1.0, -2.0, -0.5, -0.5], [-0.3, -1.2, -0.7, -0.9]]
RATIOS = [[1.5, 0.9, 5.0, 5.0], [0.5, 1.1, 3.0, 2.0]]
MASK = [[1, 1, 0, 0], [1, 1, 1, 0]]


@pytest.fixture(scope="module")
def losses():
    return make_plugins().losses


def batch(**overrides) -> PolicyTokens:
    logps = torch.tensor(LOGPS, requires_grad=True)
    old = (logps - torch.tensor(RATIOS).log()).detach()
    values = dict(logps=logps, old_logps=old, advantages=torch.tensor([1.0, -1.0]), mask=torch.tensor(MASK).bool())
    return PolicyTokens(**{**values, **overrides})


def loss(losses, name, data=None, **params):
    component = losses.get(name)
    assert component.options.output == "scalar" and component.options.consumes is PolicyTokens
    return component.obj(data if data is not None else batch(), component.make_params(**params))


# -- normalisations (the clipped surrogate, per loss type) ---------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("grpo.grpo", (-2.1 / 2 + 4.9 / 3) / 2),  # mean over sequences of per-sequence means
        ("grpo.bnpo", 2.8 / 5),  # token mean of the micro-batch
        ("grpo.dr_grpo", 2.8 / (2 * 4)),  # B · max_completion_length (T when not given)
        ("grpo.dapo", 2.8 / 5),  # no generation-batch count given: this batch's tokens
    ],
)
def test_clipped_surrogate_normalisations(losses, name, expected):
    assert loss(losses, name).item() == pytest.approx(expected, rel=1e-5)


def test_gradient_accumulation_divides_the_per_micro_batch_normalisations(losses):
    data = batch(gradient_accumulation_steps=2, max_completion_length=10, num_items_in_batch=14)
    assert loss(losses, "grpo.grpo", data).item() == pytest.approx(0.2916667 / 2, rel=1e-5)
    assert loss(losses, "grpo.bnpo", data).item() == pytest.approx(2.8 / 5 / 2, rel=1e-5)
    assert loss(losses, "grpo.dr_grpo", data).item() == pytest.approx(2.8 / (2 * 10) / 2, rel=1e-5)
    # dapo's count already spans the whole generation batch: no further division
    assert loss(losses, "grpo.dapo", data).item() == pytest.approx(2.8 / 14, rel=1e-5)


def test_dapo_micro_batches_sum_to_the_whole_generation_batch(losses):
    whole = loss(losses, "grpo.dapo", batch(num_items_in_batch=5))
    full = batch()
    parts = [
        loss(losses, "grpo.dapo", PolicyTokens(full.logps[i:i + 1], full.old_logps[i:i + 1], full.advantages[i:i + 1],
                                               full.mask[i:i + 1], num_items_in_batch=5, gradient_accumulation_steps=2))
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)


def test_epsilon_high_and_delta(losses):
    # ε_high = 0.28: row 0's ρ = 1.5 clips at 1.28 instead of 1.2 -> Σ = −2.18 + 4.9
    assert loss(losses, "grpo.bnpo", epsilon_high=0.28).item() == pytest.approx((-2.18 + 4.9) / 5, rel=1e-5)
    # δ = 2 caps the unclipped branch: row 1's ρ = 3 (A < 0) contributes max(min(3, 2), 1.2) = 2
    assert loss(losses, "grpo.bnpo", delta=2.0).item() == pytest.approx((-2.1 + 3.9) / 5, rel=1e-5)


def test_on_policy_gradient_is_minus_advantage_over_the_token_count(losses):
    data = batch()
    data = PolicyTokens(data.logps, data.logps.detach(), data.advantages, data.mask, num_items_in_batch=10)
    loss(losses, "grpo.dapo", data).backward()
    expected = -torch.tensor([[1.0], [-1.0]]) * torch.tensor(MASK) / 10
    assert torch.allclose(data.logps.grad, expected)


def test_sequence_level_ratio_is_gspo(losses):
    # GSPO: ρ_i = exp(mean_t log ρ_it): row 0 √1.35 = 1.16190, row 1 1.65^(1/3) = 1.18167; both inside [0.8, 1.2]
    r0, r1 = math.sqrt(1.35), 1.65 ** (1 / 3)
    expected = (-r0 * 2 + r1 * 3) / 5
    assert loss(losses, "grpo.bnpo", importance_sampling_level="sequence").item() == pytest.approx(expected, rel=1e-5)


def test_luspo_weights_each_sequence_by_its_length(losses):
    r0, r1 = math.sqrt(1.35), 1.65 ** (1 / 3)
    # token-level ratio by default, as in TRL 1.16: loss = mean_i(Σ_t L_it)
    assert loss(losses, "grpo.luspo").item() == pytest.approx((-2.1 + 4.9) / 2, rel=1e-5)
    # the paper's sequence-level ratio: mean_i(L_i · |y_i|)
    sequence = {"importance_sampling_level": "sequence"}
    assert loss(losses, "grpo.luspo", **sequence).item() == pytest.approx((-r0 * 2 + r1 * 3) / 2, rel=1e-5)
    data = batch(gradient_accumulation_steps=4)
    assert loss(losses, "grpo.luspo", data, **sequence).item() == pytest.approx((-r0 * 2 + r1 * 3) / 2 / 4, rel=1e-5)


def test_luspo_at_token_level_says_the_paper_uses_sequence(losses, caplog):
    with caplog.at_level("WARNING", logger="plait"):
        losses.get("grpo.luspo").make_params(importance_sampling_level="sequence")
    assert caplog.text == ""
    with caplog.at_level("WARNING", logger="plait"):
        losses.get("grpo.luspo").make_params()
    assert "importance_sampling_level='token'" in caplog.text and "paper uses 'sequence'" in caplog.text


# -- the other per-token terms ------------------------------------------------------------------


def test_cispo_truncated_detached_weight_times_log_prob(losses):
    # −min(ρ, 2)·A·log π: row 0: 1.5·1.0 + 0.9·2.0 = 3.3; row 1: 0.5·(−0.3) + 1.1·(−1.2) + 2·(−0.7) = −2.87
    data = batch(num_items_in_batch=7)
    value = loss(losses, "grpo.cispo", data, epsilon_high=2.0)
    assert value.item() == pytest.approx((3.3 - 2.87) / 7, rel=1e-5)
    value.backward()  # the weight is detached: d/dlogπ = −w·A/N
    expected = torch.tensor([[-1.5, -0.9, 0, 0], [0.5, 1.1, 2.0, 0]]) / 7
    assert torch.allclose(data.logps.grad, expected)


def test_sapo_soft_gate_with_sign_dependent_temperature(losses):
    # −σ(τ(ρ−1))·4/τ·A; τ = 1 for A > 0, 1.05 for A < 0; normalised per sequence like grpo
    row0 = [-4 / (1 + math.exp(-0.5)), -4 / (1 + math.exp(0.1))]
    row1 = [4 / 1.05 / (1 + math.exp(-1.05 * (r - 1))) for r in (0.5, 1.1, 3.0)]
    expected = (sum(row0) / 2 + sum(row1) / 3) / 2  # = 0.038274
    assert loss(losses, "grpo.sapo").item() == pytest.approx(expected, rel=1e-5)
    assert expected == pytest.approx(0.0382741, rel=1e-5)


def test_vespo_gamma_kernel_of_the_sequence_ratio(losses):
    # w = Π ρ: 1.35 and 1.65. φ = exp(λ + k log w − λ w): A ≥ 0 (k, λ) = (2, 3) -> 0.637762; A < 0 (3, 2) -> 1.224247
    phi0, phi1 = 0.6377615, 1.2242469
    data = batch(num_items_in_batch=7)
    value = loss(losses, "grpo.vespo", data)
    assert value.item() == pytest.approx((phi0 * 3.0 - phi1 * 2.2) / 7, rel=1e-5)
    value.backward()
    assert torch.allclose(data.logps.grad, torch.tensor([[-phi0, -phi0, 0, 0], [phi1, phi1, phi1, 0]]) / 7, atol=1e-6)


def test_vespo_kernel_is_one_on_policy(losses):
    data = batch()
    data = PolicyTokens(data.logps, data.logps.detach(), data.advantages, data.mask, num_items_in_batch=5)
    # φ(1) = 1: plain REINFORCE, −A·Σ log π / N = −(1·(−3.0) − 1·(−2.2)) / 5
    assert loss(losses, "grpo.vespo", data).item() == pytest.approx(-(-3.0 + 2.2) / 5, rel=1e-5)


# ref − logπ = +0.5 and −0.5 on row 0's two tokens: k3 = e^r − r − 1 = 0.148721 and 0.106531
SHIFT = torch.tensor([[0.5, -0.5, 0, 0], [0, 0, 0, 0]])
K3 = (math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5)


def test_beta_adds_k3_kl_weighted_by_the_importance_ratio(losses):
    data = batch(ref_logps=torch.tensor(LOGPS) + SHIFT)
    # TRL 1.16's default use_bias_correction_kl: each token's k3 times its ratio ρ (1.5 and 0.9 on row 0)
    expected = (2.8 + 0.1 * (1.5 * K3[0] + 0.9 * K3[1])) / 5
    assert loss(losses, "grpo.bnpo", data, beta=0.1).item() == pytest.approx(expected, rel=1e-5)
    plain = (2.8 + 0.1 * (K3[0] + K3[1])) / 5
    assert loss(losses, "grpo.bnpo", data, beta=0.1, use_bias_correction_kl=False).item() == pytest.approx(plain, rel=1e-5)
    assert loss(losses, "grpo.bnpo", data, beta=0.0).item() == pytest.approx(2.8 / 5, rel=1e-5)


def test_bias_corrected_kl_at_sequence_level_uses_the_sequence_ratio(losses):
    data = batch(ref_logps=torch.tensor(LOGPS) + SHIFT, advantages=torch.zeros(2))  # A = 0: only the KL term
    value = loss(losses, "grpo.bnpo", data, beta=0.1, importance_sampling_level="sequence")
    assert value.item() == pytest.approx(0.1 * math.sqrt(1.35) * (K3[0] + K3[1]) / 5, rel=1e-5)


@pytest.mark.parametrize("corrected", [True, False])
def test_bias_correction_changes_the_on_policy_kl_gradient(losses, corrected):
    # on-policy ρ = 1, so the value is the same, but d(ρ·k3)/d log π = log π − log π_ref (the reverse-KL
    # gradient), where plain k3 gives 1 − exp(log π_ref − log π)
    data = batch(ref_logps=torch.tensor(LOGPS) + SHIFT, advantages=torch.zeros(2))
    data = PolicyTokens(data.logps, data.logps.detach(), data.advantages, data.mask, ref_logps=data.ref_logps,
                        num_items_in_batch=5)
    value = loss(losses, "grpo.dapo", data, beta=0.1, use_bias_correction_kl=corrected)
    assert value.item() == pytest.approx(0.1 * (K3[0] + K3[1]) / 5, rel=1e-5)
    value.backward()
    r = SHIFT * torch.tensor(MASK)
    expected = 0.1 * (-r if corrected else 1 - torch.exp(r)) * torch.tensor(MASK) / 5
    assert torch.allclose(data.logps.grad, expected, atol=1e-7)


def test_beta_without_reference_log_probs_is_an_error(losses):
    with pytest.raises(PlaitError, match="reference"):
        loss(losses, "grpo.dapo", beta=0.04)


def test_importance_weights_scale_the_policy_term(losses):
    weights = torch.ones(2, 4)
    weights[1, 0] = 2.0  # row 1's first token: 0.8 -> 1.6
    assert loss(losses, "grpo.bnpo", batch(importance_weights=weights)).item() == pytest.approx(3.6 / 5, rel=1e-5)


def test_token_advantages_broadcast_like_sequence_advantages(losses):
    per_token = torch.tensor([[1.0] * 4, [-1.0] * 4])
    assert loss(losses, "grpo.bnpo", batch(advantages=per_token)).item() == pytest.approx(2.8 / 5, rel=1e-5)


def test_rloo_clip_is_sequence_level_on_the_product_ratio(losses):
    # ρ = Π ρ_t: 1.35 (A = 1) -> −min(1.35, 1.2) = −1.2; 1.65 (A = −1) -> max(1.65, 1.2) = 1.65
    assert loss(losses, "rloo.clip").item() == pytest.approx((-1.2 + 1.65) / 2, rel=1e-5)
    assert loss(losses, "rloo.clip", batch(gradient_accumulation_steps=2)).item() == pytest.approx(0.225 / 2, rel=1e-5)
    assert loss(losses, "rloo.clip", epsilon=0.5).item() == pytest.approx((-1.35 + 1.65) / 2, rel=1e-5)


@pytest.mark.parametrize("name", ["grpo.grpo", "grpo.bnpo", "grpo.dr_grpo", "grpo.dapo", "grpo.cispo", "grpo.sapo",
                                  "grpo.luspo", "grpo.vespo", "rloo.clip"])
def test_bad_parameters_name_the_loss_and_field(losses, name):
    with pytest.raises(PlaitError, match=rf"{name}.*epsilon=-0.1"):
        losses.get(name).make_params(epsilon=-0.1)


def test_unknown_importance_sampling_level(losses):
    with pytest.raises(PlaitError, match="importance_sampling_level='seq'.*token, sequence"):
        losses.get("grpo.dapo").make_params(importance_sampling_level="seq")
