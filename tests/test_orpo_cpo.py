"""ORPO and CPO (SimPO, AlphaPO): each loss against its formula by hand, the kit's contracts, the
configs' rules, and learning on the tiny model with no reference model loaded."""

import math

import pytest
import torch
from datasets import Dataset

import plait
from plait import PlaitError
from plait.engine.batches import PreferenceLogps
from plait.plugins.methods.cpo import CPOConfig, CPOTrainer
from plait.plugins.methods.orpo import ORPOConfig, ORPOTrainer
from plait.testing.contracts import check_loss
from plait.testing.tiny_model import tiny_model_path

CHOSEN, REJECTED = [-5.0, -12.0, -3.5], [-7.0, -10.0, -9.0]
LEN_C, LEN_R = [4, 10, 3], [5, 8, 7]
# per token: ā_c = [-1.25, -1.2, -1.1667], ā_r = [-1.4, -1.25, -1.2857]


@pytest.fixture(scope="module")
def losses():
    return plait.make_plugins().losses


def batch(**extra):
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    zeros = t([0.0] * 3)
    return PreferenceLogps(t(CHOSEN), t(REJECTED), zeros, zeros, t(LEN_C), t(LEN_R), **extra)


def loss(losses, name, **params):
    component = losses.get(name)
    return component.obj(batch(), component.make_params(**params) if component.params else None).tolist()


def logsig(x):
    return -math.log1p(math.exp(-x))


def shaped(x, alpha):
    return x if alpha == 0 else (1 - math.exp(-alpha * x)) / alpha


def pairs(averaged=False):
    for c, r, lc, lr in zip(CHOSEN, REJECTED, LEN_C, LEN_R):
        yield (c / lc, r / lr) if averaged else (c, r)


@pytest.mark.parametrize("alpha", [0.0, 0.05])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cpo_sigmoid(losses, alpha, smoothing):
    expected = []
    for c, r in pairs():
        z = 0.3 * (shaped(c, alpha) - shaped(r, alpha))
        expected.append(-(1 - smoothing) * logsig(z) - smoothing * logsig(-z))
    assert loss(losses, "cpo.sigmoid", beta=0.3, label_smoothing=smoothing, alpha=alpha) == pytest.approx(expected)


def test_cpo_hinge(losses):
    # β(c − r) = 0.3·[2, −2, 5.5]: 1 − 0.6, 1 + 0.6, max(0, 1 − 1.65)
    assert loss(losses, "cpo.hinge", beta=0.3) == pytest.approx([0.4, 1.6, 0.0])
    expected = [max(0.0, 1 - 0.3 * (shaped(c, -0.1) - shaped(r, -0.1))) for c, r in pairs()]
    assert loss(losses, "cpo.hinge", beta=0.3, alpha=-0.1) == pytest.approx(expected)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_cpo_ipo_on_per_token_log_probs(losses, alpha):
    expected = [(shaped(c, alpha) - shaped(r, alpha) - 1 / (2 * 0.3)) ** 2 for c, r in pairs(averaged=True)]
    assert loss(losses, "cpo.ipo", beta=0.3, alpha=alpha) == pytest.approx(expected)
    if alpha == 0:  # pair 0: (−1.25 + 1.4 − 5/3)² = (−1.51667)²
        assert expected[0] == pytest.approx(2.300278, rel=1e-6)


def test_cpo_simpo(losses):
    expected = []
    for c, r in pairs(averaged=True):
        z = 2.0 * (c - r) - 0.5
        expected.append(-0.8 * logsig(z) - 0.2 * logsig(-z))
    assert loss(losses, "cpo.simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.2) == pytest.approx(expected)
    # pair 0: z = 2·0.15 − 0.5 = −0.2, −log σ(−0.2) = 0.798139 at ε = 0
    assert loss(losses, "cpo.simpo", beta=2.0, simpo_gamma=0.5)[0] == pytest.approx(0.798139, rel=1e-6)


def test_cpo_alphapo_is_simpo_on_the_alpha_reward(losses):
    expected = [-logsig(2.5 * (shaped(c, 0.25) - shaped(r, 0.25)) - 0.8) for c, r in pairs(averaged=True)]
    assert loss(losses, "cpo.alphapo", beta=2.5, simpo_gamma=0.8, alpha=0.25) == pytest.approx(expected)
    assert loss(losses, "cpo.alphapo", beta=2.5, simpo_gamma=0.8) == pytest.approx(
        loss(losses, "cpo.simpo", beta=2.5, simpo_gamma=0.8))


def test_orpo_odds_ratio(losses):
    def log_odds(a):
        return a - math.log(1 - math.exp(a))

    expected = [-0.1 * logsig(log_odds(c) - log_odds(r)) for c, r in pairs(averaged=True)]
    assert loss(losses, "orpo.odds_ratio") == pytest.approx(expected)
    # a completion of probability 1 (ā = 0) has infinite odds: finite loss, the gradient stays finite
    certain = batch().chosen_logps.new_tensor([0.0, -12.0, -3.5]).requires_grad_(True)
    component = losses.get("orpo.odds_ratio")
    value = component.obj(attrs_evolve(batch(), chosen_logps=certain), component.make_params())
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(certain.grad).all()


def attrs_evolve(obj, **changes):
    import attrs

    return attrs.evolve(obj, **changes)


def test_orpo_nll_counts_the_whole_chosen_sequence_when_given(losses):
    component = losses.get("orpo.nll")
    whole = batch(chosen_sequence_logps=torch.tensor([-9.0, -20.0, -6.0], dtype=torch.float64),
                  chosen_sequence_lengths=torch.tensor([8.0, 15.0, 6.0], dtype=torch.float64))
    assert component.obj(whole, None).tolist() == pytest.approx([35 / 29] * 3)
    assert component.obj(batch(), None).tolist() == pytest.approx([20.5 / 17] * 3)  # completion only


@pytest.mark.parametrize("name, params", [
    ("cpo.sigmoid", {"alpha": 0.3, "label_smoothing": 0.1}), ("cpo.hinge", {"alpha": -0.2}),
    ("cpo.ipo", {"alpha": 0.5}), ("cpo.alphapo", {"alpha": 0.25, "beta": 2.0}),
])
def test_alpha_shaped_losses_keep_their_contract(losses, name, params):
    """The kit checks every built-in at its defaults (test_contracts); alpha ≠ 0 adds an exponential."""
    assert "finite output (float16 inputs)" in check_loss(losses.get(name), params=params, max_examples=15)


def test_dpo_losses_compose_as_their_reference_free_forms(losses):
    """With zero reference log-probs dpo.sigmoid is CPO's sigmoid without label smoothing."""
    assert loss(losses, "dpo.sigmoid", beta=0.3) == pytest.approx(loss(losses, "cpo.sigmoid", beta=0.3))


# -- configs and trainers -------------------------------------------------------------------------

WORDS = ["apple", "river", "stone", "cloud", "music", "garden", "window", "paper", "market", "forest",
         "bridge", "candle", "mirror", "island", "letter", "engine", "silver", "winter", "summer", "planet"]


def preference_pairs(words):
    return Dataset.from_list([
        {"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.", "rejected": f" The {w} is bad."}
        for w in words])


def args(config_class, tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=12, learning_rate=3e-3,
                  logging_steps=4, save_strategy="no", report_to="none", seed=0, max_length=64)
    return config_class(**{**values, **overrides})


def terms(trainer):
    return [(t.name, t.weight) for t in trainer.objective.terms]


@pytest.mark.parametrize("config, expected", [
    ({}, [("cpo.sigmoid", 1.0), ("dpo.sft", 1.0)]),
    ({"loss_type": "simpo"}, [("cpo.simpo", 1.0), ("dpo.sft", 1.0)]),
    ({"loss_type": "alphapo"}, [("cpo.alphapo", 1.0)]),  # TRL: alphapo trains with cpo_alpha = 0
    ({"loss_type": "alphapo", "cpo_alpha": 0.5}, [("cpo.alphapo", 1.0), ("dpo.sft", 0.5)]),
    ({"loss_type": "ipo", "cpo_alpha": 0.0}, [("cpo.ipo", 1.0)]),
    ({"loss_type": ["hinge", "dpo.sigmoid"], "loss_weights": [1.0, 0.5], "cpo_alpha": 0.2},
     [("cpo.hinge", 1.0), ("dpo.sigmoid", 0.5), ("dpo.sft", 0.2)]),
])
def test_cpo_objective(tmp_path, config, expected):
    trainer = CPOTrainer(str(tiny_model_path()), args=args(CPOConfig, tmp_path, **config),
                         train_dataset=preference_pairs(WORDS[:4]))
    assert terms(trainer) == expected
    assert not hasattr(trainer, "reference")  # no reference model is loaded


def test_orpo_objective_and_its_whole_sequence_nll(tmp_path):
    # padded rows, for the NLL by hand (test_padding_free_preference.py: the other layouts give the same)
    trainer = ORPOTrainer(str(tiny_model_path()), args=args(ORPOConfig, tmp_path, beta=0.3, padding_free=False),
                          train_dataset=preference_pairs(WORDS[:4]))
    assert terms(trainer) == [("orpo.nll", 1.0), ("orpo.odds_ratio", 1.0)]
    assert trainer.objective.params_of("orpo.odds_ratio").beta == 0.3
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        trainer.compute_loss(trainer.model, inputs)
        logits = trainer.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    # TRL 1.16's (and ORPO's authors') NLL: every attended token of the chosen rows after the first
    logps = logits[:, :-1].log_softmax(-1).gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1)
    attended = inputs["attention_mask"][:4, 1:].bool()
    logged = trainer._metrics[trainer._mode]
    assert logged["nll_loss"][0] == pytest.approx(-logps[:4][attended].mean().item(), rel=1e-5)
    assert set(logged) >= {"rewards/chosen", "rewards/rejected", "rewards/margins",
                                              "rewards/accuracies", "logps/chosen", "logps/rejected",
                                              "logits/chosen", "logits/rejected", "log_odds_ratio", "log_odds_chosen"}


@pytest.mark.parametrize("config_class, field, value, words", [
    (CPOConfig, "loss_type", "simpoo", "did you mean 'cpo.simpo'"),
    (CPOConfig, "alpha", 0.2, "loss_type='alphapo'"),  # with the default loss sigmoid that is fine; simpo:
    (CPOConfig, "is_encoder_decoder", True, "causal language models"),
    (ORPOConfig, "padding_value", 7, "padding_value=7"),
    (ORPOConfig, "generate_during_eval", True, "LogCompletionsCallback"),
    (CPOConfig, "label_smoothing", 0.7, "label_smoothing=0.7"),
])
def test_bad_settings_are_refused_before_the_model_loads(tmp_path, config_class, field, value, words):
    extra = {"loss_type": "simpo"} if field == "alpha" else {}
    trainer_class = CPOTrainer if config_class is CPOConfig else ORPOTrainer
    with pytest.raises(PlaitError, match=words):
        trainer_class("no/such/model", args=args(config_class, tmp_path, **{field: value}, **extra))


@pytest.mark.parametrize("trainer_class, config_class, config", [
    (ORPOTrainer, ORPOConfig, {"beta": 0.5}),
    pytest.param(CPOTrainer, CPOConfig, {}, marks=pytest.mark.slow),  # the suite's budget: two fast cases
    (CPOTrainer, CPOConfig, {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0}),
], ids=["orpo", "cpo", "simpo"])
def test_the_margin_grows_on_the_tiny_model(tmp_path, trainer_class, config_class, config):
    """Six steps of 4 pairs: held-out pairs go from no margin (accuracy 0) to every pair ranked right."""
    trainer = trainer_class(str(tiny_model_path()), train_dataset=preference_pairs(WORDS[:16]),
                            args=args(config_class, tmp_path, max_steps=6, per_device_train_batch_size=4, **config),
                            eval_dataset=preference_pairs(WORDS[16:]))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_rewards/margins"] > before["eval_rewards/margins"] + 0.1, (before, after)
    assert after["eval_rewards/accuracies"] == 1.0
    if trainer_class is ORPOTrainer:
        assert after["eval_log_odds_chosen"] > before["eval_log_odds_chosen"] + 0.3


def test_cpo_with_a_dpo_loss_logs_summed_log_prob_rewards(tmp_path):
    """A composed loss that declares no metrics (dpo.hinge) gets TRL's sigmoid-type rewards: β·log π summed."""
    trainer = CPOTrainer(str(tiny_model_path()), args=args(CPOConfig, tmp_path, loss_type="dpo.hinge", beta=0.2),
                         train_dataset=preference_pairs(WORDS[:4]))
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        trainer.compute_loss(trainer.model, inputs)
        batch, _ = trainer.preference_logps(trainer.model, inputs)
    logged = trainer._metrics[trainer._mode]
    assert logged["rewards/chosen"][0] == pytest.approx(0.2 * batch.chosen_logps.mean().item(), rel=1e-5)
    assert logged["nll_loss"][0] == pytest.approx(logged["loss/dpo.sft"][0], rel=1e-6)
