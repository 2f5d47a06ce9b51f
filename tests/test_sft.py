"""SFT end to end on the tiny model: loss goes down, a memorised completion comes back, resume is exact."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.plugins.methods.sft import SFTConfig, SFTTrainer
from plait.testing.tiny_model import tiny_model_path

FACT = {"prompt": "The secret code is", "completion": " seven blue horses."}


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=40, learning_rate=3e-3,
                  logging_steps=5, save_strategy="no", report_to="none", seed=0, max_length=64)
    return SFTConfig(**{**values, **overrides})


def greedy(model, tokenizer, prompt, n=8):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_memorises_a_completion(tmp_path, lora):
    # A random tiny model's output layer caps its logits near uniform; adapting it lets LoRA fit.
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    peft = LoraConfig(r=16, lora_alpha=32, target_modules=targets) if lora else None
    data = Dataset.from_list([FACT] * 16)
    trainer = SFTTrainer(str(tiny_model_path()), args=config(tmp_path, learning_rate=1e-2 if lora else 3e-3),
                         train_dataset=data, peft_config=peft)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.25 * losses[0]
    assert trainer.state.log_history[-2]["mean_token_accuracy"] > 0.9
    assert greedy(trainer.model, trainer.processing_class, FACT["prompt"]).strip().startswith("seven blue horse")


def test_output_folder_reloads_with_auto_classes(tmp_path):
    trainer = SFTTrainer(str(tiny_model_path()), args=config(tmp_path, max_steps=2), train_dataset=Dataset.from_list([FACT] * 4))
    trainer.train()
    trainer.save_model()
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tmp_path)
    for name, param in trainer.model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], param)
    assert (tmp_path / "plait_run.json").exists()


def test_completion_only_loss_masks_the_prompt(tmp_path):
    trainer = SFTTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=Dataset.from_list([FACT]))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    tok = trainer.processing_class
    targets = batch["input_ids"][batch["labels"] != -100]
    assert tok.decode(targets).strip() == (FACT["completion"].strip() + tok.eos_token).strip()


def test_completion_only_loss_projects_only_the_completion(tmp_path):
    # the output layer and the log-softmax over the vocabulary run only where the loss reads: not at the prompt
    row = {"prompt": "The secret code, which nobody in the whole village has ever been told, is", "completion": " seven."}
    trainer = SFTTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=Dataset.from_list([row] * 2))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    read = int((batch["labels"][:, 1:] != -100).sum())
    assert 0 < read < batch["input_ids"].numel() // 2  # the prompt is most of each row
    vocab = trainer.model.config.vocab_size
    projected: list[int] = []
    handle = trainer.model.lm_head.register_forward_hook(lambda m, a, out: projected.append(out.reshape(-1, vocab).shape[0]))
    try:
        trainer.compute_loss(trainer.model, batch)  # checks the output layer once
        projected.clear()
        trainer.compute_loss(trainer.model, batch)
    finally:
        handle.remove()
    assert projected == [batch["input_ids"].shape[0], read]  # the model's own call (a position per row), the chunk


def _final_weights(path):
    return load_file(sorted(path.glob("checkpoint-*"))[-1] / "model.safetensors")


def test_resume_continues_exactly(tmp_path):
    data = Dataset.from_list([{"prompt": f"Item {i} is", "completion": f" number {i}."} for i in range(24)])
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, learning_rate=1e-3, logging_steps=1)
    straight = SFTTrainer(str(tiny_model_path()), args=config(tmp_path / "a", **common), train_dataset=data)
    straight.train()
    half = SFTTrainer(str(tiny_model_path()), args=config(tmp_path / "b", **{**common, "max_steps": 6}), train_dataset=data)
    # simulate a kill after step 3: train with a callback that stops the run there
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    half.add_callback(Stop())
    half.train()
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-3"]
    assert not (tmp_path / "b" / ".staging").exists()  # the staged write was renamed into place, its folder removed
    resumed = SFTTrainer(str(tiny_model_path()), args=config(tmp_path / "b", **common), train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    a, b = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    meta = (tmp_path / "b" / "checkpoint-6" / "plait_run.json").read_text()
    assert '"method": "sft"' in meta and '"distribution": "plait"' in meta


def test_a_pathlib_path_names_the_model_folder(tmp_path):
    from pathlib import Path

    folder = Path(tiny_model_path())
    trainer = SFTTrainer(folder, args=config(tmp_path), train_dataset=Dataset.from_list([{"text": "The sky is blue."}] * 2))
    assert trainer.model.config._name_or_path == str(folder)
    assert trainer.processing_class.name_or_path == str(folder)
