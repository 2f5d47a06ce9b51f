"""TRL 1.16's public attributes and helpers that TRL users call, on plait's trainers (issue 36):
``ref_model``, ``aux_loss_enabled``, ``use_vllm``, ``generation_config``, ``reward_processing_classes``,
an online trainer's ``eval_dataset`` kept as the user passed it, and GKD's ``generate_on_policy_outputs``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

import plait
from plait.testing.tiny_model import tiny_model_path

PAIRS = Dataset.from_list([{"prompt": "Tell me.", "chosen": " Good.", "rejected": " Bad."}] * 4)
COMPLETIONS = PAIRS.rename_column("chosen", "completion").remove_columns("rejected")
PROMPTS = Dataset.from_list([{"prompt": "Tell me."}, {"prompt": "Say it."}] * 2)


def length(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def config(cls, tmp_path, **values):
    return cls(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2, per_device_eval_batch_size=2,
               max_steps=1, **values)


def grpo(tmp_path, **values):
    values = {"num_generations": 2, "max_completion_length": 4, **values}
    return config(plait.GRPOConfig, tmp_path, **values)


def tiny_classifier(tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=tokenizer.pad_token_id))


def test_ref_model_is_the_separate_frozen_reference_or_none_as_in_trl(tmp_path):
    from peft import LoraConfig

    model = str(tiny_model_path())
    dpo = plait.DPOTrainer(model, args=config(plait.DPOConfig, tmp_path), train_dataset=PAIRS)
    reference, policy = dpo.ref_model, dpo.model
    assert reference is not policy and not any(p.requires_grad for p in reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), policy.state_dict().values()))
    lora = LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    assert plait.DPOTrainer(model, args=config(plait.DPOConfig, tmp_path), train_dataset=PAIRS,
                            peft_config=lora).ref_model is None  # the policy with its adapters off
    precomputed = config(plait.DPOConfig, tmp_path, precompute_ref_log_probs=True)
    assert plait.DPOTrainer(model, args=precomputed, train_dataset=PAIRS).ref_model is None
    assert isinstance(plait.GRPOTrainer(model, reward_funcs=length, args=grpo(tmp_path, beta=0.1),
                                        train_dataset=PROMPTS).ref_model, torch.nn.Module)
    assert plait.GRPOTrainer(model, reward_funcs=length, args=grpo(tmp_path), train_dataset=PROMPTS).ref_model is None
    sft = plait.SFTTrainer(model, args=config(plait.SFTConfig, tmp_path), train_dataset=COMPLETIONS)
    assert not hasattr(sft, "ref_model")  # as TRL's SFTTrainer: no reference at all


def test_online_trainer_attributes_reflect_its_sampling_and_rewards(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    scorer = tiny_classifier(tokenizer)
    args = grpo(tmp_path, temperature=0.7, top_p=0.9, top_k=5, max_completion_length=6, eval_strategy="steps",
                eval_steps=1)
    evaluation = {"short": PROMPTS, "again": PROMPTS}
    trainer = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=[length, scorer], args=args, train_dataset=PROMPTS,
                                eval_dataset=evaluation, reward_processing_classes=[None, tokenizer])
    generation = trainer.generation_config
    assert isinstance(generation, GenerationConfig)
    assert (generation.temperature, generation.top_p, generation.top_k, generation.max_new_tokens, generation.do_sample) == (
        0.7, 0.9, 5, 6, True)
    assert trainer.use_vllm is False and trainer.aux_loss_enabled is False
    assert trainer.reward_processing_classes == [None, tokenizer]
    # TRL's GRPO/RLOO keep eval_dataset as given; evaluation reads its prepared rows
    assert trainer.eval_dataset is evaluation and trainer.eval_dataset["short"] is PROMPTS
    metrics = trainer.evaluate()
    assert metrics["eval_rewards/length/mean"] > 0 and {"eval_short_loss", "eval_again_loss"} <= set(metrics)
    assert trainer.evaluate(eval_dataset=PROMPTS)["eval_rewards/length/mean"] > 0


def test_a_reward_model_folder_gives_its_own_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    tiny_classifier(tokenizer).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    trainer = plait.RLOOTrainer(str(tiny_model_path()), reward_funcs=[str(tmp_path / "rm"), length],
                                args=config(plait.RLOOConfig, tmp_path, num_generations=2, max_completion_length=4),
                                train_dataset=PROMPTS)
    folder_tokenizer, none = trainer.reward_processing_classes
    assert none is None and folder_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert trainer.eval_dataset is None


def test_aux_loss_is_enabled_exactly_for_a_mixture_of_experts_model(tmp_path):
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    moe = MixtralForCausalLM(MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.02,
        pad_token_id=tokenizer.pad_token_id))
    assert plait.SFTTrainer(moe, args=config(plait.SFTConfig, tmp_path), train_dataset=COMPLETIONS,
                            processing_class=tokenizer).aux_loss_enabled is True
    assert plait.SFTTrainer(moe, args=config(plait.SFTConfig, tmp_path, router_aux_loss_coef=0.0), train_dataset=COMPLETIONS,
                            processing_class=tokenizer).aux_loss_enabled is False


class Echo:
    """A model whose ``generate`` appends fixed completions: what ``generate_on_policy_outputs`` reads."""

    def __init__(self, completions):
        self.completions = torch.tensor(completions)

    def generate(self, input_ids, attention_mask, generation_config, return_dict_in_generate):
        assert return_dict_in_generate and attention_mask.shape == input_ids.shape
        return SimpleNamespace(sequences=torch.cat([input_ids, self.completions], dim=1))


@pytest.mark.parametrize("eos, kept", [(7, [[1, 1, 0, 0], [1, 1, 1, 1]]),  # the first EOS is kept, what follows is not
                                       ([7, 8], [[1, 1, 0, 0], [1, 1, 0, 0]]),  # any of several stop tokens
                                       (None, [[1, 1, 1, 1], [1, 1, 1, 1]])])  # no EOS id: every sampled token
def test_generate_on_policy_outputs_masks_after_the_first_eos_and_the_prompt(eos, kept):
    from transformers import GenerationConfig

    inputs = {"prompts": torch.tensor([[0, 5, 6], [4, 5, 6]]), "prompt_attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    model = Echo([[9, 7, 9, 7], [9, 8, 9, 9]])
    ids, mask, labels = plait.GKDTrainer.generate_on_policy_outputs(model, inputs, GenerationConfig(eos_token_id=eos))
    assert ids.tolist() == [[0, 5, 6, 9, 7, 9, 7], [4, 5, 6, 9, 8, 9, 9]]
    assert mask.tolist() == [[0, 1, 1, *kept[0]], [1, 1, 1, *kept[1]]]
    assert labels.tolist() == [[-100] * 3 + [t if m else -100 for t, m in zip(row[3:], k)] for row, k in zip(ids.tolist(), kept)]


# -- a row's tools as JSON text and its chat_template_kwargs reach the tokenised rows (SFT, DPO, KTO) --------------

WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def loud_tokenizer():
    """The tiny tokenizer with a template that reads a variable: ``loud`` opens the text with LOUD."""
    from transformers import AutoTokenizer

    from plait.testing.tiny_model import chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    tokenizer.chat_template = "{%- if loud -%}{{- 'LOUD ' -}}{%- endif -%}" + chat_template()
    return tokenizer


def rows_with_rendering(columns: dict) -> Dataset:
    """Two rows of ``columns``: the first quiet with its tools as JSON text, the second loud without tools."""
    return Dataset.from_list([{**columns, "tools": json.dumps([WEATHER]), "chat_template_kwargs": {"loud": False}},
                              {**columns, "tools": "[]", "chat_template_kwargs": {"loud": True}}])


@pytest.mark.parametrize("method, columns, sequences", [
    ("sft", {"messages": [user("Rain?"), assistant(" Yes.")]}, [("input_ids",)]),
    ("dpo", {"prompt": [user("Rain?")], "chosen": [assistant(" Yes.")], "rejected": [assistant(" No.")]},
     [("prompt_ids", "chosen_ids"), ("prompt_ids", "rejected_ids")]),
    ("kto", {"prompt": [user("Rain?")], "completion": [assistant(" Yes.")], "label": True},
     [("prompt_ids", "completion_ids")]),
])
def test_a_rows_json_tools_and_template_kwargs_reach_its_tokens(tmp_path, method, columns, sequences):
    tokenizer = loud_tokenizer()
    record = plait.default_plugins().methods.get(method, family="method").obj
    args = config(record.config, tmp_path, **({"desirable_weight": 1.0} if method == "kto" else {}))
    trainer = record.trainer(str(tiny_model_path()), args=args, train_dataset=rows_with_rendering(columns),
                             processing_class=tokenizer)
    for row, (tools, loud) in zip(trainer.train_dataset, [([WEATHER], False), (None, True)]):
        for keys, completion in zip(sequences, ("chosen", "rejected") if method == "dpo" else (None,)):
            messages = columns.get("messages") or columns["prompt"] + columns[completion or "completion"]
            expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, loud=loud)
            assert tokenizer.decode([t for key in keys for t in row[key]]) == expected


# -- TRL's names a script imports: prepare_multimodal_messages, DataCollatorForVisionLanguageModeling, prepare_deepspeed


def test_prepare_multimodal_messages_places_images_as_trl():
    chatted = [{"role": "system", "content": "Be brief."}, user("Colour?"), assistant("Red."), user("Sure?")]
    assert plait.prepare_multimodal_messages(chatted, ["A", "B"]) == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image", "image": "A"}, {"type": "image", "image": "B"},
                                     {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}]}]
    assert chatted[1] == user("Colour?")  # the given messages are left as they are
    placed = [{"role": "user", "content": [{"type": "image", "image": "X"}, {"type": "image"}]}]
    assert plait.prepare_multimodal_messages(placed, ["Y"])[0]["content"] == [{"type": "image", "image": "X"},
                                                                              {"type": "image", "image": "Y"}]
    with pytest.raises(plait.PlaitError, match="2 images for 3 image parts"):  # TRL's count: parts already there too
        plait.prepare_multimodal_messages([{"role": "user", "content": [{"type": "image"}]}, user("b")], ["A", "B"])


def test_vision_language_collator_gives_trls_batch(tmp_path):
    from PIL import Image
    from transformers import AutoProcessor

    from plait.testing.tiny_vlm import tiny_vlm_path

    processor = AutoProcessor.from_pretrained(tiny_vlm_path())
    red, blue = Image.new("RGB", (32, 32), (220, 30, 30)), Image.new("RGB", (32, 32), (30, 60, 220))
    rows = [{"images": [red], "messages": [user("Colour?"), assistant("Red.")]},
            {"image": blue, "messages": [user("What colour is it?"), assistant("Blue.")]}]
    batch = plait.DataCollatorForVisionLanguageModeling(processor)([dict(row) for row in rows])
    # what TRL's collator computes: the processor's own template over the messages with their images placed
    expected = processor.apply_chat_template(
        [plait.prepare_multimodal_messages(row["messages"], row.get("images") or [row["image"]]) for row in rows],
        tokenize=True, return_dict=True, return_tensors="pt", processor_kwargs={"padding": True, "padding_side": "right"})
    assert sorted(batch) == ["attention_mask", "input_ids", "labels", "pixel_values"]
    for key in ("input_ids", "attention_mask", "pixel_values"):
        torch.testing.assert_close(batch[key], expected[key])
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    kept = (expected["attention_mask"] == 1) & (expected["input_ids"] != image_token)  # plait: no loss on image tokens
    assert batch["labels"].tolist() == expected["input_ids"].masked_fill(~kept, -100).tolist()

    completion = {"images": [red], "prompt": [user("Colour?")], "completion": [assistant("Red.")]}
    only = plait.DataCollatorForVisionLanguageModeling(processor, completion_only_loss=True)([completion])
    assert processor.tokenizer.decode(only["labels"][0][only["labels"][0] != -100]) == "Red.<|im_end|>\n"
    with pytest.raises(plait.PlaitError, match="max_length=20 cuts into an example's image tokens"):
        plait.DataCollatorForVisionLanguageModeling(processor, max_length=20)([dict(rows[0])])


def test_prepare_deepspeed_gives_deepspeed_an_evaluation_config(monkeypatch):
    seen = {}

    class Engine:
        def eval(self):
            seen["eval"] = True

    def initialize(model, config):
        seen["config"] = config
        return Engine(), None, None, None

    monkeypatch.setitem(__import__("sys").modules, "deepspeed", SimpleNamespace(initialize=initialize))
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=8))
    training = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}, "train_batch_size": 4,
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=training)))
    assert isinstance(plait.prepare_deepspeed(model, accelerator), Engine) and seen["eval"]
    assert seen["config"] == {"train_batch_size": 4, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}, "reduce_bucket_size": 64, "stage3_prefetch_bucket_size": 57.6,
        "stage3_param_persistence_threshold": 80}}
    assert "optimizer" in training  # the run's own config is untouched
    training["zero_optimization"]["stage"] = 2
    plait.prepare_deepspeed(model, accelerator)
    assert seen["config"]["zero_optimization"] == {"stage": 0, "offload_param": {"device": "cpu"}}
    without = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None))
    with pytest.raises(plait.PlaitError, match="without DeepSpeed"):
        plait.prepare_deepspeed(model, without)


def test_trls_module_paths_import_from_plait():
    """``from trl.trainer.sft_trainer import X`` and ``from trl.models import X`` port by renaming trl to plait."""
    from plait.models import create_reference_model, prepare_deepspeed
    from plait.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer
    from plait.trainer.kto_trainer import DataCollatorForUnpairedPreference
    from plait.trainer.sft_trainer import DataCollatorForLanguageModeling, DataCollatorForVisionLanguageModeling

    assert (DataCollatorForLanguageModeling, DataCollatorForVisionLanguageModeling, DataCollatorForPreference,
            DataCollatorForUnpairedPreference, DPOTrainer, prepare_deepspeed, create_reference_model) == (
        plait.DataCollatorForLanguageModeling, plait.DataCollatorForVisionLanguageModeling,
        plait.DataCollatorForPreference, plait.DataCollatorForUnpairedPreference, plait.DPOTrainer,
        plait.prepare_deepspeed, plait.create_reference_model)
    assert plait.trainer.grpo_trainer.GRPOConfig is plait.GRPOConfig
    with pytest.raises(ImportError, match="DataCollatorWithPadding"):
        from plait.trainer.dpo_trainer import DataCollatorWithPadding  # noqa: F401 - not a name TRL's module has


def test_vision_preference_collators_give_trls_batches():
    from PIL import Image
    from transformers import AutoProcessor

    from plait.testing.tiny_vlm import tiny_vlm_path
    from plait.trainer.dpo_trainer import DataCollatorForVisionPreference
    from plait.trainer.kto_trainer import DataCollatorForVisionUnpairedPreference

    processor = AutoProcessor.from_pretrained(tiny_vlm_path())
    red, blue = Image.new("RGB", (32, 32), (220, 30, 30)), Image.new("RGB", (32, 32), (30, 60, 220))
    prompts = [[user("Colour?")], [user("What colour is it?")]]

    def check(batch, rows):
        """Each row: the processor's own rendering of prompt + completion with its image, completion_mask on the
        completion, and the rows' images in order (what TRL 1.16's collators give on the same rows)."""
        for i, (prompt, completion, image) in enumerate(rows):
            messages = plait.prepare_multimodal_messages(prompt, [image]) + [assistant(completion)]
            expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            expected = expected[0] if isinstance(expected[0], list) else expected
            kept = batch["attention_mask"][i].bool()
            assert batch["input_ids"][i][kept].tolist() == expected
            completion_ids = batch["input_ids"][i][batch["completion_mask"][i].bool()]
            assert processor.tokenizer.decode(completion_ids) == completion + "<|im_end|>\n"
        pixels = processor.image_processor(images=[image for *_, image in rows], return_tensors="pt")["pixel_values"]
        torch.testing.assert_close(batch["pixel_values"], pixels)

    pairs = [{"images": [red], "prompt": prompts[0], "chosen": [assistant("Red.")], "rejected": [assistant("Green.")]},
             {"image": blue, "prompt": prompts[1], "chosen": [assistant("Blue.")], "rejected": [assistant("No.")]}]
    batch = DataCollatorForVisionPreference(processor)(pairs)
    assert sorted(batch) == ["attention_mask", "completion_mask", "input_ids", "pixel_values"]
    check(batch, [(prompts[0], "Red.", red), (prompts[1], "Blue.", blue), (prompts[0], "Green.", red),
                  (prompts[1], "No.", blue)])

    unpaired = [{"images": [red], "prompt": prompts[0], "completion": [assistant("Red.")], "label": True},
                {"images": [blue], "prompt": prompts[1], "completion": [assistant("It is blue.")], "label": False}]
    batch = DataCollatorForVisionUnpairedPreference(processor)(unpaired)
    assert batch["label"].tolist() == [True, False]
    check(batch, [(prompts[0], "Red.", red), (prompts[1], "It is blue.", blue)])
    mismatched = {key.removeprefix("KL_"): value for key, value in batch.items() if key.startswith("KL_")}
    check({**mismatched, "pixel_values": batch["pixel_values"]},  # each prompt with the previous row's completion
          [(prompts[0], "It is blue.", red), (prompts[1], "Red.", blue)])
    assert not any(key.startswith("KL_") for key in DataCollatorForVisionUnpairedPreference(processor, calculate_kl=False)(unpaired))
