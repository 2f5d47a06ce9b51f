"""Training chat templates (``register_chat_templates``): a tokenizer whose template rewrites earlier turns (Qwen3
drops past reasoning), where assistant-only loss was refused, trains with masks exactly on the assistant outputs;
a third party's template is used by name; the kind's contract check."""

import json
import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from plait import PlaitError, hookimpl
from plait.data import chat
from plait.data.prepare import prepare_dataset
from plait.hookspecs import ChatTemplateOptions
from plait.manager import default_plugins
from plait.plugins.methods.sft import SFTConfig, SFTTrainer
from plait.registry import Component
from plait.testing.contracts import ContractViolation, check_chat_template
from plait.testing.tiny_model import tiny_model_path

PLAIT = Path(sys.executable).parent / "plait"

# Qwen3's behaviour in a few lines: an assistant turn after the last user query renders its reasoning in a <think>
# block, an earlier one loses it. So [user, assistant] is not a prefix of [user, assistant, user, assistant].
QWEN3_STYLE = (
    "{%- set ns = namespace(found=false, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if not ns.found and message.role == 'user' %}"
    "{%- set ns.found = true %}{%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "What is 7 plus 5?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nIt is 12."},
    {"role": "user", "content": "And 9 times 8?"},
    {"role": "assistant", "content": "<think>\nMultiply them.\n</think>\n\nIt is 72."},
]
# What each assistant turn trains on, read off the template by hand: its <think> block, its answer and <|im_end|>.
ASSISTANT_OUTPUTS = ["<think>\nAdd them.\n</think>\n\nIt is 12.<|im_end|>",
                     "<think>\nMultiply them.\n</think>\n\nIt is 72.<|im_end|>"]


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> Path:
    """The tiny model with a Qwen3-style template (no generation markers) in place of its own."""
    folder = tmp_path_factory.mktemp("qwen3ish") / "model"
    shutil.copytree(tiny_model_path(), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = QWEN3_STYLE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def tokenizer(qwen3_model):
    return AutoTokenizer.from_pretrained(qwen3_model)


def trained_runs(tokenizer, ids, mask) -> list[str]:
    """The text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, keep in zip(list(ids) + [None], list(mask) + [0]):
        if keep:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def test_a_qwen3_template_that_was_refused_now_masks_exactly_the_assistant_outputs(tokenizer, caplog, monkeypatch):
    with pytest.raises(PlaitError, match="not prefix-preserving"):  # what assistant_only_loss met before
        chat.derived_assistant_mask(tokenizer, CONVERSATION)
    monkeypatch.setattr(chat, "_announced", set())
    with caplog.at_level(logging.WARNING, logger="plait"):
        ids, mask = chat.encode_with_assistant_mask(tokenizer, CONVERSATION)
        chat.encode_with_assistant_mask(tokenizer, CONVERSATION)
    assert trained_runs(tokenizer, ids, mask) == ASSISTANT_OUTPUTS
    said = [r.getMessage() for r in caplog.records if "template.qwen3" in r.getMessage()]
    assert len(said) == 1 and "qwen3's" in said[0]  # once, however many rows
    assert tokenizer.chat_template == QWEN3_STYLE  # the tokenizer (and what inference uses) keeps its own template


def test_the_training_template_renders_the_last_turn_and_the_generation_prompt_as_the_original(tokenizer):
    training = chat.training_template(tokenizer)
    last_turn = [CONVERSATION[0], {"role": "assistant", "content": "It is 12."}]
    for messages, prompt in ((last_turn, False), (CONVERSATION[:1], True), (CONVERSATION[:2], False)):
        assert (tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, chat_template=training)
                == tokenizer.apply_chat_template(messages, add_generation_prompt=prompt))


def test_a_multi_turn_prompt_and_its_completion_render_with_the_training_template(tokenizer):
    # The prompt ends after a later query, so Qwen3's own template would drop the first turn's reasoning from the
    # prompt but not from the masks' rendering: both render with the training template, as TRL's chat_template= does.
    rows = [{"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]}]
    row = prepare_dataset(rows, tokenizer, "language_modeling", assistant_only_loss=True)[0]
    assert trained_runs(tokenizer, row["input_ids"], row["completion_mask"]) == ASSISTANT_OUTPUTS[1:]
    assert ASSISTANT_OUTPUTS[0] in tokenizer.decode(row["input_ids"])


def sft_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                  save_strategy="no", report_to="none", seed=0, max_length=128, assistant_only_loss=True,
                  logging_steps=1)
    return SFTConfig(**{**values, **overrides})


def test_sft_trains_on_the_assistant_outputs_of_a_qwen3_template(qwen3_model, tmp_path):
    trainer = SFTTrainer(str(qwen3_model), args=sft_args(tmp_path),
                         train_dataset=Dataset.from_list([{"messages": CONVERSATION}] * 2))
    row = trainer.train_dataset[0]
    assert trained_runs(trainer.processing_class, row["input_ids"], row["completion_mask"]) == ASSISTANT_OUTPUTS
    batch = trainer.data_collator([row])
    targets = batch["labels"][batch["labels"] != -100]
    assert len(targets) == sum(row["completion_mask"]) > 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.slow
def test_plait_sft_trains_a_qwen3_template_with_assistant_only_loss(qwen3_model, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(2)) + "\n")
    done = subprocess.run(
        [str(PLAIT), "sft", "--model_name_or_path", str(qwen3_model), "--dataset_name", str(data),
         "--assistant_only_loss", "true", "--max_steps", "1", "--per_device_train_batch_size", "2",
         "--output_dir", str(tmp_path / "run"), "--report_to", "none", "--save_strategy", "no"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "template.qwen3" in done.stdout + done.stderr  # the swap is said in the run's log
    assert (tmp_path / "run" / "model.safetensors").exists()


# -- a third party's template, by name -----------------------------------------------------------

# ChatML that trains on an assistant's answer only (not on its <|im_end|>): visibly not the built-in's masks.
ANSWER_ONLY = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}{{- message.content }}{% endgeneration %}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture
def answer_only_plugin():
    plugin = types.SimpleNamespace(register_chat_templates=hookimpl(
        lambda register: register("template.answer_only", ANSWER_ONLY, recognises=("never in a template",),
                                  doc="ChatML, answers only")))
    plugins = default_plugins()
    plugins.register(plugin, name="answer_only_templates")
    yield plugins
    plugins.unregister("answer_only_templates")


def test_a_third_party_template_is_used_by_name(qwen3_model, tokenizer, tmp_path, answer_only_plugin):
    rows = [{"messages": CONVERSATION}]
    prepared = prepare_dataset(rows, tokenizer, "language_modeling", assistant_only_loss=True,
                               chat_template_path="answer_only")
    answers = [output.removesuffix("<|im_end|>") for output in ASSISTANT_OUTPUTS]  # its masks leave out <|im_end|>
    assert trained_runs(tokenizer, prepared[0]["input_ids"], prepared[0]["completion_mask"]) == answers
    trainer = SFTTrainer(str(qwen3_model), args=sft_args(tmp_path, chat_template_path="template.answer_only"),
                         train_dataset=Dataset.from_list(rows))
    row = trainer.train_dataset[0]
    assert trained_runs(tokenizer, row["input_ids"], row["completion_mask"]) == answers
    with pytest.raises(PlaitError, match="chat_template_path='answer_onyl' is no file.*unknown chat template "
                                         "'answer_onyl'.*did you mean 'template.answer_only'"):
        chat.load_chat_template(tokenizer, "answer_onyl")


# -- the kind's contract check --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["template.qwen3", "template.deepseek_r1_distill"])
def test_built_in_templates_keep_the_contract(name, plait_plugins):
    original = QWEN3_STYLE if name == "template.qwen3" else None
    checked = check_chat_template(name, plait_plugins, original=original)
    assert "is prefix-preserving" in checked and ("renders the last turn as the original" in checked) == bool(original)


def test_the_contract_refuses_a_template_that_rewrites_earlier_turns():
    marked = QWEN3_STYLE.replace("{{- '<|im_end|>\\n' }}", "{% generation %}{{- '<|im_end|>' }}{% endgeneration %}"
                                 "{{- '\\n' }}", 1)
    component = Component("chat template", "template.rewriting", marked, doc="x",
                          options=ChatTemplateOptions(recognises=("x",)))
    with pytest.raises(ContractViolation, match="is prefix-preserving"):
        check_chat_template(component)
