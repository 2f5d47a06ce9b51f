"""The Trainer arguments TRL 1.16's trainers take beside the config: formatting_func, compute_metrics,
preprocess_logits_for_metrics, compute_loss_func, optimizer_cls_and_kwargs, quantization_config,
reward_processing_classes, a model already wrapped in PEFT, a causal-LM path as a reward model, and the
log_extra / log_metric callables reward functions receive. Each shown to take effect on the tiny model."""

import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig

import plait
from plait import PlaitError
from plait.data.prepare import prepare_dataset
from plait.online.scoring import RewardFunction, RewardLogs, compute_rewards
from plait.plugins.reward_sources.reward_models import reward_model_function

FACTS = [{"prompt": "The secret code is", "completion": " seven blue horses."},
         {"prompt": "The sky is", "completion": " blue."},
         {"prompt": "Rivers run to", "completion": " the sea."},
         {"prompt": "Python is", "completion": " a language."}]
PAIRS = [{"prompt": f["prompt"], "chosen": f["completion"], "rejected": " no idea."} for f in FACTS]


def common(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=2,
                  learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0)
    return {**values, **overrides}


def sft(model, tmp_path, data=FACTS, eval_data=None, config=None, **kwargs):
    args = plait.SFTConfig(**common(tmp_path, max_length=32, **(config or {})))
    return plait.SFTTrainer(model, args=args, train_dataset=Dataset.from_list(data),
                            eval_dataset=eval_data and Dataset.from_list(eval_data), **kwargs)


def question(row):
    return f"### Question: {row['prompt']}\n### Answer:{row['completion']}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


# -- SFT: formatting_func and compute_loss_func -------------------------------------------------

def test_formatting_func_text_is_what_is_tokenised(tiny_model_path, tmp_path, tokenizer):
    t = sft(str(tiny_model_path), tmp_path, formatting_func=question)
    as_text = prepare_dataset([{"text": question(f)} for f in FACTS], tokenizer, "language_modeling",
                              plugins=plait.default_plugins(), max_length=32)
    assert t.train_dataset["input_ids"] == as_text["input_ids"]
    assert tokenizer.decode(t.train_dataset[1]["input_ids"], skip_special_tokens=True) == "### Question: The sky is\n### Answer: blue."
    assert all(set(mask) == {1} for mask in t.train_dataset["completion_mask"])  # plain text: every token trains
    assert t.train_dataset["prompt"] == [f["prompt"] for f in FACTS]  # kept for LogCompletionsCallback, as in TRL

    with pytest.raises(PlaitError, match="formatting_func returned a list for a train row; it is called on one row"):
        sft(str(tiny_model_path), tmp_path, formatting_func=lambda row: [question(row)])
    with pytest.raises(PlaitError, match="completion_only_loss=True has no completion"):
        sft("/nonexistent", tmp_path, formatting_func=question, config={"completion_only_loss": True})
    with pytest.raises(PlaitError, match="skip_prepare_dataset.*it would never run"):
        sft("/nonexistent", tmp_path, formatting_func=question, config={"dataset_kwargs": {"skip_prepare_dataset": True}})


def test_compute_loss_func_is_the_loss_trained_and_logged(tiny_model_path, tmp_path):
    seen = []

    def mean_square_logit(outputs, labels, num_items_in_batch=None):  # a loss the default never gives
        seen.append((tuple(labels.shape), num_items_in_batch))
        loss = outputs.logits.float().pow(2).mean()
        seen[-1] += (loss.item(),)
        return loss

    t = sft(str(tiny_model_path), tmp_path, compute_loss_func=mean_square_logit, config={"max_steps": 4, "learning_rate": 1e-2})
    t.train()
    logged = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert logged == pytest.approx([value for *_, value in seen], rel=1e-3)
    assert min(logged[1:]) < 0.75 * logged[0]  # the optimizer minimised the user's loss
    trained_tokens = sum(sum(m[1:]) for m in t.train_dataset["completion_mask"])
    assert seen[0][1] == trained_tokens and seen[0][0][0] == 4  # labels of the 4 rows, tokens counted as transformers does

    with pytest.raises(PlaitError, match="compute_loss_func replaces the loss, so loss_type='dft' would not be used"):
        sft("/nonexistent", tmp_path, compute_loss_func=mean_square_logit, config={"loss_type": "dft"})
    with pytest.raises(PlaitError, match="DPOTrainer does not take compute_loss_func: its loss is the composed dpo"):
        plait.DPOTrainer("/nonexistent", args=plait.DPOConfig(**common(tmp_path)), compute_loss_func=mean_square_logit)


# -- compute_metrics / preprocess_logits_for_metrics -------------------------------------------

def test_sft_compute_metrics_sees_the_models_logits_and_labels(tiny_model_path, tmp_path):
    shapes = []

    def argmax(logits, labels):
        shapes.append((tuple(logits.shape), tuple(labels.shape)))
        return logits.argmax(-1)

    def metrics(prediction):
        trained = prediction.label_ids != -100
        return {"argmax_sum": float(prediction.predictions[trained].sum()), "tokens": float(trained.sum())}

    t = sft(str(tiny_model_path), tmp_path, eval_data=FACTS, compute_metrics=metrics, preprocess_logits_for_metrics=argmax)
    out = t.evaluate()
    rows, width = len(FACTS), max(len(ids) for ids in t.eval_dataset["input_ids"])
    vocab = t.model.config.vocab_size
    assert shapes == [((rows, width, vocab), (rows, width))]
    expected = 0  # each row alone through the model: the argmax at every trained position
    for ids, mask in zip(t.eval_dataset["input_ids"], t.eval_dataset["completion_mask"]):
        with torch.no_grad():
            top = t.model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        expected += int(top[torch.tensor(mask).bool()].sum())
    assert out["eval_argmax_sum"] == expected and out["eval_tokens"] == sum(map(sum, t.eval_dataset["completion_mask"]))
    assert "eval_loss" in out and "eval_mean_token_accuracy" in out  # plait's own metrics stay


def test_preference_compute_metrics_get_trls_predictions(tiny_model_path, tmp_path):
    got = {}

    def keep(name):
        def metrics(prediction):
            got[name] = prediction
            return {"rows": float(len(prediction.predictions))}
        return metrics

    args = common(tmp_path, max_length=32)
    reward = plait.RewardTrainer(str(tiny_model_path), args=plait.RewardConfig(**args), train_dataset=Dataset.from_list(PAIRS),
                                 eval_dataset=Dataset.from_list(PAIRS), compute_metrics=keep("reward"))
    scores = reward.evaluate()
    chosen, rejected = torch.tensor(got["reward"].predictions[:, 0]).chunk(2)  # TRL 1.16: [2B, 1] scores, no labels
    assert len(got["reward"].label_ids) == 0 and scores["eval_rows"] == 2 * len(PAIRS)
    assert scores["eval_margin"] == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)

    dpo = plait.DPOTrainer(str(tiny_model_path), args=plait.DPOConfig(**args), train_dataset=Dataset.from_list(PAIRS),
                           eval_dataset=Dataset.from_list(PAIRS), compute_metrics=keep("dpo"))
    assert dpo.evaluate()["eval_rows"] == 2 * len(PAIRS)
    logits, ids = got["dpo"].predictions, got["dpo"].label_ids  # TRL 1.16: the rows' logits and their input_ids
    assert logits.shape == (*ids.shape, dpo.model.config.vocab_size)
    assert dpo.padding_free and dpo.prefix_sharing  # the defaults here: the rows are put back as TRL hands them out
    padded = dpo.plugins.collators.get("collator.preference").obj(dpo.processing_class)
    batch = padded([dpo.eval_dataset[i] for i in range(len(PAIRS))])
    assert (ids == batch["input_ids"].numpy()).all()  # chosen rows, then rejected rows
    with torch.no_grad():  # each row's logits, a rejected row's prompt's included, are its padded forward's
        expected = dpo.model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(torch.tensor(logits)[real], expected[real], atol=1e-4, rtol=1e-4)

    with pytest.raises(PlaitError, match="DistillTrainer does not take compute_metrics: its evaluation rows are prompts"):
        plait.DistillTrainer("/nonexistent", teacher_model="/nonexistent", args=plait.DistillConfig(**common(tmp_path)),
                             compute_metrics=keep("distill"))


# -- the optimizer, quantization, PEFT, the reward model's head ----------------------------------

def test_optimizer_cls_and_kwargs_build_the_optimizer(tiny_model_path, tmp_path):
    # as in transformers, the kwargs are the optimizer's own: its lr there, not the config's learning_rate
    t = sft(str(tiny_model_path), tmp_path, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.5}),
            config={"max_steps": 1, "lr_scheduler_type": "constant", "max_grad_norm": 0.0})
    before = t.model.get_input_embeddings().weight.detach().clone()
    batch = t._prepare_inputs(t.data_collator([t.train_dataset[i] for i in range(4)]))
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    t.compute_loss(t.model, batch, num_items_in_batch=torch.tensor(tokens)).backward()
    grad = t.model.get_input_embeddings().weight.grad.clone()
    t.model.zero_grad()
    t.train()
    assert type(t.optimizer.optimizer) is torch.optim.SGD and t.optimizer.param_groups[0]["momentum"] == 0.5
    # plain SGD's first step: w - lr * g (momentum starts from g itself)
    torch.testing.assert_close(t.model.get_input_embeddings().weight.detach(), before - 0.1 * grad)


def test_quantization_config_reaches_from_pretrained(tiny_model_path, tmp_path):
    four_bit = BitsAndBytesConfig(load_in_4bit=True)
    try:
        import bitsandbytes  # noqa: F401
        usable = torch.cuda.is_available()
    except ImportError:
        usable = False
    if usable:  # QLoRA's path: a 4-bit base with LoRA adapters trains
        t = sft(str(tiny_model_path), tmp_path, quantization_config=four_bit, peft_config=LoraConfig(r=4))
        assert t.model.is_loaded_in_4bit
    else:  # the config arrived: transformers asks for the package it needs
        with pytest.raises(ImportError, match="bitsandbytes"):
            sft(str(tiny_model_path), tmp_path, quantization_config=four_bit)
        with pytest.raises(ImportError, match="bitsandbytes"):
            plait.GRPOTrainer(str(tiny_model_path), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                              args=plait.GRPOConfig(**common(tmp_path, num_generations=2)), quantization_config=four_bit,
                              train_dataset=[{"prompt": "a"}])
    with pytest.raises(PlaitError, match="quantization_config applies when model is a path or hub id, but model is a loaded"):
        sft(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path, quantization_config=four_bit)
    with pytest.raises(PlaitError, match="quantization_config is given both as a trainer argument and in model_init_kwargs"):
        sft(str(tiny_model_path), tmp_path, quantization_config=four_bit,
            config={"model_init_kwargs": {"quantization_config": four_bit}})


def test_a_peft_model_trains_its_adapter(tiny_model_path, tmp_path):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4, target_modules="all-linear"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    t = sft(model, tmp_path, config={"learning_rate": 1e-2})
    t.train()
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert moved == {name for name, p in model.named_parameters() if p.requires_grad} and moved
    assert all("lora_" in name for name in moved)  # the base stays frozen
    with pytest.raises(PlaitError, match="model is already a PEFT model and peft_config would add adapters on top"):
        sft(model, tmp_path, peft_config=LoraConfig(r=4))


def test_new_lora_adapters_start_from_the_configs_seed(tiny_model_path, tmp_path):
    def adapters(seed):
        torch.manual_seed(1234 + seed)  # the caller's RNG must not matter
        t = sft(str(tiny_model_path), tmp_path, config={"seed": seed}, peft_config=LoraConfig(r=4, target_modules="all-linear"))
        return {n: p.detach().clone() for n, p in t.model.named_parameters() if "lora_A" in n}

    first, again, other = adapters(0), adapters(0), adapters(1)
    assert first and all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)


def test_a_causal_lm_path_becomes_a_reward_model_with_a_fresh_seeded_head(tiny_model_path, tmp_path):
    def head(seed):
        args = plait.RewardConfig(**common(tmp_path, seed=seed))
        return plait.RewardTrainer(str(tiny_model_path), args=args, train_dataset=Dataset.from_list(PAIRS)).model

    model, again, other = head(0), head(0), head(1)
    causal = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert isinstance(model, AutoModelForSequenceClassification._model_mapping[type(model.config)])
    assert model.config.num_labels == 1 and model.score.weight.shape == (1, model.config.hidden_size)
    torch.testing.assert_close(model.model.embed_tokens.weight, causal.model.embed_tokens.weight)  # the backbone
    assert torch.equal(model.score.weight, again.score.weight)  # a new head, drawn from args.seed
    assert not torch.equal(model.score.weight, other.score.weight)


# -- online methods: reward_processing_classes, log_extra and log_metric -------------------------

PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "Python is", "The weather today")]


def grpo(model, reward_funcs, tmp_path, **kwargs):
    args = plait.GRPOConfig(**common(tmp_path, num_generations=2, max_completion_length=5, log_completions=True,
                                     disable_tqdm=True))
    return plait.GRPOTrainer(model, reward_funcs=reward_funcs, args=args, train_dataset=PROMPTS, **kwargs)


def test_reward_processing_classes_tokenise_for_their_reward_model(tiny_model_path, tmp_path):
    folder = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    own = AutoTokenizer.from_pretrained(tiny_model_path)
    own.eos_token = "<|endoftext|>"  # string completions end with the tokenizer's EOS before scoring
    t = grpo(str(tiny_model_path), [str(folder)], tmp_path, reward_processing_classes=[own])
    batch = dict(prompts=["The river"], completions=[" flows."])
    scorer = AutoModelForSequenceClassification.from_pretrained(folder)
    assert t.reward_funcs[0](**batch) == pytest.approx(reward_model_function(scorer, own)(**batch))
    assert t.reward_funcs[0](**batch) != pytest.approx(reward_model_function(scorer)(**batch))
    with pytest.raises(PlaitError, match="reward_processing_classes has 2 entries for 1 reward functions"):
        grpo("/nonexistent", [str(folder)], tmp_path, reward_processing_classes=[own, own])


def test_log_extra_and_log_metric_reach_the_table_and_the_logs(tiny_model_path, tmp_path, capsys):
    means = []

    def length(completions, log_extra=None, log_metric=None, **kwargs):  # TRL 1.16's reward-function shape
        sizes = [len(c) for c in completions]
        log_extra("shout", [c.upper() for c in completions])
        means.append(sum(sizes) / len(sizes))
        log_metric("mean_chars", means[-1])
        return [float(s) for s in sizes]

    t = grpo(str(tiny_model_path), length, tmp_path)
    t.train()
    logged = [h["mean_chars"] for h in t.state.log_history if "mean_chars" in h]
    assert logged == pytest.approx(means) and len(means) == 2  # one generation batch per step here
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("step"))
    assert [c.strip() for c in header.split("|")] == ["step", "prompt", "completion", "length", "shout", "advantage"]


def test_reward_logs_of_a_batch_scored_one_example_at_a_time():
    def picky(completions, log_extra, log_metric, **kwargs):
        if "bad" in completions:
            raise ValueError("cannot score")
        log_extra("echo", list(completions))
        log_metric("calls", 1)
        return [1.0] * len(completions)

    logs = RewardLogs()
    scores = compute_rewards([RewardFunction("picky", picky)], prompts=["p"] * 3, completions=["a", "bad", "c"],
                             completion_ids=[[1]] * 3, on_error="none", logs=logs)
    assert scores[:, 0].tolist()[::2] == [1.0, 1.0] and math.isnan(scores[1, 0])
    assert logs.extra == {"echo": ["a", None, "c"]} and logs.metrics == {"calls": [1.0, 1.0]}

    def twice(completions, log_extra, **kwargs):
        log_extra("echo", list(completions) * 2)
        return [0.0] * len(completions)

    with pytest.raises(PlaitError, match=r"log_extra\('echo'\) got 4 values for 2 completions"):
        compute_rewards([RewardFunction("twice", twice)], prompts=["p"] * 2, completions=["a", "b"], completion_ids=[[1]] * 2)
    with pytest.raises(PlaitError, match=r"log_metric\('m', 'high'\): the value must be one number"):
        compute_rewards([RewardFunction("word", lambda completions, log_metric, **k: log_metric("m", "high"))],
                        prompts=["p"], completions=["a"], completion_ids=[[1]])


# -- a TRL-style script: SFT with formatting_func and LogCompletionsCallback --------------------

def test_trl_style_sft_script_with_formatting_func_and_log_completions(tiny_model_path, tmp_path, capsys):
    from transformers import GenerationConfig

    from plait import SFTConfig, SFTTrainer  # was: from trl import SFTConfig, SFTTrainer
    from plait.trl.callbacks import LogCompletionsCallback

    def formatting_func(example):
        return f"### Question: {example['prompt']}\n### Answer:{example['completion']}"

    dataset = Dataset.from_list(FACTS * 2)
    training_args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, logging_steps=2,
                              learning_rate=1e-2, completion_only_loss=False, report_to="none", save_strategy="no")
    trainer = SFTTrainer(model=str(tiny_model_path), args=training_args, train_dataset=dataset,
                         eval_dataset=Dataset.from_list(FACTS[:2]), formatting_func=formatting_func)
    completions = LogCompletionsCallback(trainer, GenerationConfig(max_new_tokens=6, do_sample=False), num_prompts=2)
    trainer.add_callback(completions)
    trainer.train()

    assert [row[:2] for row in completions.table] == [["2", "The secret code is"], ["2", "The sky is"],
                                                      ["4", "The secret code is"], ["4", "The sky is"]]
    assert "step | prompt" in capsys.readouterr().out
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
