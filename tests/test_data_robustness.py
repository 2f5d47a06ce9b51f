"""Examples that keep no trained token are dropped with a count, refused when none remain; identical pairs warn.

The data is the bundled demo data (examples/data/*.jsonl) with a few rows spoiled the way real
data goes wrong: a misspelled assistant role, a completion truncated away, chosen == rejected.
"""

import logging
import math
import pathlib

import datasets
import pytest
from transformers import AutoTokenizer

from plait import PlaitError
from plait.data.prepare import prepare_dataset
from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
from plait.plugins.methods.kto import KTOConfig, KTOTrainer
from plait.plugins.methods.reward_model import RewardConfig, RewardTrainer
from plait.plugins.methods.sft import SFTConfig, SFTTrainer
from plait.testing.tiny_model import chat_template, tiny_model_path

DATA = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data"
MODEL = str(tiny_model_path())
# Like many real templates, this one renders only the roles it knows and silently skips the rest.
KNOWN_ROLES_ONLY = chat_template().replace(
    "{%- for message in messages -%}",
    "{%- for message in messages -%}{%- if message['role'] in ['system', 'user', 'assistant', 'tool'] -%}",
).replace("{%- endfor -%}{%- if add_generation_prompt", "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt")


def jsonl(name: str, rows: int) -> datasets.Dataset:
    return datasets.load_dataset("json", data_files=str(DATA / name), split="train").select(range(rows))


def misspell(messages: list[dict]) -> list[dict]:
    return [{**m, "role": "assistnat" if m["role"] == "assistant" else m["role"]} for m in messages]


def spoil(dataset: datasets.Dataset, column: str, every: int, how=misspell) -> datasets.Dataset:
    """Spoil ``column`` of every ``every``-th row (rows 0, every, 2·every, ...)."""
    return dataset.map(lambda row, i: {column: how(row[column]) if i % every == 0 else row[column]}, with_indices=True)


def skipping_tokenizer():
    tok = AutoTokenizer.from_pretrained(MODEL)
    tok.chat_template = KNOWN_ROLES_ONLY
    return tok


def args(config_class, tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
                  logging_steps=1, save_strategy="no", report_to="none", seed=0, max_length=512)
    return config_class(**{**values, **overrides})


def dropped_warning(caplog) -> str:
    [message] = [r.getMessage() for r in caplog.records if "keep no trained token" in r.getMessage()]
    return message


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# -- SFT ---------------------------------------------------------------------------------------


def test_sft_drops_rows_with_a_misspelled_assistant_role_and_trains_on_the_rest(tmp_path, caplog):
    data = spoil(jsonl("demo_sft.jsonl", 24), "completion", every=4)  # rows 0, 4, ..., 20: 6 spoiled
    with caplog.at_level(logging.WARNING, logger="plait"):
        trainer = SFTTrainer(MODEL, args=args(SFTConfig, tmp_path, assistant_only_loss=True), train_dataset=data)
    message = dropped_warning(caplog)
    assert "dropped 6 of 24 examples" in message and "assistant_only_loss=True" in message
    assert "dataset row 0" in message and "'assistnat'" in message
    assert len(trainer.train_dataset) == 18
    assert all(sum(mask[1:]) > 0 for mask in trainer.train_dataset["completion_mask"])
    trainer.train()
    assert len(losses(trainer)) == 2 and all(math.isfinite(x) and x > 0 for x in losses(trainer))


def test_sft_refuses_data_where_no_row_keeps_a_trained_token(tmp_path):
    data = spoil(jsonl("demo_sft.jsonl", 8), "completion", every=1)
    with pytest.raises(PlaitError, match=r"none of the 8 examples keeps a trained token.*'assistnat'") as err:
        SFTTrainer(MODEL, args=args(SFTConfig, tmp_path, assistant_only_loss=True), train_dataset=data)
    assert "\n" not in str(err.value)


def test_a_completion_truncated_away_is_dropped_and_named():
    tok = AutoTokenizer.from_pretrained(MODEL)
    rows = jsonl("demo_sft.jsonl", 6).to_list()
    conversations = [{"messages": r["prompt"] + r["completion"]} for r in rows]
    conversations[2]["messages"] = [{"role": "user", "content": "Please read this. " * 30}] + rows[2]["completion"]
    out = prepare_dataset(conversations, tok, "language_modeling", assistant_only_loss=True, max_length=48)
    assert len(out) == 5
    with pytest.raises(PlaitError, match=r"none of the 1 examples .* max_length=48 \(keep_start\) cut off every trained"):
        prepare_dataset(conversations[2:3], tok, "language_modeling", assistant_only_loss=True, max_length=48)


def test_prompt_completion_whose_completion_the_template_drops_is_dropped(caplog):
    rows = spoil(jsonl("demo_sft.jsonl", 10), "completion", every=5)  # rows 0 and 5
    with caplog.at_level(logging.WARNING, logger="plait"):
        out = prepare_dataset(rows, skipping_tokenizer(), "language_modeling")  # completion-only loss
    assert len(out) == 8
    assert "dropped 2 of 10 examples" in dropped_warning(caplog)


# -- preference: DPO and reward models ----------------------------------------------------------


def test_dpo_drops_pairs_whose_chosen_renders_to_nothing_and_counts_identical_pairs(tmp_path, caplog):
    data = spoil(jsonl("demo_preferences.jsonl", 24), "chosen", every=6)           # rows 0, 6, 12, 18
    data = data.map(lambda row, i: {"rejected": row["chosen"] if i % 6 == 1 else row["rejected"]},
                    with_indices=True)                                                # rows 1, 7, 13, 19
    with caplog.at_level(logging.WARNING, logger="plait"):
        trainer = DPOTrainer(MODEL, args=args(DPOConfig, tmp_path), train_dataset=data,
                             processing_class=skipping_tokenizer())
    message = dropped_warning(caplog)
    assert "dropped 4 of 24 examples" in message and "the chosen completion renders to no token" in message
    assert "'assistnat'" in message
    [identical] = [r.getMessage() for r in caplog.records if "identical" in r.getMessage()]
    assert "4 of 20 preference pairs have identical chosen and rejected" in identical and "dataset row 1" in identical
    assert len(trainer.train_dataset) == 20 and min(map(len, trainer.train_dataset["chosen_ids"])) > 0
    trainer.train()
    assert len(losses(trainer)) == 2 and all(math.isfinite(x) for x in losses(trainer))


@pytest.mark.parametrize("trainer_class, config_class", [(DPOTrainer, DPOConfig), (RewardTrainer, RewardConfig)],
                         ids=["dpo", "reward_model"])
def test_preference_methods_refuse_pairs_that_all_lose_a_completion(tmp_path, trainer_class, config_class):
    data = spoil(jsonl("demo_preferences.jsonl", 6), "rejected", every=1)
    with pytest.raises(PlaitError, match=r"none of the 6 examples keeps a trained token.*the rejected completion"):
        trainer_class(MODEL, args=args(config_class, tmp_path), train_dataset=data,
                      processing_class=skipping_tokenizer())


# -- unpaired: KTO -------------------------------------------------------------------------------


def test_kto_drops_completions_that_render_to_nothing(tmp_path, caplog):
    pairs = jsonl("demo_preferences.jsonl", 12)
    rows = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
            for r in pairs.to_list() for side in ("chosen", "rejected")]
    data = spoil(datasets.Dataset.from_list(rows), "completion", every=8)  # rows 0, 8, 16: desirable ones
    with caplog.at_level(logging.WARNING, logger="plait"):
        trainer = KTOTrainer(MODEL, args=args(KTOConfig, tmp_path, per_device_train_batch_size=8), train_dataset=data,
                             processing_class=skipping_tokenizer())
    assert "dropped 3 of 24 examples" in dropped_warning(caplog)
    assert len(trainer.train_dataset) == 21 and min(map(len, trainer.train_dataset["completion_ids"])) > 0
    trainer.train()
    assert all(math.isfinite(x) for x in losses(trainer))


def test_kto_from_pairs_refuses_when_nothing_is_left(tmp_path):
    data = spoil(spoil(jsonl("demo_preferences.jsonl", 4), "chosen", every=1), "rejected", every=1)
    with pytest.raises(PlaitError, match=r"none of the 8 examples keeps a trained token.*completion renders to no token"):
        KTOTrainer(MODEL, args=args(KTOConfig, tmp_path), train_dataset=data, processing_class=skipping_tokenizer())
