"""PRM: labels at the step separators of a hand-built row (truncation and last-step-only included),
the collator, bad rows, the loss at labelled positions only, learning (step accuracy rises above
chance), and a trained PRM folder scoring a GRPO batch as a reward (min, last, mean)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoTokenizer

import plait
from plait import PlaitError, make_plugins
from plait.online.scoring import compute_rewards, resolve_reward_funcs
from plait.plugins.methods.prm import PRMConfig, PRMParams, PRMTrainer, tokenize_row
from plait.plugins.reward_sources.process_reward_models import process_reward_model
from plait.testing.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
ROWS = [json.loads(line) for line in (ROOT / "examples" / "data" / "demo_prm.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=2, learning_rate=1e-2,
                  logging_steps=5, save_strategy="no", report_to="none", seed=0)
    return PRMConfig(**{**values, **overrides})


# ---------------------------------------------------------------------------------------------
# Rows as tokens: labels at the separators, by hand
# ---------------------------------------------------------------------------------------------

ROW = {"prompt": "Is it so?", "completions": ["Fire is hot.", "Ice is loud."], "labels": [True, False]}


def test_labels_sit_on_the_last_separator_token_of_each_step(tokenizer):
    prompt, one, two, sep = ids(tokenizer, "Is it so?"), ids(tokenizer, "Fire is hot."), ids(tokenizer, "Ice is loud."), ids(tokenizer, "\n")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    row = tokenize_row(ROW, tokenizer, PRMParams(), train=True)
    assert row["input_ids"] == bos + prompt + one + sep + two + sep
    first = len(bos + prompt + one + sep) - 1
    second = len(row["input_ids"]) - 1
    assert [(i, x) for i, x in enumerate(row["labels"]) if x != -100] == [(first, 1), (second, 0)]


def test_a_multi_token_separator_labels_its_last_token(tokenizer):
    sep = ids(tokenizer, " ки\n\n")
    assert len(sep) > 1
    row = tokenize_row(ROW, tokenizer, PRMParams(step_separator=" ки\n\n"), train=True)
    assert row["input_ids"][-len(sep):] == sep
    labelled = [i for i, x in enumerate(row["labels"]) if x != -100]
    assert labelled[-1] == len(row["input_ids"]) - 1 and row["labels"][labelled[0] - len(sep) + 1:labelled[0] + 1] == [-100] * (len(sep) - 1) + [1]


def test_last_step_only_applies_to_training_and_truncation_drops_cut_steps(tokenizer):
    p = PRMParams(train_on_last_step_only=True)
    train, evaluation = tokenize_row(ROW, tokenizer, p, train=True), tokenize_row(ROW, tokenizer, p, train=False)
    assert [x for x in train["labels"] if x != -100] == [0]
    assert [x for x in evaluation["labels"] if x != -100] == [1, 0]
    # the prompt keeps its end, the steps their start: cut in the second step, only the first is labelled
    prompt_cut = tokenize_row(ROW, tokenizer, PRMParams(max_prompt_length=2), train=True)
    assert prompt_cut["input_ids"][:2] == ids(tokenizer, "Is it so?")[-2:]
    first_step = len(ids(tokenizer, "Fire is hot.") + ids(tokenizer, "\n"))
    cut = tokenize_row(ROW, tokenizer, PRMParams(max_completion_length=first_step + 1), train=True)
    assert [x for x in cut["labels"] if x != -100] == [1]
    short = tokenize_row(ROW, tokenizer, PRMParams(max_length=3), train=True)
    assert len(short["input_ids"]) == 3 and set(short["labels"]) == {-100}


def test_the_collator_pads_labels_with_minus_100(tokenizer):
    collate = make_plugins().collators.get("collator.token_classification").obj(tokenizer)
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, -100, 1]}, {"input_ids": [8], "labels": [0]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, tokenizer.pad_token_id, tokenizer.pad_token_id]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 1], [0, -100, -100]]


@pytest.mark.parametrize("row, match", [
    ({"prompt": "p", "completions": ["a"]}, "no 'labels' column"),
    ({"prompt": "p", "completions": ["a", "b"], "labels": [True]}, "one bool per step"),
    ({"prompt": "p", "completions": [], "labels": []}, "non-empty list of step strings"),
    ({"prompt": "p", "completions": ["a"], "labels": [1]}, "one bool per step"),
])
def test_bad_rows_are_named(tmp_path, row, match):
    with pytest.raises(PlaitError, match=match):
        PRMTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=Dataset.from_list([row]))


def test_bad_fields_are_refused(tmp_path):
    with pytest.raises(PlaitError, match="step_separator=''"):
        config(tmp_path, step_separator="")
    with pytest.raises(PlaitError, match="max_prompt_length=0"):
        config(tmp_path, max_prompt_length=0)


def test_defaults_are_trls_and_the_model_is_a_two_label_token_classifier(tmp_path):
    args = PRMConfig(output_dir=str(tmp_path))
    assert (args.learning_rate, args.max_length, args.max_prompt_length, args.max_completion_length,
            args.step_separator, args.train_on_last_step_only, args.disable_dropout) == (1e-5, 1024, 512, None, "\n",
                                                                                            False, True)
    assert plait.PRMConfig is PRMConfig and plait.PRMTrainer is PRMTrainer
    trainer = PRMTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=Dataset.from_list(ROWS[:4]))
    assert type(trainer.model).__name__.endswith("ForTokenClassification") and trainer.model.config.num_labels == 2


def test_the_loss_is_cross_entropy_at_the_separators_only(tmp_path):
    trainer = PRMTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=Dataset.from_list(ROWS[:4]))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    steps = [(b, t) for b in range(4) for t in range(batch["labels"].shape[1]) if batch["labels"][b, t] != -100]
    expected = sum(F.cross_entropy(logits[b, t][None], batch["labels"][b, t][None]) for b, t in steps) / len(steps)
    assert len(steps) == sum(len(r["labels"]) for r in ROWS[:4])
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Learning, then the trained PRM as a GRPO reward
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_prm(tmp_path_factory):
    """A PRM trained on examples/data/demo_prm.jsonl (true facts vs false ones), held-out accuracy before/after."""
    start = time.time()
    out = tmp_path_factory.mktemp("prm")
    trainer = PRMTrainer(str(tiny_model_path()), args=config(out, max_steps=20),
                         train_dataset=Dataset.from_list(ROWS[:80]), eval_dataset=Dataset.from_list(ROWS[80:]))
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    trainer.save_model(str(out / "model"))
    print(f"PRM step accuracy {before:.3f} -> {after:.3f} ({time.time() - start:.1f} s)")
    return out / "model", before, after, trainer.state.log_history


def test_step_accuracy_rises_above_chance(trained_prm):
    _, before, after, history = trained_prm
    labels = [x for row in ROWS[80:] for x in row["labels"]]
    chance = max(sum(labels), len(labels) - sum(labels)) / len(labels)  # the majority class
    assert after > chance + 0.2 and after > before + 0.2, (chance, before, after)
    logged = [h for h in history if "accuracy" in h]
    assert logged[-1]["accuracy"] > logged[0]["accuracy"] and "accuracy/last_step" in logged[-1]


def test_the_prm_folder_records_its_separator(trained_prm):
    folder = trained_prm[0]
    assert json.loads((folder / "config.json").read_text())["step_separator"] == "\n"


GRPO_PROMPTS = ["Say true things about the world."] * 3
GRPO_COMPLETIONS = ["Fire is hot.\nIce is cold.\n", "Fire is hot.\nIce is loud.", "Snow is late.\nCoal is black.\n"]


def test_a_prm_folder_scores_a_grpo_batch_by_aggregation(trained_prm, tokenizer):
    folder = str(trained_prm[0])
    scores = process_reward_model(folder).fn.step_scores(GRPO_PROMPTS, GRPO_COMPLETIONS)
    assert [len(s) for s in scores] == [2, 2, 2]
    assert scores[0].min() > 0.5 and scores[1][0] > 0.5 > scores[1][1] and scores[2][0] < 0.5 < scores[2][1]
    by_name = {"min": [float(s.min()) for s in scores], "last": [float(s[-1]) for s in scores],
               "mean": [float(s.mean()) for s in scores]}
    ids_ = [ids(tokenizer, c) for c in GRPO_COMPLETIONS]
    for aggregation, expected in by_name.items():
        funcs = resolve_reward_funcs([{"name": "prm", "model": folder, "aggregation": aggregation}])
        rewards = compute_rewards(funcs, prompts=GRPO_PROMPTS, completions=GRPO_COMPLETIONS, completion_ids=ids_)
        assert funcs[0].name == "prm"
        torch.testing.assert_close(rewards[:, 0], torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # a bare folder is the PRM source's, aggregated by min; an unknown aggregation is named
    bare = resolve_reward_funcs([folder])
    torch.testing.assert_close(compute_rewards(bare, prompts=GRPO_PROMPTS, completions=GRPO_COMPLETIONS,
                                               completion_ids=ids_)[:, 0], torch.tensor(by_name["min"]))
    with pytest.raises(PlaitError, match="aggregation"):
        resolve_reward_funcs([{"name": "prm", "model": folder, "aggregation": "max"}])
    with pytest.raises(PlaitError, match="did you mean 'mean'"):
        process_reward_model(folder, aggregation="meen")


def test_grpo_trains_with_a_prm_reward(trained_prm, tmp_path):
    folder = str(trained_prm[0])
    args = plait.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=8, max_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                            seed=0)
    grpo = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=[{"name": "prm", "model": folder, "aggregation": "last"}],
                             args=args, train_dataset=Dataset.from_list([{"prompt": p} for p in GRPO_PROMPTS + ["Hi."]]))
    grpo.train()
    logged = next(h for h in grpo.state.log_history if "rewards/prm/mean" in h)
    assert 0.0 < logged["rewards/prm/mean"] < 1.0  # a probability of the last step being correct


def test_with_lora_the_new_head_trains_too(tmp_path):
    from peft import LoraConfig

    trainer = PRMTrainer(str(tiny_model_path()), args=config(tmp_path, max_steps=1),
                         train_dataset=Dataset.from_list(ROWS[:16]),
                         peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # no task_type: TOKEN_CLS is set
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert any("score" in n for n in changed) and all("lora_" in n or "score" in n for n in changed)
