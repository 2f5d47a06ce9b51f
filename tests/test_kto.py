"""KTO end to end on the tiny model: learning happens, z is the mismatched-pair estimate, bad input is refused."""

import logging

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from plait import PlaitError
from plait.plugins.methods.kto import KTOConfig, KTOTrainer, check_class_balance
from plait.testing.tiny_model import tiny_model_path

WORDS = ["apple", "river", "stone", "cloud", "music", "garden", "window", "paper", "market", "forest",
         "bridge", "candle", "mirror", "island", "letter", "engine", "silver", "winter", "summer", "planet",
         "doctor", "pencil", "basket", "rocket", "castle", "butter", "camera", "flower", "jacket", "ladder"]


def example(word, desirable):
    return {"prompt": f"Tell me about the {word}.", "completion": f" The {word} is {'good' if desirable else 'bad'}.",
            "label": desirable}


def unpaired(words):
    """Truly unpaired: each prompt has one completion, alternately desirable and undesirable."""
    return Dataset.from_list([example(w, i % 2 == 0) for i, w in enumerate(words)])


def both(words):
    return Dataset.from_list([example(w, d) for w in words for d in (True, False)])


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=10, learning_rate=3e-3,
                  beta=0.1, logging_steps=5, save_strategy="no", report_to="none", seed=0, max_length=64)
    return KTOConfig(**{**values, **overrides})


def rewards(trainer, dataset):
    """β·(log π − log π_ref) of each row of ``dataset``, in order."""
    batch = trainer.data_collator([dataset[i] for i in range(len(dataset))])
    with torch.no_grad():
        logps = trainer.completion_logps(trainer.model, batch)
        ref = trainer.reference(trainer.model, lambda m: trainer.completion_logps(m, batch))
    return trainer.args.beta * (logps - ref)


def sequence_logp(model, prompt_ids, completion_ids):
    """Σ log p(completion | prompt) from one unpadded forward with full logits."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    start = len(prompt_ids)
    return sum(logp[t - 1, ids[0, t]] for t in range(start, ids.shape[1])).item()


@pytest.mark.slow
def test_kto_learns_held_out_desirability(tmp_path):
    trainer = KTOTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=unpaired(WORDS[:24]),
                         eval_dataset=both(WORDS[24:]))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_rewards/chosen"] > after["eval_rewards/rejected"]
    assert after["eval_rewards/margins"] > before["eval_rewards/margins"] + 0.3
    logged = [e["rewards/margins"] for e in trainer.state.log_history if "rewards/margins" in e]
    assert logged[-1] > logged[0] + 0.3
    held_out = rewards(trainer, trainer.eval_dataset).reshape(-1, 2)  # rows: (desirable, undesirable) per word
    assert bool((held_out[:, 0] > held_out[:, 1]).all()), held_out


def test_paired_data_is_split_into_desirable_and_undesirable(tmp_path):
    pairs = Dataset.from_list([{"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.",
                                "rejected": f" The {w} is bad."} for w in WORDS[:8]])
    trainer = KTOTrainer(str(tiny_model_path()), args=config(tmp_path, max_steps=2, logging_steps=1), train_dataset=pairs)
    data, tok = trainer.train_dataset, trainer.processing_class
    assert len(data) == 16 and data["label"] == [True, False] * 8
    assert tok.decode(data[0]["completion_ids"]) == " The apple is good." + tok.eos_token
    assert tok.decode(data[1]["completion_ids"]) == " The apple is bad." + tok.eos_token
    trainer.train()
    logged = trainer.state.log_history[0]
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"} <= set(logged)


def _perturbed_tiny_model(seed=0):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def test_kl_estimate_is_the_mean_log_ratio_of_mismatched_pairs(tmp_path):
    data = unpaired(WORDS[:4])
    perturbed, original = _perturbed_tiny_model(), AutoModelForCausalLM.from_pretrained(tiny_model_path())
    estimates = []
    for policy, reference in [(perturbed, str(tiny_model_path())), (original, _perturbed_tiny_model())]:
        trainer = KTOTrainer(policy, ref_model=reference, args=config(tmp_path), train_dataset=data)
        rows = [trainer.train_dataset[i] for i in range(4)]
        batch = trainer.data_collator(rows)
        ref_model = trainer.reference.model
        # row i's pair: prompt i with the completion of row i-1
        direct = torch.tensor([
            sequence_logp(trainer.model, rows[i]["prompt_ids"], rows[i - 1]["completion_ids"])
            - sequence_logp(ref_model, rows[i]["prompt_ids"], rows[i - 1]["completion_ids"]) for i in range(4)])
        torch.testing.assert_close(trainer.kl_logratios(trainer.model, batch), direct, atol=1e-4, rtol=1e-4)
        z = trainer.kl_estimate(trainer.model, batch)
        assert z.dim() == 0 and not z.requires_grad
        assert z.item() == pytest.approx(max(direct.mean().item(), 0.0), abs=1e-4)
        estimates.append(direct.mean().item())

        # the step's loss is the KTO formula over these very numbers
        logps = torch.tensor([sequence_logp(trainer.model, r["prompt_ids"], r["completion_ids"]) for r in rows])
        ref = torch.tensor([sequence_logp(ref_model, r["prompt_ids"], r["completion_ids"]) for r in rows])
        gain = 0.1 * (logps - ref - z)
        expected = torch.where(batch["label"], 1 - gain.sigmoid(), 1 - (-gain).sigmoid()).mean()
        with torch.no_grad():
            assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(expected.item(), abs=1e-5)
    # swapping policy and reference negates the raw estimate: one side is clamped at 0
    assert estimates[0] == pytest.approx(-estimates[1], abs=1e-4) and abs(estimates[0]) > 1e-3


def test_precomputed_reference_matches_the_live_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    data = unpaired(WORDS[:6])
    live = KTOTrainer(str(tiny_model_path()), args=config(tmp_path / "a"), train_dataset=data)
    cached = KTOTrainer(str(tiny_model_path()), args=config(tmp_path / "b", precompute_ref_log_probs=True),
                        train_dataset=data)
    assert cached.reference.model is None  # freed after precomputing
    assert len(list((tmp_path / "cache" / "ref_logps").iterdir())) == 1
    rows = [cached.train_dataset[i] for i in range(6)]
    assert [r["kl_completion_ids"] for r in rows] == [rows[i - 1]["completion_ids"] for i in range(6)]
    batch = cached.data_collator(rows[2:5])  # any batch keeps each row's fixed partner
    assert batch["kl_input_ids"][0].tolist()[: len(rows[2]["prompt_ids"]) + len(rows[1]["completion_ids"])] == \
        rows[2]["prompt_ids"] + rows[1]["completion_ids"]
    expected_kl = torch.tensor([sequence_logp(live.reference.model, r["prompt_ids"], r["kl_completion_ids"]) for r in rows])
    expected = torch.tensor([sequence_logp(live.reference.model, r["prompt_ids"], r["completion_ids"]) for r in rows])
    torch.testing.assert_close(torch.tensor(list(cached.train_dataset["ref_logps"])), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(list(cached.train_dataset["ref_kl_logps"])), expected_kl, atol=1e-4, rtol=1e-4)
    # at the start the policy is the reference: every log-ratio, hence z, is 0
    assert cached.kl_estimate(cached.model, batch).item() == pytest.approx(0.0, abs=1e-4)


def test_loss_composition_shares_the_weights_and_logs_each_part(tmp_path):
    args = config(tmp_path, loss_type=["kto", "apo_zero_unpaired"], loss_weights=[1.0, 0.5], desirable_weight=1.2,
                  max_steps=2, logging_steps=1)
    trainer = KTOTrainer(str(tiny_model_path()), args=args, train_dataset=unpaired(WORDS[:8]))
    for name in ("kto.kto", "kto.apo_zero_unpaired"):
        params = trainer.objective.params_of(name)
        assert (params.beta, params.desirable_weight, params.undesirable_weight) == (0.1, 1.2, 1.0)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["loss"] == pytest.approx(logged["loss/kto.kto"] + 0.5 * logged["loss/kto.apo_zero_unpaired"], rel=1e-4)


def test_peft_reference_is_the_policy_with_adapters_off(tmp_path):
    trainer = KTOTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=unpaired(WORDS[:8]),
                         peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert trainer.reference.model is None and trainer.reference.adapters_off
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert trainer.kl_estimate(trainer.model, batch).item() == pytest.approx(0.0, abs=1e-5)  # LoRA B starts at 0


def test_class_balance_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="plait"):
        assert check_class_balance([True] * 10 + [False] * 10, 1.0, 1.0) == 1.0
        assert check_class_balance([True] * 4 + [False] * 3, 1.0, 1.0) == pytest.approx(4 / 3)
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="plait"):
        assert check_class_balance([True] * 2 + [False] * 8, 1.0, 1.0) == pytest.approx(0.25)
    assert "outside [1, 4/3]" in caplog.text and "desirable_weight in [4.00, 5.33]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plait"):
        assert check_class_balance([True] * 2 + [False] * 8, 4.0, 1.0) == pytest.approx(1.0)  # re-weighted: fine
    assert not caplog.records


def test_non_boolean_labels_are_refused(tmp_path):
    data = Dataset.from_list([{**example(w, True), "label": 1} for w in WORDS[:4]])
    with pytest.raises(PlaitError, match="labels must be booleans"):
        KTOTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=data)


@pytest.mark.parametrize("overrides, phrase", [
    ({"beta": 0.0}, "beta=0.0 must be a number > 0"),
    ({"beta": -0.1}, "beta=-0.1 must be a number > 0"),
    ({"desirable_weight": 0.0}, "desirable_weight=0.0 must be a number > 0"),
    ({"undesirable_weight": -1.0}, "undesirable_weight=-1.0 must be a number > 0"),
    ({"loss": ["kto"], "loss_type": "kto"}, "give either loss"),
    ({"loss_type": ["kto", "apo_zero_unpaired"], "loss_weights": [1.0]}, "loss_weights has 1 values for 2 losses"),
])
def test_bad_config_refused_at_construction(tmp_path, overrides, phrase):
    with pytest.raises(PlaitError, match=phrase.replace("[", r"\[")):
        config(tmp_path, **overrides)


@pytest.mark.parametrize("loss, phrase", [
    ("kot", "did you mean 'kto.kto'"),
    ("dpo.sigmoid", "consumes PreferenceLogps but this method provides UnpairedLogps"),
])
def test_wrong_loss_refused_before_the_model_loads(tmp_path, loss, phrase):
    with pytest.raises(PlaitError, match=phrase):
        KTOTrainer("/nonexistent/model", args=config(tmp_path, loss_type=loss), train_dataset=unpaired(WORDS))
