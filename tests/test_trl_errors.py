"""TRL 1.16's refusals and acceptances that its own tests rely on (issue 36).

What TRL refuses is a one-line ``PlaitError`` (a ``ValueError``, as TRL's tests expect) raised before any
model loads, its wording carrying TRL's key phrase; what TRL accepts trains: plain ``TrainingArguments``, a
PEFT classifier as a reward model, evaluation with ``num_generations_eval``, a batch no reward can score.
"""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainingArguments

import plait
from plait.errors import PlaitError
from plait.testing.tiny_model import tiny_model_path

MISSING = "/nonexistent/model"  # a refusal that names it came before any load
PREFERENCE = [{"prompt": "The river", "chosen": " runs.", "rejected": " no"},
              {"prompt": "Python is", "chosen": " a language.", "rejected": " x"}]
UNPAIRED = [{"prompt": "The river", "completion": " runs.", "label": True},
            {"prompt": "Python is", "completion": " x", "label": False}]
PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "Python is", "The weather today")]
QUIET = dict(report_to=[], disable_tqdm=True, save_strategy="no", logging_steps=1, seed=0)


def low_tokens(completion_ids, **kwargs):
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]


def never_scores(completions, **kwargs):
    return [None] * len(completions)


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- what TRL refuses ------------------------------------------------------------------------------


@pytest.mark.parametrize("trainer, config, extra", [
    (plait.SFTTrainer, plait.SFTConfig, {}), (plait.DPOTrainer, plait.DPOConfig, {}),
    (plait.KTOTrainer, plait.KTOConfig, {}), (plait.RewardTrainer, plait.RewardConfig, {}),
    (plait.GRPOTrainer, plait.GRPOConfig, {"reward_funcs": low_tokens}),
    (plait.RLOOTrainer, plait.RLOOConfig, {"reward_funcs": low_tokens}),
])
def test_a_missing_train_dataset_is_refused_before_the_model_loads(tmp_path, trainer, config, extra):
    with pytest.raises(ValueError, match="`train_dataset` is required") as err:
        trainer(MISSING, args=config(output_dir=str(tmp_path), **QUIET), **extra)
    assert isinstance(err.value, PlaitError) and "\n" not in str(err.value)


class Counter:
    """A TRL-style environment: reset per episode, public methods as tools, get_reward."""

    def reset(self, **row) -> None:
        self.total = 0

    def add(self, amount: int) -> int:
        """Add to the counter.

        Args:
            amount: how much
        """
        self.total += amount
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


def test_an_environment_factory_needs_a_train_dataset_of_prompts_too(tmp_path):
    # TRL 1.16 fills in empty prompts for an environment whose reset() returns one; plait's environments are
    # reset with their dataset row, so the prompts come from the data
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        plait.GRPOTrainer(MISSING, args=plait.GRPOConfig(output_dir=str(tmp_path), **QUIET), environment_factory=Counter)


@pytest.mark.parametrize("trainer, config, rows", [(plait.DPOTrainer, plait.DPOConfig, PREFERENCE),
                                                   (plait.KTOTrainer, plait.KTOConfig, UNPAIRED)])
def test_a_reference_that_is_the_model_itself_is_refused(tmp_path, trainer, config, rows):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    with pytest.raises(ValueError, match="ref_model is the model being trained.*omit ref_model"):
        trainer(model, ref_model=model, args=config(output_dir=str(tmp_path), **QUIET), train_dataset=rows)


def test_a_reward_model_with_two_labels_is_refused_in_trls_words(tmp_path):
    args = plait.RewardConfig(output_dir=str(tmp_path), model_init_kwargs={"num_labels": 2}, **QUIET)
    with pytest.raises(ValueError, match=r"num_labels=2, but reward models require `num_labels=1`"):
        plait.RewardTrainer(str(tiny_model_path()), args=args, train_dataset=PREFERENCE)


# -- what TRL accepts ------------------------------------------------------------------------------


def test_plain_training_arguments_become_the_methods_config_and_train(tmp_path):
    defaults = plait.DPOConfig(output_dir=str(tmp_path))
    given = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-2, max_steps=2, per_device_train_batch_size=2,
                              gradient_accumulation_steps=1, **QUIET)
    t = plait.DPOTrainer(str(tiny_model_path()), args=given, train_dataset=PREFERENCE)
    assert type(t.args) is plait.DPOConfig
    assert (t.args.learning_rate, t.args.max_steps, t.args.output_dir) == (1e-2, 2, str(tmp_path))  # kept as given
    assert (t.args.beta, t.args.loss_type) == (defaults.beta, defaults.loss_type)  # the method's fields: defaults
    before = weights(t.model)
    t.train()  # its columns are not dropped by TrainingArguments' remove_unused_columns=True
    assert t.state.global_step == 2
    assert any(not torch.equal(before[n], p) for n, p in t.model.named_parameters())
    with pytest.raises(ValueError, match="args is a DPOConfig; pass a SFTConfig"):  # another method's fields: refused
        plait.SFTTrainer(MISSING, args=plait.DPOConfig(output_dir=str(tmp_path)), train_dataset=PROMPTS)


@pytest.fixture(scope="module")
def peft_reward_model(tmp_path_factory):
    """A tiny classifier saved with its tokenizer, and the same one wrapped in LoRA adapters (B ≠ 0)."""
    folder = tmp_path_factory.mktemp("reward")
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    model.config.pad_token_id = AutoTokenizer.from_pretrained(folder).pad_token_id
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return folder, peft


def test_a_peft_reward_model_scores_through_its_adapters_and_trains(tmp_path, peft_reward_model):
    folder, peft = peft_reward_model
    args = plait.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                            max_completion_length=4, max_steps=1, **QUIET)
    t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=peft, args=args, train_dataset=PROMPTS)
    prompts, completions = ["The river", "Python is"], [" runs.", " a language."]
    scored = t.reward_funcs[0](prompts=prompts, completions=completions)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer([p + c + tokenizer.eos_token for p, c in zip(prompts, completions)], padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        expected = peft(**batch).logits[:, 0].tolist()
        with peft.disable_adapter():
            without = peft(**batch).logits[:, 0].tolist()
    assert scored == pytest.approx(expected, abs=1e-5) and scored != pytest.approx(without, abs=1e-3)
    t.train()
    assert t.state.global_step == 1


def test_num_generations_eval_evaluates_with_its_own_group_size(tmp_path, peft_reward_model):
    folder, _ = peft_reward_model  # TRL's test: 3 completions per prompt in training, 1 in evaluation
    args = plait.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, per_device_eval_batch_size=3,
                            num_generations=3, num_generations_eval=1, max_completion_length=4, max_steps=2,
                            eval_strategy="steps", eval_steps=2, **QUIET)
    t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=str(folder), args=args, train_dataset=PROMPTS,
                          eval_dataset=PROMPTS[:3])
    t.train()
    evaluated = [h for h in t.state.log_history if "eval_reward" in h]
    assert len(evaluated) == 1 and t.state.global_step == 2


def test_a_batch_no_reward_scores_warns_and_trains_on_as_in_trl(tmp_path, caplog):
    calls = []

    def scores_from_the_third_batch(completions, **kwargs):
        calls.append(len(completions))
        return [None if len(calls) < 3 else float(len(c)) for c in completions]

    args = plait.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                            max_completion_length=4, max_steps=3, learning_rate=1e-2, **QUIET)
    t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=scores_from_the_third_batch, args=args,
                          train_dataset=PROMPTS)
    with caplog.at_level(logging.WARNING, logger="plait"):
        t.train()
    assert t.state.global_step == 3  # two unscored batches in a row: the run goes on
    warned = [r.getMessage() for r in caplog.records if "no completion of this generation batch got a score" in
              r.getMessage()]
    assert len(warned) == 2 and "scores_from_the_third_batch" in warned[0]
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    # a run none of whose batches got a score learned nothing: it goes on to its end, then fails instead of
    # returning as if it had trained (the command exits non-zero and saves no model)
    t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=never_scores, args=args, train_dataset=PROMPTS)
    with pytest.raises(PlaitError, match="no completion got a score in any of this run's 3 generation batches"):
        t.train()
    assert t.state.global_step == 3
    strict = plait.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                              max_completion_length=4, max_steps=3, max_unscored_batches=2, **QUIET)
    t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=never_scores, args=strict, train_dataset=PROMPTS)
    with pytest.raises(PlaitError, match="no completion got a score in 2 generation batches in a row"):
        t.train()  # plait's stricter choice, asked for


def test_pre_tokenised_preference_rows_prepare_as_their_text_does(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    eos = [tokenizer.eos_token_id]
    ids = [{"prompt_ids": tokenizer(r["prompt"])["input_ids"], "chosen_ids": tokenizer(r["chosen"])["input_ids"] + eos,
            "rejected_ids": tokenizer(r["rejected"])["input_ids"] + eos} for r in PREFERENCE]
    whole = [{"chosen_ids": r["prompt_ids"] + r["chosen_ids"], "rejected_ids": r["prompt_ids"] + r["rejected_ids"]}
             for r in ids]  # TRL's reward-model rows: whole sequences

    def prepared(trainer, config, rows, **fields):
        args = config(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, **QUIET, **fields)
        t = trainer(str(tiny_model_path()), args=args, train_dataset=Dataset.from_list(rows))
        return t, [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in t.train_dataset]

    from_text = prepared(plait.DPOTrainer, plait.DPOConfig, PREFERENCE)[1]
    assert prepared(plait.DPOTrainer, plait.DPOConfig, ids)[1] == from_text
    reward, rows = prepared(plait.RewardTrainer, plait.RewardConfig, whole)
    assert [r["prompt_ids"] + r["chosen_ids"] for r in rows] == [r["chosen_ids"] for r in whole]
    assert [r["prompt_ids"] + r["rejected_ids"] for r in rows] == [r["rejected_ids"] for r in whole]
    reward.train()
    assert reward.state.global_step == 1
    cut = prepared(plait.DPOTrainer, plait.DPOConfig, ids, max_length=4)[1]  # max_length still truncates them
    assert all(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) <= 4 for r in cut)


def test_padding_free_sft_without_packing_cuts_each_sequence_to_max_length(tmp_path):
    # TRL 1.16 refuses padding_free=True with max_length and no packing ("`max_length` is not enforced");
    # plait cuts each sequence when preparing the rows, so the padding-free batch holds them whole to max_length
    rows = [{"text": "The river runs fast and far past the old town and the hills."}, {"text": "Python is"}]
    args = plait.SFTConfig(output_dir=str(tmp_path), padding_free=True, max_length=8, max_steps=1, **QUIET)
    t = plait.SFTTrainer(str(tiny_model_path()), args=args, train_dataset=Dataset.from_list(rows))
    lengths = [len(row["input_ids"]) for row in t.train_dataset]
    assert lengths[0] == 8 and lengths[1] < 8
    batch = t.data_collator([t.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape == (1, sum(lengths))  # one row, no padding
    assert batch["position_ids"][0].tolist() == list(range(lengths[0])) + list(range(lengths[1]))
