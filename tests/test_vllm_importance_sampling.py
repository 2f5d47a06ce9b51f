"""The sampler/trainer importance-sampling correction (plait.online.importance_sampling): hand-computed
weights and metrics for every mode, and properties. Needs no vLLM."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.online.importance_sampling import METRICS, MODES, importance_sampling_metrics, importance_weights

# Two completions: 3 real tokens, then 2 real tokens and one padding position.
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.2, -9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# log-ratios: row 0: 0.5, -1.0, 0.0 (sum -0.5); row 1: 1.0, 0.2, padding -> 0 (sum 1.2)
E = math.exp


@pytest.mark.parametrize("mode, expected", [
    ("token_truncate", [[E(0.5), E(-1.0), 1.0], [2.0, E(0.2), 1.0]]),
    ("token_mask", [[E(0.5), E(-1.0), 1.0], [0.0, E(0.2), 1.0]]),
    ("sequence_truncate", [[E(-0.5)] * 3, [2.0] * 3]),
    ("sequence_mask", [[E(-0.5)] * 3, [0.0] * 3]),
])
def test_weights_by_hand(mode, expected):
    weights = importance_weights(TRAINER, SAMPLER, MASK, mode, cap=2.0)
    assert torch.allclose(weights, torch.tensor(expected), atol=1e-6)


def test_a_loose_cap_leaves_the_plain_ratio():
    assert torch.allclose(importance_weights(TRAINER, SAMPLER, MASK, "sequence_mask", cap=4.0)[1], torch.full((3,), E(1.2)))
    assert torch.allclose(importance_weights(TRAINER, SAMPLER, MASK, "token_mask", cap=3.0)[1, 0], torch.tensor(E(1.0)))


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'seq_mask' is not one of sequence_mask"):
        importance_weights(TRAINER, SAMPLER, MASK, "seq_mask", cap=3.0)


def test_metrics_by_hand():
    token = importance_sampling_metrics(TRAINER, SAMPLER, MASK, "token_truncate", cap=2.0)
    assert token["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 1.0 + 0.2) / 5)
    assert token["sampling/sampling_logp_difference/max"] == pytest.approx(1.0)
    assert token["sampling/importance_sampling_ratio/min"] == pytest.approx(E(-1.0))
    assert token["sampling/importance_sampling_ratio/mean"] == pytest.approx((E(0.5) + E(-1) + 1 + 2 + E(0.2)) / 5)
    assert token["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0)
    assert token["sampling/importance_sampling_ratio/bounded_fraction"] == pytest.approx(1 / 5)

    sequence = importance_sampling_metrics(TRAINER, SAMPLER, MASK, "sequence_mask", cap=2.0)
    assert sequence["sampling/importance_sampling_ratio/min"] == 0.0
    assert sequence["sampling/importance_sampling_ratio/mean"] == pytest.approx(3 * E(-0.5) / 5)
    assert sequence["sampling/importance_sampling_ratio/max"] == pytest.approx(E(-0.5))
    assert sequence["sampling/importance_sampling_ratio/bounded_fraction"] == pytest.approx(2 / 5)


def test_metrics_without_a_real_token_are_nan_under_the_same_names():
    metrics = importance_sampling_metrics(TRAINER, SAMPLER, torch.zeros_like(MASK), "token_mask", cap=3.0)
    assert tuple(metrics) == METRICS and all(math.isnan(v) for v in metrics.values())


logps = st.lists(st.floats(-20.0, 0.0), min_size=4, max_size=4)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(logps, logps, st.lists(st.booleans(), min_size=4, max_size=4)), min_size=1, max_size=3),
       st.sampled_from(MODES), st.floats(1.0, 5.0))
def test_weights_are_bounded_and_one_where_sampler_and_trainer_agree(rows, mode, cap):
    trainer = torch.tensor([r[0] for r in rows])
    sampler = torch.tensor([r[1] for r in rows])
    mask = torch.tensor([r[2] for r in rows]).long()
    weights = importance_weights(trainer, sampler, mask, mode, cap)
    assert weights.shape == trainer.shape
    assert bool((weights >= 0).all() and (weights <= cap + 1e-6).all())
    assert torch.allclose(importance_weights(trainer, trainer, mask, mode, cap), torch.ones_like(trainer))
    if mode.startswith("sequence"):  # one weight per completion
        assert torch.equal(weights, weights[:, :1].expand_as(weights))
