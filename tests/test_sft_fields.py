"""TRL 1.16's SFTConfig fields plait used to refuse (dataset_text_field, dataset_kwargs, eval_packing,
shuffle_dataset, loss_type='chunked_nll') and pad_to_multiple_of='auto' for SFT, DPO, KTO and reward models."""

import pytest
import torch
from datasets import Dataset

from plait import PlaitError, make_plugins
from plait.data.prepare import prepare_dataset
from plait.engine.layout import check_multiple
from plait.plugins.methods.dpo import DPOConfig
from plait.plugins.methods.kto import KTOConfig
from plait.plugins.methods.reward_model import RewardConfig
from plait.plugins.methods.sft import SFTConfig, SFTTrainer
from plait.testing.tiny_model import tiny_model_path

PLUGINS = make_plugins()
TEXTS = [f"Item {i} is number {i}, and the river runs {'far ' * (i % 4)}past the mill." for i in range(12)]


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3,
                  save_strategy="no", report_to="none", seed=0, max_length=64)
    return SFTConfig(**{**values, **overrides})


def sft(tmp_path, data, eval_data=None, **overrides):
    return SFTTrainer(str(tiny_model_path()), args=config(tmp_path, **overrides), train_dataset=data,
                      eval_dataset=eval_data)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path())


# ---- dataset_text_field -------------------------------------------------------------------------

def test_dataset_text_field_names_the_column_read_as_text(tmp_path, tokenizer):
    by_name = sft(tmp_path, Dataset.from_list([{"content": t, "text": "not this"} for t in TEXTS]),
                  dataset_text_field="content").train_dataset
    as_text = prepare_dataset(Dataset.from_list([{"text": t} for t in TEXTS]), tokenizer, "language_modeling",
                              plugins=PLUGINS, max_length=64)
    assert by_name["input_ids"] == as_text["input_ids"]
    assert tokenizer.decode(by_name[0]["input_ids"], skip_special_tokens=True).strip() == TEXTS[0]
    assert SFTConfig(output_dir=str(tmp_path)).dataset_text_field == "text"  # TRL 1.16's default


def test_dataset_text_field_not_in_the_dataset_is_refused(tokenizer):
    with pytest.raises(PlaitError, match=r"dataset_text_field='body' is not a column .*\['text'\]"):
        prepare_dataset([{"text": "hello"}], tokenizer, "language_modeling", plugins=PLUGINS, text_field="body")
    with pytest.raises(PlaitError, match=r"dataset_text_field='body' is not a column .*no other shape fits"):
        prepare_dataset([{"content": "hello"}], tokenizer, "language_modeling", plugins=PLUGINS, text_field="body")
    # prompt-completion rows do not read it (as in TRL)
    pairs = prepare_dataset([{"prompt": "a", "completion": " b"}], tokenizer, "language_modeling", plugins=PLUGINS,
                            text_field="body")
    assert sum(pairs[0]["completion_mask"]) < len(pairs[0]["input_ids"])


# ---- dataset_kwargs: skip_prepare_dataset --------------------------------------------------------

def test_skip_prepare_dataset_trains_on_the_given_tokens_and_labels(tmp_path):
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
            {"input_ids": [10, 11, 12], "labels": [-100, 11, 12]}]
    t = sft(tmp_path, Dataset.from_list(rows), dataset_kwargs={"skip_prepare_dataset": True})
    assert t.train_dataset[0]["input_ids"] == [5, 6, 7, 8, 9]  # not re-tokenised
    batch = t.data_collator([t.train_dataset[0], t.train_dataset[1]])
    assert batch["labels"].tolist() == [[-100, -100, 7, 8, 9], [-100, 11, 12, -100, -100]]
    t.train()  # and the chassis takes such rows end to end
    assert t.state.global_step == 2


def test_skip_prepare_dataset_reads_a_completion_mask(tmp_path):
    # TRL 1.16 refuses mask columns without labels here (its collator no longer reads them); plait's does
    rows = [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]}, {"input_ids": [9, 10], "completion_mask": [0, 1]}]
    t = sft(tmp_path, Dataset.from_list(rows), dataset_kwargs={"skip_prepare_dataset": True})
    assert t.data_collator(rows)["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, -100, -100]]
    flat = sft(tmp_path, Dataset.from_list(rows), dataset_kwargs={"skip_prepare_dataset": True}, padding_free=True)
    assert flat.data_collator(rows)["labels"].tolist() == [[-100, -100, 7, 8, -100, 10]]


def test_skip_prepare_dataset_needs_token_ids(tmp_path):
    with pytest.raises(PlaitError, match=r"takes a tokenised train dataset with an 'input_ids' column.*\['text'\]"):
        sft(tmp_path, Dataset.from_list([{"text": t} for t in TEXTS]), dataset_kwargs={"skip_prepare_dataset": True})


def test_dataset_kwargs_takes_only_skip_prepare_dataset(tmp_path):
    with pytest.raises(PlaitError, match=r"dataset_kwargs has unknown key\(s\) \['add_special_tokens'\]"):
        config(tmp_path, dataset_kwargs={"add_special_tokens": False})


# ---- eval_packing ------------------------------------------------------------------------------

@pytest.mark.parametrize("packing, eval_packing, train_packed, eval_packed", [
    (False, None, False, False), (True, None, True, True), (True, False, True, False), (False, True, False, True),
])
def test_eval_packing_defaults_to_packing(tmp_path, packing, eval_packing, train_packed, eval_packed):
    data = Dataset.from_list([{"text": t} for t in TEXTS])
    t = sft(tmp_path, data, data, packing=packing, eval_packing=eval_packing, max_length=48)
    assert ("seq_lengths" in t.train_dataset.column_names) == train_packed
    assert ("seq_lengths" in t.eval_dataset.column_names) == eval_packed
    assert (len(t.eval_dataset) < len(TEXTS)) == eval_packed
    # packed rows are collated padding-free whatever the split (positions restart per document)
    batch = t.data_collator([t.eval_dataset[0], t.eval_dataset[1]])
    assert ("position_ids" in batch) == eval_packed
    if eval_packed:
        starts = int((batch["position_ids"][0] == 0).sum())
        assert starts == len(t.eval_dataset[0]["seq_lengths"]) + len(t.eval_dataset[1]["seq_lengths"])
    assert "eval_loss" in t.evaluate()


# ---- shuffle_dataset ---------------------------------------------------------------------------

def test_shuffle_dataset_shuffles_once_with_the_seed(tmp_path, tokenizer):
    data = Dataset.from_list([{"text": t} for t in TEXTS])
    kept = sft(tmp_path, data).train_dataset["input_ids"]  # TRL 1.16's default: no shuffle
    shuffled = sft(tmp_path, data, shuffle_dataset=True, seed=3).train_dataset["input_ids"]
    assert kept == prepare_dataset(data, tokenizer, "language_modeling", plugins=PLUGINS, max_length=64)["input_ids"]
    assert shuffled != kept and sorted(shuffled) == sorted(kept)
    assert shuffled == Dataset.from_dict({"input_ids": kept}).shuffle(seed=3)["input_ids"]


# ---- loss_type='chunked_nll' -----------------------------------------------------------------

def test_chunked_nll_is_trls_name_of_nll(tmp_path, caplog):
    data = Dataset.from_list([{"text": t} for t in TEXTS])
    with caplog.at_level("WARNING", logger="plait"):
        chunked = sft(tmp_path, data, loss_type="chunked_nll")
    assert "deprecated name of 'nll'" in caplog.text
    plain = sft(tmp_path, data, loss_type="nll")
    assert chunked.objective.names == plain.objective.names == ["sft.nll"]
    batch = chunked.data_collator([chunked.train_dataset[i] for i in range(4)])
    losses = [t.compute_loss(t.model, batch) for t in (chunked, plain)]
    assert losses[0].item() == pytest.approx(losses[1].item(), abs=1e-6) and losses[0].item() > 1.0


# ---- pad_to_multiple_of='auto' -----------------------------------------------------------------

@pytest.mark.parametrize("config_class", [SFTConfig, DPOConfig, KTOConfig, RewardConfig])
def test_pad_to_multiple_of_defaults_to_auto(tmp_path, config_class):
    assert config_class(output_dir=str(tmp_path)).pad_to_multiple_of == "auto"
    with pytest.raises(PlaitError, match=r"pad_to_multiple_of='sometimes' must be a positive integer, None or 'auto'"):
        config_class(output_dir=str(tmp_path), pad_to_multiple_of="sometimes")


def test_auto_pads_to_128_only_on_shape_compiling_devices():
    assert check_multiple("auto", "neuron") == 128  # AWS Neuron compiles once per input shape
    assert check_multiple("auto", "cuda") is None and check_multiple("auto", "cpu") is None
    assert check_multiple("auto") is None  # this machine: no such device
    assert check_multiple(8) == 8 and check_multiple(None) is None


def test_auto_leaves_batches_unrounded_here(tmp_path):
    t = sft(tmp_path, Dataset.from_list([{"input_ids": list(range(5, 5 + n))} for n in (3, 7)]),
            dataset_kwargs={"skip_prepare_dataset": True})
    assert t.data_collator([t.train_dataset[0], t.train_dataset[1]])["input_ids"].shape == (2, 7)
    rounded = sft(tmp_path, t.train_dataset, dataset_kwargs={"skip_prepare_dataset": True}, pad_to_multiple_of=4)
    assert rounded.data_collator([t.train_dataset[0], t.train_dataset[1]])["input_ids"].shape == (2, 8)
    assert torch.equal(rounded.data_collator([t.train_dataset[0]])["attention_mask"], torch.tensor([[1, 1, 1, 0]]))
