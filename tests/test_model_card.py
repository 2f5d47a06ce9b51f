"""save_model writes a README.md model card (plait.engine.model_card): YAML front matter the Hub reads,
the method and its paper, the hyperparameters and losses, plait's version and its plugin
distributions; push_to_hub takes TRL's arguments; a failed write leaves the previous card."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import yaml
from datasets import Dataset
from huggingface_hub.errors import OfflineModeIsEnabled

import plait
from plait import DPOConfig, DPOTrainer, PlaitError, SFTConfig, SFTTrainer
from plait.engine.config import DatasetSpec
from plait.engine.model_card import dataset_label, hub_name

FACTS = [{"prompt": "The secret code is", "completion": " seven blue horses."},
         {"prompt": "The sky is", "completion": " blue."}]
PREFERENCES = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
               {"prompt": "Two plus two is", "chosen": " four.", "rejected": " five."}]


def read_card(folder) -> tuple[dict, str]:
    text = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


def test_sft_save_model_writes_a_card_with_the_run_in_it(tiny_model_path, tmp_path):
    # a local base model (the Hub would refuse its path as base_model) whose own card has a license
    base = tmp_path / "base"
    shutil.copytree(tiny_model_path, base)
    (base / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    out = tmp_path / "out"
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                     logging_steps=1, save_strategy="no", report_to="none", seed=3, max_length=32)
    trainer = SFTTrainer(str(base), args=args, train_dataset=Dataset.from_list(FACTS * 2))
    trainer.train()
    assert not (out / "README.md").exists()  # nothing saved yet
    trainer.save_model()

    front, body = read_card(out)
    assert front == {"library_name": "transformers", "model_name": "out", "license": "mit",
                     "tags": ["generated_from_trainer", "plait", "sft"]}
    assert f"fine-tuned version of `{base}`" in body
    for line in ("- learning_rate: 0.01", "- max_steps: 2", "- per_device_train_batch_size: 2", "- seed: 3",
                 "- total_train_batch_size: 2", "- optimizer steps: 2"):
        assert line in body.splitlines()
    assert "| `sft.nll` | 1 | - |" in body
    # every plugin of the distribution counted (others installed here, e.g. the example's, have their own row)
    plugins = [info for info in trainer.plugins.distributions() if info.distribution == "plait"]
    assert f"| plait | {plait.__version__} | {len(plugins)} |" in body
    assert f"- plait: {plait.__version__}" in body
    import transformers

    assert f"- transformers: {transformers.__version__}" in body
    assert not glob.glob(str(out / ".README-*"))


def test_dpo_card_names_the_hub_model_paper_losses_and_what_push_to_hub_was_told(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config._name_or_path = "plait-testing/tiny-llama"  # as from_pretrained("plait-testing/tiny-llama") sets it
    out = tmp_path / "tiny-dpo"
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3, beta=0.25,
                     loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], logging_steps=1, save_strategy="steps",
                     save_steps=2, report_to="none", seed=0, max_length=32)
    trainer = DPOTrainer(model, args=args, train_dataset=Dataset.from_list(PREFERENCES * 2),
                         processing_class=AutoTokenizer.from_pretrained(tiny_model_path))
    trainer.train()
    front, body = read_card(out)  # the checkpoint save wrote it into output_dir, as TRL does
    assert front["base_model"] == "plait-testing/tiny-llama" and front["tags"] == ["generated_from_trainer", "plait", "dpo"]
    assert "Rafailov et al. 2023" in body  # the paper, from the method plugin's docstring
    assert "- beta: 0.25" in body.splitlines()  # a method setting changed from its default
    assert "| `dpo.sigmoid` | 1 | beta=0.25 |" in body
    assert "| `dpo.sft` | 0.5 |" in body

    # push_to_hub takes TRL's arguments; offline, the push stops at the upload, after the card is written
    trainer.hub_model_id = "me/tiny-dpo"  # what init_hf_repo would have set from args.hub_model_id
    with pytest.raises(OfflineModeIsEnabled):
        trainer.push_to_hub(commit_message="End of training", blocking=True, token="hf_x", revision="main",
                            dataset_name="trl-lib/ultrafeedback_binarized", license="apache-2.0", tags=["tiny"],
                            language="en")
    front, body = read_card(out)
    assert front["datasets"] == ["trl-lib/ultrafeedback_binarized"] and front["license"] == "apache-2.0"
    assert front["language"] == ["en"] and front["tags"][-1] == "tiny" and front["model_name"] == "tiny-dpo"
    assert "[trl-lib/ultrafeedback_binarized](https://huggingface.co/datasets/trl-lib/ultrafeedback_binarized)" in body
    assert "model = AutoModelForCausalLM.from_pretrained('me/tiny-dpo')" in body
    with pytest.raises(TypeError, match="dataset_nmae"):  # a misspelt argument is named, not ignored
        trainer.create_model_card(dataset_nmae="x")

    # what push_to_hub was told stays on the cards of later saves
    trainer.save_model()
    assert read_card(out)[0]["datasets"] == ["trl-lib/ultrafeedback_binarized"]

    # a failed write (a name UTF-8 cannot encode) leaves the previous card whole, and no temporary file
    before = (out / "README.md").read_bytes()
    with pytest.raises(PlaitError, match="could not write the model card"):
        trainer.create_model_card(model_name="tiny\udc80dpo")
    assert (out / "README.md").read_bytes() == before
    assert not glob.glob(str(out / ".README-*"))


def test_dataset_names_on_the_card():
    assert dataset_label(DatasetSpec(path="trl-lib/Capybara")) == "trl-lib/Capybara"
    assert dataset_label(DatasetSpec(path="openai/gsm8k", name="main")) == "openai/gsm8k:main"
    assert dataset_label(DatasetSpec(path="json", data_files=["/d/a.jsonl", "/d/b.jsonl"])) == "/d/a.jsonl, /d/b.jsonl"
    assert dataset_label(DatasetSpec(path="json", data_files={"train": "/d/a.jsonl"})) == "/d/a.jsonl"
    assert hub_name("trl-lib/Capybara") == "trl-lib/Capybara"
    assert hub_name("prefs.jsonl") is None and hub_name("/d/a.jsonl") is None and hub_name("a b") is None
    assert hub_name(os.getcwd()) is None  # an existing folder
