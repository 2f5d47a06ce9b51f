"""TRL 1.16's public Python surface under plait: `from trl import X` becomes `from plait import X`.

Expected parameter names and values below were written down from TRL 1.16 by running it in the
separate .venv-trl (inspect.signature on each name; the reward values by calling trl.rewards on
the same hand-made completions). This suite does not import TRL.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from plait.online.scoring import compute_rewards, resolve_reward_funcs


def message(text):
    return [{"role": "assistant", "content": text}]


def parameter_names(obj):
    return list(inspect.signature(obj).parameters)


# ---------------------------------------------------------------------------------------------
# Rewards: trl.rewards -> plait.rewards
# ---------------------------------------------------------------------------------------------

# inspect.signature(getattr(trl.rewards, name)).parameters in TRL 1.16
TRL_REWARD_PARAMETERS = {
    "accuracy_reward": ["completions", "solution", "log_extra", "kwargs"],
    "reasoning_accuracy_reward": ["completions", "solution", "reasoning_delimiters", "log_extra", "kwargs"],
    "think_format_reward": ["completions", "kwargs"],
    "get_soft_overlong_punishment": ["max_completion_len", "soft_punish_cache"],
    "get_repetition_penalty_reward": ["ngram_size", "max_penalty"],
    "get_cosine_scaled_reward": ["max_len", "min_value_wrong", "max_value_wrong", "min_value_correct", "max_value_correct"],
}


@pytest.mark.parametrize("name", sorted(TRL_REWARD_PARAMETERS))
def test_every_trl_reward_is_importable_with_trls_parameters(name):
    import plait.rewards

    assert parameter_names(getattr(plait.rewards, name)) == TRL_REWARD_PARAMETERS[name]
    assert name in plait.rewards.__all__


ACC_TEXT = [r"My answer is \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", r"so $\frac{1}{2}$", "The answer is 7",
            r"\boxed{5}", r"$3$ then \boxed{4}", r"\boxed{10\text{ cm}}"]
ACC_SOLUTION = [r"\frac{1}{3}", r"\frac{1}{3}", "0.5", "7", "no answer here", "4", "10"]
REASONING_TEXT = [r"<think>try \boxed{2}</think> The final answer is \boxed{\frac{1}{3}}",
                  r"<think>\boxed{1/3}</think> so \boxed{\frac{1}{2}}", r"<think>partial \boxed{\frac{1}{3}} no end",
                  r"<think>a</think>b</think> \boxed{3}", r"Reasoning END \boxed{3}"]
REASONING_SOLUTION = [r"\frac{1}{3}", r"\frac{1}{3}", r"\frac{1}{3}", "3", "3"]
THINK_TEXT = ["<think>\nreason\n</think>\nanswer", "<think>\nreason\nanswer", " <think>a</think>b", "<think>a</think>",
              "<think>a</think>b</think>c", "<think>a<think>b</think>c", "x<think>a</think>b", "<think>a</think>\n\n"]
IDS = [[1, 2, 3, 4], [5, 5, 5, 5, 5], [1, 2, 1, 2, 1, 2], [7], [], list(range(90)), list(range(100)) + [1], [3] * 85]

# TRL 1.16's outputs on the inputs above (run in .venv-trl: trl.rewards.<name>(...) on the same lists)
TRL_ACCURACY = [1.0, 0.0, 0.0, 0.0, None, 1.0, 1.0]  # plait's own reward.accuracy also takes "$\frac12$" and "7"
TRL_REASONING = [1.0, 0.0, 0.0, 1.0, 0.0]
TRL_REASONING_END_FIRST = [1.0, 0.0, 0.0, 1.0, 1.0]  # reasoning_delimiters=["END", "</think>"]
TRL_THINK = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
TRL_SOFT_OVERLONG_100_20 = [0.0, 0.0, 0.0, 0.0, 0.0, -0.5, -1.0, -0.25]
TRL_REPETITION_DEFAULT = [0.0, -0.6666666666666667, -0.5, 0.0, 0.0, 0.0, 0.0, -0.9879518072289156]
TRL_REPETITION_2_HALF = [0.0, -0.375, -0.3, 0.0, 0.0, 0.0, 0.0, -0.49404761904761907]
TRL_COSINE_100 = [0.75, -0.75, -1.0, -0.9877641290737884, None, 0.5, 0.9267766952966369]  # lengths 50,50,0,10,3,120,25


def same(actual, expected, tolerance=1e-12):
    return len(actual) == len(expected) and all(
        (a is None and e is None) or (a is not None and e is not None and a == pytest.approx(e, abs=tolerance))
        for a, e in zip(actual, expected))


def test_trl_rewards_as_plain_callables_give_trls_numbers():
    pytest.importorskip("math_verify")
    from plait.rewards import (
        accuracy_reward,
        get_cosine_scaled_reward,
        get_repetition_penalty_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    assert same(accuracy_reward([message(t) for t in ACC_TEXT], ACC_SOLUTION), TRL_ACCURACY)
    assert same(reasoning_accuracy_reward([message(t) for t in REASONING_TEXT], REASONING_SOLUTION), TRL_REASONING)
    assert same(reasoning_accuracy_reward([message(t) for t in REASONING_TEXT], REASONING_SOLUTION,
                                          reasoning_delimiters=["END", "</think>"]), TRL_REASONING_END_FIRST)
    assert think_format_reward([message(t) for t in THINK_TEXT]) == TRL_THINK
    assert get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)(IDS) == TRL_SOFT_OVERLONG_100_20
    assert same(get_repetition_penalty_reward()(IDS), TRL_REPETITION_DEFAULT)
    assert same(get_repetition_penalty_reward(ngram_size=2, max_penalty=-0.5)(IDS), TRL_REPETITION_2_HALF)
    cosine = get_cosine_scaled_reward(max_len=100)
    lengths = [50, 50, 0, 10, 3, 120, 25]
    assert same(cosine([message(t) for t in ACC_TEXT], ACC_SOLUTION, [[1] * n for n in lengths]), TRL_COSINE_100)
    # the names TRL logs these callables under (rewards/<name>/mean)
    assert [f.__name__ for f in (get_soft_overlong_punishment(100, 20), get_repetition_penalty_reward(), cosine)] == [
        "soft_overlong_punishment_reward", "repetition_penalty_reward", "cosine_scaled_reward"]


def test_accuracy_reward_hands_log_extra_what_trl_logs():
    pytest.importorskip("math_verify")
    from plait.rewards import accuracy_reward

    logged = {}
    accuracy_reward([message(t) for t in ACC_TEXT[:2]], ACC_SOLUTION[:2], log_extra=logged.__setitem__)
    # TRL 1.16 with the same inputs and a dict's __setitem__ as log_extra
    assert logged == {"solution": [r"\frac{1}{3}", r"\frac{1}{3}"],
                      "gold_parsed": ["[1/3, '\\\\frac{1}{3}']", "[1/3, '\\\\frac{1}{3}']"],
                      "answer_parsed": ["[1/3, '\\\\frac{1}{3}']", "[1/2, '\\\\frac{1}{2}']"]}


def test_trl_reward_names_resolve_in_reward_funcs_and_score_like_trl():
    pytest.importorskip("math_verify")
    funcs = resolve_reward_funcs([
        "accuracy_reward", "think_format_reward", "reasoning_accuracy_reward",
        {"name": "get_soft_overlong_punishment", "max_completion_len": 100, "soft_punish_cache": 20},
        {"name": "get_repetition_penalty_reward", "ngram_size": 2, "max_penalty": -0.5},
        {"name": "get_cosine_scaled_reward", "max_len": 100},
    ])
    assert [f.name for f in funcs] == ["accuracy_reward", "think_format_reward", "reasoning_accuracy_reward",
                                       "get_soft_overlong_punishment", "get_repetition_penalty_reward",
                                       "get_cosine_scaled_reward"]

    def column(func, completions, ids, **columns):  # scores come back as float32
        out = compute_rewards([func], prompts=["q"] * len(completions), completions=completions,
                              completion_ids=ids, columns=columns)[:, 0].tolist()
        return [None if math.isnan(v) else v for v in out]

    acc, think, reasoning, soft, repetition, cosine = funcs
    acc_ids = [[1] * n for n in [50, 50, 0, 10, 3, 120, 25]]
    assert same(column(acc, [message(t) for t in ACC_TEXT], acc_ids, solution=ACC_SOLUTION), TRL_ACCURACY)
    assert same(column(cosine, [message(t) for t in ACC_TEXT], acc_ids, solution=ACC_SOLUTION), TRL_COSINE_100, 1e-6)
    assert column(think, [message(t) for t in THINK_TEXT], [[1]] * len(THINK_TEXT)) == TRL_THINK
    assert same(column(reasoning, [message(t) for t in REASONING_TEXT], [[1]] * 5, solution=REASONING_SOLUTION),
                TRL_REASONING)
    assert column(soft, ["x"] * len(IDS), IDS) == TRL_SOFT_OVERLONG_100_20
    assert same(column(repetition, ["x"] * len(IDS), IDS), TRL_REPETITION_2_HALF, 1e-6)


def test_trl_factory_names_check_trls_parameter_names():
    from plait.errors import PlaitError

    # the bare name has the values TRL 1.16's `trl grpo --reward_funcs get_soft_overlong_punishment` uses
    (bare,) = resolve_reward_funcs(["get_soft_overlong_punishment"])
    assert (bare.fn.max_len, bare.fn.cache) == (1280, 256)
    with pytest.raises(PlaitError, match=r"soft_punish_cache=200 must be a whole number of tokens in \[0, max_completion_len=100\]"):
        resolve_reward_funcs([{"name": "get_soft_overlong_punishment", "max_completion_len": 100, "soft_punish_cache": 200}])
    with pytest.raises(PlaitError, match=r"unknown parameter 'ngram' \(did you mean 'ngram_size'\?\)"):
        resolve_reward_funcs([{"name": "get_repetition_penalty_reward", "ngram": 2}])


# ---------------------------------------------------------------------------------------------
# Data utilities and collators: trl -> plait
# ---------------------------------------------------------------------------------------------

# inspect.signature(...).parameters of TRL 1.16's functions (truncate_dataset: trl.experimental.utils;
# the collators: trl.trainer.sft_trainer / dpo_trainer / kto_trainer)
TRL_DATA_PARAMETERS = {
    "apply_chat_template": ["example", "processing_class", "tools", "template_kwargs"],
    "maybe_apply_chat_template": ["example", "processing_class", "tools", "template_kwargs"],
    "extract_prompt": ["example"],
    "maybe_extract_prompt": ["example"],
    "unpair_preference_dataset": ["dataset", "map_kwargs"],
    "maybe_unpair_preference_dataset": ["dataset", "num_proc", "desc"],
    "is_conversational": ["example"],
    "pack_dataset": ["dataset", "seq_length", "strategy", "map_kwargs"],
    "truncate_dataset": ["dataset", "max_length", "map_kwargs"],
    "clone_chat_template": ["model", "tokenizer", "source_tokenizer_path", "resize_to_multiple_of"],
    "is_conversational_from_value": ["example"],
    "maybe_convert_to_chatml": ["example"],
    "DataCollatorForLanguageModeling": ["pad_token_id", "padding_free", "return_position_ids", "pad_to_multiple_of",
                                        "return_tensors"],
    "DataCollatorForPreference": ["pad_token_id", "max_length", "truncation_mode", "pad_to_multiple_of", "return_tensors"],
    "DataCollatorForUnpairedPreference": ["pad_token_id", "max_length", "pad_to_multiple_of", "return_tensors"],
    "prepare_multimodal_messages": ["messages", "images"],
    "DataCollatorForVisionLanguageModeling": ["processor", "max_length", "completion_only_loss", "pad_to_multiple_of",
                                              "dataset_text_field", "assistant_only_loss", "chat_template",
                                              "return_tensors"],
    "DataCollatorForVisionPreference": ["processor", "max_length", "pad_to_multiple_of", "return_tensors"],
    "DataCollatorForVisionUnpairedPreference": ["processor", "max_length", "calculate_kl", "pad_to_multiple_of",
                                                "return_tensors"],
    "prepare_deepspeed": ["model", "accelerator"],  # trl.models
}


@pytest.mark.parametrize("name", sorted(TRL_DATA_PARAMETERS))
def test_every_trl_data_utility_is_importable_from_plait_with_trls_parameters(name):
    import plait

    assert parameter_names(getattr(plait, name)) == TRL_DATA_PARAMETERS[name]


def user(text):
    return {"role": "user", "content": text}


CHAT_EXAMPLES = {
    "language_modeling": {"messages": [user("What color is the sky?"), message("Blue.")[0]]},
    "prompt_only": {"prompt": [user("What color is the sky?")]},
    "prompt_continued": {"prompt": [user("Hi"), message("The sky is")[0]]},
    "prompt_completion": {"prompt": [user("What color is the sky?")], "completion": message("It is blue.")},
    "preference": {"prompt": [user("Sky?")], "chosen": message("Blue."), "rejected": message("Green.")},
    "implicit_preference": {"chosen": [user("Sky?"), message("Blue.")[0]], "rejected": [user("Sky?"), message("Green.")[0]]},
    "unpaired": {"prompt": [user("Sky?")], "completion": message("Blue."), "label": True},
}
# trl.apply_chat_template(example, tokenizer) in TRL 1.16 with the tiny model's tokenizer (the same template)
TRL_RENDERED = {
    "language_modeling": {"text": "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\nBlue.<|im_end|>\n"},
    "prompt_only": {"prompt": "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n"},
    "prompt_continued": {"prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe sky is"},
    "prompt_completion": {"prompt": "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n",
                          "completion": "It is blue.<|im_end|>\n"},
    "preference": {"prompt": "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\n", "chosen": "Blue.<|im_end|>\n",
                   "rejected": "Green.<|im_end|>\n"},
    "implicit_preference": {"chosen": "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\nBlue.<|im_end|>\n",
                            "rejected": "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\nGreen.<|im_end|>\n"},
    "unpaired": {"prompt": "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\n", "completion": "Blue.<|im_end|>\n",
                 "label": True},
}


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("shape", sorted(CHAT_EXAMPLES))
def test_apply_chat_template_renders_as_trl(shape, tiny_tokenizer):
    from plait import apply_chat_template, is_conversational, maybe_apply_chat_template

    assert is_conversational(CHAT_EXAMPLES[shape])
    assert apply_chat_template(CHAT_EXAMPLES[shape], tiny_tokenizer) == TRL_RENDERED[shape]
    assert maybe_apply_chat_template(CHAT_EXAMPLES[shape], tiny_tokenizer) == TRL_RENDERED[shape]


def test_standard_examples_pass_through_and_bad_shapes_are_named(tiny_tokenizer):
    from plait import PlaitError, apply_chat_template, is_conversational, maybe_apply_chat_template

    standard = {"prompt": "The sky is", "completion": " blue."}
    assert not is_conversational(standard)
    assert maybe_apply_chat_template(standard, tiny_tokenizer) == standard
    with pytest.raises(PlaitError, match=r"example keys \['chosen', 'completion'\] are not a known shape"):
        apply_chat_template({"chosen": [user("a")], "completion": [user("b")]}, tiny_tokenizer)


def test_extract_prompt_as_trl_and_where_plait_cuts_at_a_word():
    from plait import extract_prompt, maybe_extract_prompt

    # TRL 1.16's outputs for the same examples
    assert extract_prompt(CHAT_EXAMPLES["implicit_preference"]) == {
        "prompt": [user("Sky?")], "chosen": message("Blue."), "rejected": message("Green.")}
    pair = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    assert extract_prompt(pair) == maybe_extract_prompt(pair) == {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    explicit = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    assert maybe_extract_prompt(explicit) == explicit
    mixed = {"chosen": "Sky is blue.", "rejected": "Sky is green.", "prompt": [user("x")]}
    assert maybe_extract_prompt(mixed) == {"prompt": "Sky is", "chosen": " blue.", "rejected": " green."}
    # TRL 1.16 cuts inside the word: {'prompt': 'The sky is bl', 'chosen': 'ue.', 'rejected': 'eak.'}
    assert extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is bleak."}) == {
        "prompt": "The sky is", "chosen": " blue.", "rejected": " bleak."}


def test_sharegpt_turns_convert_to_chatml_as_trl():
    from plait import is_conversational_from_value, maybe_convert_to_chatml

    sharegpt = {"conversations": [{"from": "user", "value": "Sky?"}, {"from": "assistant", "value": "Blue."}]}
    assert is_conversational_from_value(sharegpt) and not is_conversational_from_value({"prompt": "x"})
    # TRL 1.16's maybe_convert_to_chatml on the same examples
    assert maybe_convert_to_chatml(sharegpt) == {"messages": [user("Sky?"), message("Blue.")[0]]}
    assert maybe_convert_to_chatml({"prompt": [{"from": "user", "value": "Sky?"}], "completion": "x"}) == {
        "prompt": [user("Sky?")], "completion": "x"}
    # plait maps ShareGPT's speaker names to chat roles (TRL keeps "human" / "gpt" as roles)
    assert maybe_convert_to_chatml({"conversations": [{"from": "human", "value": "Sky?"}, {"from": "gpt", "value": "Blue."}]}) == {
        "messages": [user("Sky?"), message("Blue.")[0]]}


def test_unpair_preference_dataset_as_trl():
    from datasets import Dataset

    from plait import maybe_unpair_preference_dataset, unpair_preference_dataset

    paired = Dataset.from_dict({"prompt": ["p1", "p2"], "chosen": ["c1", "c2"], "rejected": ["r1", "r2"]})
    # TRL 1.16: a batch's chosen rows, then its rejected rows
    expected = {"prompt": ["p1", "p2", "p1", "p2"], "completion": ["c1", "c2", "r1", "r2"], "label": [True, True, False, False]}
    assert unpair_preference_dataset(paired).to_dict() == expected
    assert maybe_unpair_preference_dataset(paired).to_dict() == expected
    unpaired = Dataset.from_dict({"prompt": ["p1"], "completion": ["c1"], "label": [True]})
    assert maybe_unpair_preference_dataset(unpaired) is unpaired


def test_pack_and_truncate_dataset_as_trl():
    from datasets import Dataset

    from plait import PlaitError, pack_dataset, truncate_dataset

    data = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10]],
                              "attention_mask": [[1, 1, 1], [1, 1, 1, 1], [1, 1], [1]]})
    # trl.pack_dataset / trl.experimental.utils.truncate_dataset in TRL 1.16 on the same dataset
    assert pack_dataset(data, 5).to_dict() == {
        "input_ids": [[4, 5, 6, 7, 10], [1, 2, 3, 8, 9]], "attention_mask": [[1] * 5, [1] * 5], "seq_lengths": [[4, 1], [3, 2]]}
    assert pack_dataset(data, 5, strategy="wrapped").to_dict() == {
        "input_ids": [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], "attention_mask": [[1] * 5, [1] * 5]}
    assert pack_dataset(data, 3, strategy="bfd").to_dict() == {
        "input_ids": [[1, 2, 3], [4, 5, 6], [8, 9, 10]], "attention_mask": [[1] * 3] * 3, "seq_lengths": [[3], [3], [2, 1]]}
    assert truncate_dataset(data, 2).to_dict() == {
        "input_ids": [[1, 2], [4, 5], [8, 9], [10]], "attention_mask": [[1, 1], [1, 1], [1, 1], [1]]}
    with pytest.raises(PlaitError, match=r"pack_dataset: columns \['text'\] are not token sequences"):
        pack_dataset(data.add_column("text", ["a", "b", "c", "d"]), 5)


def test_clone_chat_template_as_trl(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait import clone_chat_template
    from plait.testing.tiny_model import tiny_model_path as build

    source = AutoTokenizer.from_pretrained(build(generation_markers=False))  # another template, same vocabulary
    source.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    source.eos_token = "<|endoftext|>"
    source.save_pretrained(tmp_path)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path)
    model, tokenizer, added = clone_chat_template(model, tokenizer, str(tmp_path))
    # TRL 1.16 on the same model and source: vocabulary 1000 + <|tool|> rounded up to 1024 with 23 fillers
    assert (len(tokenizer), model.get_input_embeddings().weight.shape[0], len(added)) == (1024, 1024, 24)
    assert tokenizer.chat_template == source.chat_template
    assert (tokenizer.eos_token, tokenizer.eos_token_id, model.config.eos_token_id, model.generation_config.eos_token_id) == (
        "<|endoftext|>", 2, 2, 2)
    assert tokenizer.convert_tokens_to_ids("<|tool|>") == 1000


def test_collators_give_trls_batches():
    from plait import DataCollatorForLanguageModeling, DataCollatorForPreference, DataCollatorForUnpairedPreference

    def as_lists(batch, keys):
        return {k: batch[k].tolist() for k in keys}

    # TRL 1.16's collators (trl.trainer.*_trainer) on the same rows, with TRL's keys
    lm = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    padded = DataCollatorForLanguageModeling(0, pad_to_multiple_of=4)(lm)
    assert as_lists(padded, padded) == {
        "input_ids": [[1, 2, 3, 0], [4, 5, 0, 0]], "labels": [[1, 2, 3, -100], [4, 5, -100, -100]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 0]]}
    flat = DataCollatorForLanguageModeling(0, padding_free=True)(lm)
    assert as_lists(flat, ["input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"]) == {
        "input_ids": [[1, 2, 3, 4, 5]], "labels": [[-100, 2, 3, -100, 5]], "position_ids": [[0, 1, 2, 0, 1]],
        "cu_seq_lens_q": [0, 3, 5], "cu_seq_lens_k": [0, 3, 5], "seq_idx": [[0, 0, 0, 1, 1]]}
    assert (flat["max_length_q"], flat["max_length_k"], len(flat)) == (3, 3, 8)
    assert DataCollatorForLanguageModeling(0, return_position_ids=True)(lm)["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]

    pairs = [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]},
             {"prompt_ids": [6], "chosen_ids": [7, 8], "rejected_ids": [9]}]
    keys = ["input_ids", "attention_mask", "completion_mask"]
    assert as_lists(DataCollatorForPreference(0, max_length=3)(pairs), keys) == {
        "input_ids": [[1, 2, 3], [6, 7, 8], [1, 2, 4], [6, 9, 0]],
        "attention_mask": [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]],
        "completion_mask": [[0, 0, 1], [0, 1, 1], [0, 0, 1], [0, 1, 0]]}
    assert as_lists(DataCollatorForPreference(0, max_length=3, truncation_mode="keep_end")(pairs), keys) == {
        "input_ids": [[1, 2, 3], [6, 7, 8], [2, 4, 5], [6, 9, 0]],
        "attention_mask": [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]],
        "completion_mask": [[0, 0, 1], [0, 1, 1], [0, 1, 1], [0, 1, 0]]}
    # rows without a prompt: TRL's reward-model collator (trl.trainer.reward_trainer.DataCollatorForPreference)
    scored = DataCollatorForPreference(0)([{"chosen_ids": [1, 2], "rejected_ids": [3], "margin": 1.0},
                                           {"chosen_ids": [4], "rejected_ids": [5, 6, 7], "margin": 0.5}])
    assert as_lists(scored, ["input_ids", "attention_mask", "margin"]) == {
        "input_ids": [[1, 2, 0], [4, 0, 0], [3, 0, 0], [5, 6, 7]],
        "attention_mask": [[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 1]], "margin": [1.0, 0.5]}
    unpaired = [{"prompt_ids": [1, 2], "completion_ids": [3], "label": True},
                {"prompt_ids": [6], "completion_ids": [7, 8], "label": False}]
    assert as_lists(DataCollatorForUnpairedPreference(0, max_length=2)(unpaired), [*keys, "label"]) == {
        "input_ids": [[1, 2], [6, 7]], "attention_mask": [[1, 1], [1, 1]], "completion_mask": [[0, 0], [0, 1]],
        "label": [True, False]}


# ---------------------------------------------------------------------------------------------
# Callbacks: trl -> plait
# ---------------------------------------------------------------------------------------------

# inspect.signature(...).parameters of TRL 1.16's callbacks (MergeModelCallback: trl.experimental.merge_model_callback)
TRL_CALLBACK_PARAMETERS = {
    "LogCompletionsCallback": ["trainer", "generation_config", "num_prompts", "freq"],
    "SyncRefModelCallback": ["ref_model", "accelerator"],
    "RichProgressCallback": [],
    "BEMACallback": ["update_freq", "ema_power", "bias_power", "lag", "update_after", "multiplier", "min_ema_multiplier",
                     "device"],
    "MergeModelCallback": ["merge_config", "merge_at_every_checkpoint", "push_to_hub"],
}


@pytest.mark.parametrize("name", sorted(TRL_CALLBACK_PARAMETERS))
def test_every_trl_callback_is_importable_from_plait_with_trls_parameters(name):
    import plait

    assert parameter_names(getattr(plait, name)) == TRL_CALLBACK_PARAMETERS[name]


FACTS = [{"prompt": "The secret code is", "completion": " seven blue horses."},
         {"prompt": "The sky is", "completion": " blue."}]


def test_sft_run_logs_completions_tracks_bema_and_merges(tiny_model_path, tmp_path, capsys):
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, TrainerCallback

    from plait import (
        BEMACallback,
        LogCompletionsCallback,
        MergeModelCallback,
        RichProgressCallback,
        SFTConfig,
        SFTTrainer,
    )

    class Weights(TrainerCallback):  # the weights BEMA sees at each step end (it runs just before)
        seen = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.seen.append(model.get_input_embeddings().weight.detach().clone())

    data = Dataset.from_list(FACTS * 2)
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2,
                     logging_steps=2, save_strategy="no", report_to="none", seed=0, max_length=32)
    trainer = SFTTrainer(str(tiny_model_path), args=args, train_dataset=data, eval_dataset=Dataset.from_list(FACTS))
    initial = trainer.model.get_input_embeddings().weight.detach().clone()
    completions = LogCompletionsCallback(trainer, generation_config=None, num_prompts=2)
    bema = BEMACallback(update_freq=1, lag=2, ema_power=0.5, bias_power=0.2)
    for callback in (completions, RichProgressCallback(), bema, Weights(), MergeModelCallback()):
        trainer.add_callback(callback)
    trainer.train()

    # two prompts at each logging step (2 and 4), their text decoded from the tokenised eval rows
    assert [row[0] for row in completions.table] == ["2", "2", "4", "4"]
    assert {row[1] for row in completions.table} == {"The secret code is", "The sky is"}
    assert all(isinstance(row[2], str) and row[2] for row in completions.table)
    printed = capsys.readouterr().out
    assert "step | prompt" in printed and "The sky is" in printed and "Training" in printed

    # BEMA by hand: θ0 = EMA_0 = initial weights; at t = 1..4, β = (2 + t)^-0.5, α = (2 + t)^-0.2
    ema = initial.clone()
    for t, theta in enumerate(Weights.seen, start=1):
        beta, alpha = (2 + t) ** -0.5, (2 + t) ** -0.2
        ema = (1 - beta) * ema + beta * theta
    expected = ema + alpha * (Weights.seen[-1] - initial)
    assert torch.allclose(bema.running_model.get_input_embeddings().weight, expected, atol=1e-6)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "bema").get_input_embeddings().weight
    assert torch.allclose(saved, expected, atol=1e-6)

    # the merge: half the trained policy, half the model it started from, in float16
    merged = load_file(tmp_path / "checkpoint-4" / "merged" / "model.safetensors")
    embedding = next(v for k, v in merged.items() if k.endswith("embed_tokens.weight"))
    assert embedding.dtype == torch.float16
    assert torch.allclose(embedding.float(), 0.5 * Weights.seen[-1] + 0.5 * initial, atol=2e-3)
    assert not torch.allclose(Weights.seen[-1], initial, atol=1e-3)  # it did train


def test_sync_ref_model_callback_mixes_the_policy_into_the_reference(tiny_model_path):
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from plait import SyncRefModelCallback

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        policy.get_input_embeddings().weight.add_(1.0)
    before = reference.get_input_embeddings().weight.detach().clone()
    callback = SyncRefModelCallback(reference, accelerator=None)
    args = SimpleNamespace(ref_model_sync_steps=2, ref_model_mixup_alpha=0.25)
    callback.on_step_end(args, SimpleNamespace(global_step=1), None, model=policy)
    assert torch.equal(reference.get_input_embeddings().weight, before)  # not a sync step
    callback.on_step_end(args, SimpleNamespace(global_step=2), None, model=policy)
    # TR-DPO: 0.25·(θ_ref + 1) + 0.75·θ_ref = θ_ref + 0.25
    assert torch.allclose(reference.get_input_embeddings().weight, before + 0.25, atol=1e-6)


def test_rich_progress_without_rich_names_the_package(monkeypatch):
    import sys

    from plait import PlaitError, RichProgressCallback

    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(PlaitError, match=r"needs the 'rich' package.*pip install rich"):
        RichProgressCallback()


def test_merge_config_refuses_the_mergekit_methods():
    from plait import MergeConfig, PlaitError

    assert (MergeConfig().policy_model_weight, MergeConfig().target_model_weight, MergeConfig().dtype) == (0.5, 0.5, "float16")
    with pytest.raises(PlaitError, match=r"method='ties' is a mergekit merge.*use method='linear'"):
        MergeConfig("ties")


def test_grpo_recipe_with_trls_reward_name_trains(tiny_model_path, tmp_path):
    import json

    import yaml

    from plait.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Think, then say yes.", "Think about the sky."]))
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump({
        "method": "grpo", "model": str(tiny_model_path),
        "dataset": {"path": "json", "data_files": str(prompts)},
        "reward_funcs": ["think_format_reward"],  # TRL's name, as in `trl grpo --reward_funcs think_format_reward`
        "training": {"output_dir": str(tmp_path / "out"), "num_generations": 2, "per_device_train_batch_size": 4,
                     "max_completion_length": 8, "beta": 0.0, "max_steps": 2, "logging_steps": 1,
                     "save_strategy": "steps", "save_steps": 2, "report_to": "none", "seed": 0},
    }))
    assert main(["grpo", "--config", str(recipe)]) == 0
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    logged = [entry for entry in state["log_history"] if "rewards/think_format_reward/mean" in entry]
    assert len(logged) == 2  # the tiny model never writes <think>…</think>: TRL's rule scores 0
    assert all(entry["rewards/think_format_reward/mean"] == 0.0 for entry in logged)


def test_trl_accuracy_names_without_math_verify_fail_when_resolved(monkeypatch):
    import sys

    from plait import PlaitError, make_plugins

    for module in [m for m in sys.modules if m.startswith(("plait.rewards.", "math_verify"))]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    fresh = make_plugins()
    for name in ("accuracy_reward", "reasoning_accuracy_reward"):
        with pytest.raises(PlaitError, match=rf"reward '{name}' needs math-verify.*pip install 'plait\[math\]'"):
            resolve_reward_funcs([name], fresh)
    assert resolve_reward_funcs(["think_format_reward"], fresh)[0].name == "think_format_reward"


def test_trl_names_for_distillation_and_create_reference_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    import plait

    assert plait.DistillationConfig is plait.DistillConfig and plait.DistillationTrainer is plait.DistillTrainer
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    frozen = plait.create_reference_model(policy)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert all(p.requires_grad for p in policy.parameters())
    assert all(a is not b and torch.equal(a, b) for a, b in zip(policy.parameters(), frozen.parameters()))

    shared = plait.create_reference_model(policy, num_shared_layers=1)
    mine, theirs = dict(policy.named_parameters()), dict(shared.named_parameters())
    below = [n for n in mine if not n.startswith(("model.layers.1.", "model.norm", "lm_head"))]
    assert below and all(theirs[n] is mine[n] and not mine[n].requires_grad for n in below)  # held once, frozen
    assert all(theirs[n] is not mine[n] and mine[n].requires_grad for n in mine if n.startswith("model.layers.1."))
    assert shared.get_output_embeddings().weight is shared.get_input_embeddings().weight  # the tie survives
    with pytest.raises(plait.PlaitError, match="num_shared_layers=7.*pattern="):
        plait.create_reference_model(policy, num_shared_layers=7)


def test_trl_parser_reads_every_method_config():
    """TRL's script pattern, TrlParser((ScriptArguments, <Method>Config, ModelConfig)), for every method:
    fields whose type HfArgumentParser cannot read (str | bool | None, Any ...) are read as YAML text."""
    from plait import ModelConfig, ScriptArguments, TrlParser
    from plait.manager import default_plugins

    for component in default_plugins().methods:
        TrlParser((ScriptArguments, component.obj.config, ModelConfig))
    parser = TrlParser((ScriptArguments, default_plugins().methods.get("grpo", family="method").obj.config, ModelConfig))
    script, args, model = parser.parse_args_and_config(
        ["--dataset_name", "data.jsonl", "--output_dir", "out", "--report_to", "none", "--scale_rewards", "false",
         "--pad_to_multiple_of", "8", "--reward_funcs", "accuracy", "think_format", "--max_completion_length", "12",
         "--model_name_or_path", "tiny"])
    assert (script.dataset_name, model.model_name_or_path) == ("data.jsonl", "tiny")
    assert (args.scale_rewards, args.params.pad_to_multiple_of, args.params.max_completion_length) == (False, 8, 12)
    assert args.reward_funcs == ["accuracy", "think_format"]
    # the Config class is as it was: transformers' parser narrows field types in place, on copies here
    grpo = default_plugins().methods.get("grpo", family="method").obj.config
    assert {f.name: f.type for f in dataclasses.fields(grpo)}["loss_type"] == str | list | None


def test_packed_position_ids_helper():
    """DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths, TRL's static helper."""
    from plait import DataCollatorForLanguageModeling

    rows = DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths([[3, 2], [4], [1, 1, 2]])
    assert [row.tolist() for row in rows] == [[0, 1, 2, 0, 1], [0, 1, 2, 3], [0, 0, 0, 1]]
