"""Reward models on the tiny model: Bradley-Terry learns held-out pairs, the folder is a usable reward."""

import json

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from plait import PlaitError, default_plugins
from plait.online.scoring import compute_rewards, resolve_reward_funcs
from plait.plugins.methods.reward_model import RewardConfig, RewardTrainer
from plait.testing.tiny_model import tiny_model_path

WORDS = ["apple", "river", "stone", "cloud", "music", "garden", "window", "paper", "market", "forest",
         "bridge", "candle", "mirror", "island", "letter", "engine", "silver", "winter", "summer", "planet",
         "doctor", "pencil", "basket", "rocket", "castle", "butter", "camera", "flower", "jacket", "ladder"]
GOOD, BAD = ["good", "great", "kind", "bright"], ["bad", "awful", "rude", "dull"]


def pairs(words, offset=0):
    """Separable pairs: a positive adjective is chosen over a negative one, in two sentence shapes."""
    rows = []
    for i, w in enumerate(words, start=offset):
        good, bad = GOOD[i % 4], BAD[(i // 4) % 4]
        shape = " The {w} is {a}." if i % 2 else " It is a {a} {w}."
        rows.append({"prompt": f"Tell me about the {w}.", "chosen": shape.format(w=w, a=good),
                     "rejected": shape.format(w=w, a=bad)})
    return Dataset.from_list(rows)


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=20, learning_rate=1e-3,
                  logging_steps=5, save_strategy="no", report_to="none", seed=0, max_length=64)
    return RewardConfig(**{**values, **overrides})


def single_reward(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One reward model trained on 20 words' pairs, evaluated before and after on 10 unseen words."""
    out = tmp_path_factory.mktemp("rm")
    trainer = RewardTrainer(str(tiny_model_path()), args=config(out), train_dataset=pairs(WORDS[:20]),
                            eval_dataset=pairs(WORDS[20:], offset=20))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    trainer.save_model()
    return trainer, before, after, out


@pytest.mark.slow
def test_reward_model_learns_held_out_pairs(trained):
    trainer, before, after, _ = trained
    assert after["eval_accuracy"] > 0.9
    assert after["eval_margin"] > before["eval_margin"] + 1.0
    logged = [e["margin"] for e in trainer.state.log_history if "margin" in e]
    assert logged[-1] > logged[0] + 1.0
    assert {"accuracy", "margin", "rewards/chosen", "rewards/rejected"} <= set(trainer.state.log_history[0])


@pytest.mark.slow
def test_output_folder_reloads_as_a_sequence_classifier(trained):
    trainer, _, _, out = trained
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert model.config.pad_token_id == trainer.processing_class.pad_token_id
    for name, param in trainer.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], param)
    assert json.loads((out / "plait_run.json").read_text())["method"] == "reward_model"


@pytest.mark.slow
def test_trained_folder_is_usable_as_a_reward(trained):
    _, _, _, out = trained
    (reward,) = resolve_reward_funcs([str(out)], default_plugins())
    held_out = pairs(WORDS[20:], offset=20)
    prompts = list(held_out["prompt"]) * 2
    completions = list(held_out["chosen"]) + list(held_out["rejected"])
    scores = compute_rewards([reward], prompts=prompts, completions=completions, completion_ids=[[1]] * len(prompts))
    chosen, rejected = scores[:, 0].chunk(2)
    assert (chosen > rejected).float().mean() > 0.9


@pytest.mark.parametrize("padding_free, prefix_sharing", [(False, None), (None, False), (None, None)],
                         ids=["padded", "padding-free", "default: padding-free, prompts shared"])
def test_loss_is_bradley_terry_with_margin_and_centring_on_the_last_real_token(tmp_path, padding_free, prefix_sharing):
    data = pairs(WORDS[:3]).add_column("margin", [0.5, -1.0, 2.0])
    data = data.map(lambda row, i: {"chosen": row["chosen"] + " Truly." * i}, with_indices=True)  # ragged lengths
    trainer = RewardTrainer(str(tiny_model_path()), train_dataset=data,
                            args=config(tmp_path, center_rewards_coefficient=0.01, padding_free=padding_free,
                                        prefix_sharing=prefix_sharing))
    rows = [trainer.train_dataset[i] for i in range(3)]
    batch = trainer.data_collator(rows)
    assert batch["margin"].tolist() == [0.5, -1.0, 2.0]
    if padding_free is False:
        assert (batch["input_ids"] == trainer.processing_class.pad_token_id).any()  # some rows are padded
    else:  # the tiny Llama's attention runs per sequence: the 6 sequences back to back, no pad token
        shared = 0 if prefix_sharing is False else sum(len(r["prompt_ids"]) - 1 for r in rows)  # each prompt once, but its last token
        assert trainer.padding_free and trainer.prefix_sharing is (prefix_sharing is None)
        assert batch["input_ids"].shape == (1, batch["seq_lengths"].sum() - shared)
    # each row scores what the row alone scores: the head reads its last real token
    chosen = torch.tensor([single_reward(trainer.model, r["prompt_ids"] + r["chosen_ids"]) for r in rows])
    rejected = torch.tensor([single_reward(trainer.model, r["prompt_ids"] + r["rejected_ids"]) for r in rows])
    margin = torch.tensor([0.5, -1.0, 2.0])
    expected = (-F.logsigmoid(chosen - rejected - margin) + 0.01 * (chosen + rejected) ** 2).mean()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    assert trainer.objective.params_of("reward_model.bradley_terry").center_rewards_coefficient == 0.01


def test_a_causal_lm_path_gets_a_scalar_head_and_the_tokenizers_pad_id(tmp_path):
    trainer = RewardTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=pairs(WORDS[:4]))
    model = trainer.model
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert model.config.pad_token_id == trainer.processing_class.pad_token_id
    backbone = AutoModelForCausalLM.from_pretrained(tiny_model_path()).model.state_dict()
    for name, param in model.model.state_dict().items():
        torch.testing.assert_close(param, backbone[name])  # the backbone is the checkpoint's


def test_lora_keeps_the_score_head_trainable(tmp_path):
    peft = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])  # no task_type, as users often write it
    trainer = RewardTrainer(str(tiny_model_path()), args=config(tmp_path, max_steps=2, learning_rate=1e-2),
                            train_dataset=pairs(WORDS[:8]), peft_config=peft)
    assert peft.task_type is None and peft.modules_to_save is None  # the caller's config is untouched
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable) and all("lora_" in n or "score" in n for n in trainable)
    head = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "score" in n and p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "embed_tokens" in n}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert any(not torch.equal(params[n], value) for n, value in head.items())
    assert all(torch.equal(params[n], value) for n, value in frozen.items())


def test_bad_models_and_data_are_refused(tmp_path):
    causal = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    with pytest.raises(PlaitError, match="model is a LlamaForCausalLM; a reward model is a …ForSequenceClassification"):
        RewardTrainer(causal, args=config(tmp_path), train_dataset=pairs(WORDS[:4]))
    with pytest.raises(PlaitError, match=r"model has num_labels=2, but reward models require `num_labels=1`"):
        RewardTrainer(str(tiny_model_path()), args=config(tmp_path, model_init_kwargs={"num_labels": 2}),
                      train_dataset=pairs(WORDS[:4]))
    unpaired = Dataset.from_list([{"prompt": "Hi", "completion": " there", "label": True}])
    with pytest.raises(PlaitError, match="task 'preference'"):
        RewardTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=unpaired)


def test_pairs_longer_than_max_length_are_dropped_as_trl_or_truncated_when_asked(tmp_path, caplog):
    """Token lists from the tiny tokenizer (EOS = 4), the ones TRL 1.16 keeps for these pairs."""
    data = Dataset.from_list([
        {"prompt": "The sky is", "chosen": " very blue today.", "rejected": " red"},  # 5 + 9 = 14 tokens: dropped
        {"prompt": "Sky:", "chosen": " blue", "rejected": " red"},  # 8 and 7: kept
        {"prompt": "one two three four", "chosen": " a", "rejected": " red"},  # 12 and 13: dropped
    ])
    with caplog.at_level("WARNING", logger="plait"):
        kept = RewardTrainer(str(tiny_model_path()), args=config(tmp_path, max_length=8), train_dataset=data)
    assert [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in kept.train_dataset] == [
        ([55, 79, 93, 30], [272, 80, 309, 4], [322, 72, 4])]
    assert "dropped 2 of 3 train pairs longer than max_length=8" in caplog.text
    truncated = RewardTrainer(str(tiny_model_path()), args=config(tmp_path, max_length=8, truncation_mode="keep_start"),
                              train_dataset=data)
    assert truncated.train_dataset[0]["chosen_ids"] == [225, 345, 93]  # 5 prompt tokens + 3
    with pytest.raises(PlaitError, match="every one of the 3 train pairs is longer than max_length=4"):
        RewardTrainer(str(tiny_model_path()), args=config(tmp_path, max_length=4), train_dataset=data)


@pytest.mark.parametrize("overrides, phrase", [
    ({"center_rewards_coefficient": -0.1}, r"center_rewards_coefficient=-0.1 must be a number >= 0"),
    ({"max_length": 0}, r"max_length=0 must be a number > 0"),
    ({"loss_type": "bradly_terry"}, r"did you mean 'reward_model.bradley_terry'"),
])
def test_bad_config_refused_before_the_model_loads(tmp_path, overrides, phrase):
    with pytest.raises(PlaitError, match=phrase):
        RewardTrainer("/nonexistent/model", args=config(tmp_path, **overrides), train_dataset=pairs(WORDS[:4]))
