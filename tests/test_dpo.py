"""DPO end to end on the tiny model: learning happens, the reference is right, bad input is refused."""

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from plait import PlaitError, hookimpl, make_plugins
from plait.engine.batches import PreferenceLogps
from plait.engine.logprobs import token_logprobs
from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
from plait.testing.tiny_model import tiny_model_path

WORDS = ["apple", "river", "stone", "cloud", "music", "garden", "window", "paper", "market", "forest",
         "bridge", "candle", "mirror", "island", "letter", "engine", "silver", "winter", "summer", "planet",
         "doctor", "pencil", "basket", "rocket", "castle", "butter", "camera", "flower", "jacket", "ladder"]


def preference_pairs(words):
    return Dataset.from_list([
        {"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.", "rejected": f" The {w} is bad."}
        for w in words
    ])


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=30, learning_rate=1e-3,
                  beta=0.1, logging_steps=5, save_strategy="no", report_to="none", seed=0, max_length=64)
    return DPOConfig(**{**values, **overrides})


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_learns_held_out_preferences(tmp_path, lora):
    peft = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear") if lora else None
    trainer = DPOTrainer(
        str(tiny_model_path()), args=config(tmp_path, learning_rate=5e-3 if lora else 1e-3),
        train_dataset=preference_pairs(WORDS[:24]), eval_dataset=preference_pairs(WORDS[24:]), peft_config=peft,
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_rewards/accuracies"] > 0.9
    assert after["eval_rewards/margins"] > before["eval_rewards/margins"] + 0.1
    if lora:  # the reference is the policy with adapters off: no second copy of the weights
        assert trainer.reference.model is None and trainer.reference.adapters_off


def test_reference_is_a_frozen_copy_without_peft(tmp_path):
    trainer = DPOTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=preference_pairs(WORDS[:8]))
    ref, policy = trainer.reference.model, trainer.model
    assert ref is not policy and not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), policy.parameters()))


def test_peft_reference_holds_no_second_copy(tmp_path):
    peft = LoraConfig(r=4, target_modules="all-linear")
    trainer = DPOTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=preference_pairs(WORDS[:8]),
                         peft_config=peft)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    base_params = sum(p.numel() for p in base.parameters())
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    assert trainer.reference.model is None
    assert total == base_params + trainable  # the policy is base + adapters; nothing else is held


def test_loss_composition_logs_each_part(tmp_path):
    args = config(tmp_path, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], max_steps=2, logging_steps=1)
    trainer = DPOTrainer(str(tiny_model_path()), args=args, train_dataset=preference_pairs(WORDS[:8]))
    trainer.train()
    logged = trainer.state.log_history[0]
    assert {"loss/dpo.sigmoid", "loss/dpo.sft", "rewards/accuracies", "logits/chosen"} <= set(logged)
    assert logged["loss"] == pytest.approx(logged["loss/dpo.sigmoid"] + 0.5 * logged["loss/dpo.sft"], rel=1e-4)


class ThirdPartyLosses:
    """DPO losses of another package: one declares no metrics, one adds a metric of its own."""

    @hookimpl
    def register_losses(self, register):
        register("dpo.plain", lambda batch, p: -F.logsigmoid(0.1 * batch.margin), consumes=PreferenceLogps)
        register("dpo.counted", lambda batch, p: batch.margin * 0.0, consumes=PreferenceLogps,
                 metrics=lambda batch, p: {"counted/pairs": batch.margin.new_full(batch.margin.shape, 1.0).sum(),
                                           "rewards/chosen": batch.chosen_logps * 0.0})


def test_a_third_party_loss_logs_the_dpo_metrics_without_declaring_them(tmp_path):
    """A loss with sigmoid's formula but no metrics= logs exactly what dpo.sigmoid logs; a loss's own
    metrics add names (counted/pairs) and win over the family's (rewards/chosen)."""
    logged = {}
    for loss in ("sigmoid", "plain", ["plain", "counted"]):
        args = config(tmp_path / str(loss), loss_type=loss, max_steps=2, logging_steps=1)
        trainer = DPOTrainer(str(tiny_model_path()), args=args, train_dataset=preference_pairs(WORDS[:16]),
                             plugins=make_plugins(plugins=[ThirdPartyLosses()]))
        trainer.train()
        logged[str(loss)] = trainer.state.log_history[1]
    names = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected", "logits/chosen", "logits/rejected"}
    assert {k: v for k, v in logged["plain"].items() if k in names} == \
        {k: v for k, v in logged["sigmoid"].items() if k in names} and len(names & set(logged["plain"])) == 8
    assert logged["plain"]["rewards/margins"] != 0.0  # the policy moved after a step: the values say something
    composed = logged[str(["plain", "counted"])]
    assert composed["counted/pairs"] == 8.0 and composed["rewards/chosen"] == 0.0
    assert composed["rewards/rejected"] == logged["plain"]["rewards/rejected"]
    assert {"loss/dpo.plain", "loss/dpo.counted"} <= set(composed)


@pytest.mark.parametrize("overrides, phrase", [
    ({"beta": 0.0}, "beta=0.0 must be a number > 0"),
    ({"label_smoothing": 0.7}, "label_smoothing=0.7 must be in [0.0, 0.5]"),
    ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "loss_weights has 1 values for 2 losses"),
    ({"precompute_ref_log_probs": True, "sync_ref_model": True}, "precompute_ref_log_probs=True cannot be combined"),
    ({"f_divergence_type": "reverse_kll"}, "did you mean 'reverse_kl'"),
])
def test_bad_config_refused_at_construction(tmp_path, overrides, phrase):
    with pytest.raises(PlaitError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        config(tmp_path, **overrides)


def test_unknown_loss_refused_before_the_model_loads(tmp_path):
    with pytest.raises(PlaitError, match="did you mean 'dpo.sigmoid'"):
        DPOTrainer("/nonexistent/model", args=config(tmp_path, loss_type="sigmod"), train_dataset=preference_pairs(WORDS))


def test_reference_with_another_vocabulary_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=77, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(PlaitError, match="ref_model has vocab_size 77"):
        DPOTrainer(str(tiny_model_path()), ref_model=other, args=config(tmp_path), train_dataset=preference_pairs(WORDS))


def test_precomputed_reference_logps_match_and_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    data = preference_pairs(WORDS[:6])
    live = DPOTrainer(str(tiny_model_path()), args=config(tmp_path / "a"), train_dataset=data)
    cached = DPOTrainer(str(tiny_model_path()), args=config(tmp_path / "b", precompute_ref_log_probs=True),
                        train_dataset=data)
    assert cached.reference.model is None  # freed after precomputing
    assert len(list((tmp_path / "cache" / "ref_logps").iterdir())) == 1
    batch = live.data_collator([live.train_dataset[i] for i in range(6)])
    ref = live.reference(live.model, lambda m: live.completion_logps(m, batch)[0])
    stored = torch.tensor(list(cached.train_dataset["ref_chosen_logps"]) + list(cached.train_dataset["ref_rejected_logps"]))
    torch.testing.assert_close(ref, stored, atol=1e-5, rtol=1e-5)


def test_wpo_weights_follow_the_formula(tmp_path):
    trainer = DPOTrainer(str(tiny_model_path()), args=config(tmp_path, use_weighting=True, padding_free=False),  # padded rows, read one by one
                         train_dataset=preference_pairs(WORDS[:4]))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        out = token_logprobs(trainer.model, batch["input_ids"], batch["attention_mask"], with_collision=True, chunked=False)
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    probs = logits.softmax(-1)
    collision = torch.cat([torch.zeros(8, 1), (probs ** 2).sum(-1).log()[:, :-1]], dim=1)
    torch.testing.assert_close(out.collision, collision, atol=1e-5, rtol=1e-5)
    mask = batch["completion_mask"].float()
    per_row = ((out.logps - collision) * mask).sum(-1) / mask.sum(-1)
    expected = torch.exp(per_row[:4] + per_row[4:])  # uncapped, as in TRL 1.16
    torch.testing.assert_close(DPOTrainer._wpo_weights(out, batch["completion_mask"], None), expected)
    torch.testing.assert_close(DPOTrainer._wpo_weights(out, batch["completion_mask"], 1.0), expected.clamp(max=1.0))
    assert (expected > 0).all()


def test_ld_alpha_weights_the_tail_beyond_the_shorter_completion(tmp_path):
    trainer = DPOTrainer(str(tiny_model_path()), args=config(tmp_path, ld_alpha=0.25), train_dataset=preference_pairs(WORDS[:2]))
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]])  # chosen has 4 completion tokens, rejected 2
    weights = trainer._token_weights(torch.cat([mask[:1], mask[1:]]))
    assert weights.tolist() == [[0, 1, 1, 0.25, 0.25, 0], [0, 0, 1, 1, 0, 0]]


# TR-DPO's sync (sync_ref_model) is tested with KTO, GRPO and RLOO in test_reference_sync.py.

LONG_PAIRS = Dataset.from_list([
    {"prompt": "The sky is", "chosen": " very blue today.", "rejected": " red"},  # 5 + 9 / 5 + 3 tokens
    {"prompt": "Sky:", "chosen": " blue", "rejected": " red"},  # 4 + 4 / 4 + 3
    {"prompt": "one two three four", "chosen": " a", "rejected": " red"},  # 10 + 2 / 10 + 3
])


def test_truncation_keeps_the_start_by_default_as_trl(tmp_path):
    """Token lists from the tiny tokenizer (EOS = 4); TRL 1.16 collates the same ids for these pairs."""
    trainer = DPOTrainer(str(tiny_model_path()), args=config(tmp_path, max_length=8), train_dataset=LONG_PAIRS)
    assert trainer.args.truncation_mode == "keep_start"
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    assert [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows] == [
        ([927, 262, 79, 93, 857], [225, 345, 93], [322, 72, 4]),
        ([55, 79, 93, 30], [272, 80, 309, 4], [322, 72, 4]),
    ]  # a prompt that fills max_length leaves no completion: dropped, as TRL does


def test_keep_end_cuts_one_shared_prompt(tmp_path):
    """plait's keep_end: the prompt's start goes, both sides keep the same prompt (TRL 1.16 cuts each
    sequence on its own, so a pair's two sides may see different prompts, or none)."""
    trainer = DPOTrainer(str(tiny_model_path()), args=config(tmp_path, max_length=8, truncation_mode="keep_end"),
                         train_dataset=LONG_PAIRS)
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    assert [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows] == [
        ([55, 79, 93, 30], [272, 80, 309, 4], [322, 72, 4]),
        ([285, 86, 304, 276, 329], [311, 4], [322, 72, 4]),
    ]  # the first pair's chosen side alone fills max_length: no prompt fits, dropped
