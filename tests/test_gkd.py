"""GKD: the generalised JSD against hand-computed numbers, the trainer's loss against the direct
full-logits formula, where completions come from (lmbda, seq_kd), SFT-style data, bad inputs, and
learning: the student's divergence to the teacher falls."""

from __future__ import annotations

import functools
import math
import time
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait import PlaitError, make_plugins
from plait.engine.batches import TokenDistributions
from plait.losses.distill_jsd import JSDParams, distill_jsd
from plait.engine.layout import pad_token_id
from plait.online.buffer import pack
from plait.plugins.methods.gkd import GKDConfig, GKDTrainer
from plait.testing.tiny_model import noisy_tiny_model, tiny_model_path

WORDS = ["sea", "sky", "tree", "moon", "river", "stone", "cloud", "field"]


def rows(words=WORDS, form: str = "messages") -> Dataset:
    def row(w):
        prompt = [{"role": "user", "content": f"Tell me about the {w}."}]
        completion = [{"role": "assistant", "content": f"The {w} is near."}]
        return {"messages": prompt + completion} if form == "messages" else {"prompt": prompt, "completion": completion}
    return Dataset.from_list([row(w) for w in words])


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, max_new_tokens=6,
                  learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0)
    return GKDConfig(**{**values, **overrides})


def trainer(tmp_path, teacher=None, data=None, **overrides):
    return GKDTrainer(str(tiny_model_path()), teacher_model=teacher if teacher is not None else noisy_tiny_model(),
                      args=config(tmp_path, **overrides), train_dataset=data if data is not None else rows())


# ---------------------------------------------------------------------------------------------
# The divergence, by hand
# ---------------------------------------------------------------------------------------------

# student p_s = (0.5, 0.5), teacher p_t = (0.9, 0.1):
#   β = 0:   KL(p_t ‖ p_s) = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5)                         = 0.3680642
#   β = 1:   KL(p_s ‖ p_t) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1)                         = 0.5108256
#   β = 0.5: m = (0.7, 0.3); 0.5 [0.9 ln(9/7) + 0.1 ln(1/3)] + 0.5 [0.5 ln(5/7) + 0.5 ln(5/3)] = 0.1017492
@pytest.mark.parametrize("beta, expected", [(0.0, 0.3680642), (0.5, 0.1017492), (1.0, 0.5108256)])
def test_generalised_jsd_on_a_two_token_distribution(beta, expected):
    student, teacher = torch.tensor([[0.5, 0.5]]).log(), torch.tensor([[0.9, 0.1]]).log()
    value = distill_jsd(TokenDistributions(student, teacher), JSDParams(beta))
    assert value.shape == (1,) and math.isclose(value.item(), expected, abs_tol=1e-6)


def test_the_trainers_loss_is_the_token_mean_of_the_untempered_jsd(tmp_path):
    """compute_loss on a packed batch = mean over completion tokens of JSD_β between the full softmaxes,
    at temperature 1 whatever the sampling temperature (as TRL 1.16's GKD)."""
    gkd = trainer(tmp_path, beta=0.3, temperature=0.6)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    completions = [[20, 21, 22, 23], [30, 31]]
    batch = pack(prompts, completions, pad_token_id(gkd.processing_class), torch.device("cpu"))
    batch["num_items"] = batch["completion_mask"].sum().float()
    loss = gkd.compute_loss(gkd.model, batch)

    width = batch["prompt_length"]
    with torch.no_grad():
        s = gkd.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.log_softmax(-1)
        t = gkd.teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.log_softmax(-1)
    # logits at position p predict token p + 1: the completion tokens width..end are predicted from width-1..end-1
    s, t = s[:, width - 1:-1], t[:, width - 1:-1]
    mask = batch["completion_mask"].bool()
    expected = distill_jsd(TokenDistributions(s[mask], t[mask]), JSDParams(0.3)).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Where completions come from
# ---------------------------------------------------------------------------------------------


def first_rollout(gkd) -> dict:
    gkd.model.train()
    batch = gkd.data_collator([gkd.train_dataset[i] for i in range(4)])
    return gkd.rollout(batch), batch


def completions_of(rollout: dict) -> list[list[int]]:
    width = rollout["prompt_length"]
    return [row[width:][m.bool()].tolist() for row, m in zip(rollout["input_ids"], rollout["completion_mask"])]


@pytest.mark.parametrize("form", ["messages", "prompt_completion"])
def test_lmbda_0_trains_on_the_datasets_completions(tmp_path, form):
    gkd = trainer(tmp_path, data=rows(form=form), lmbda=0.0)
    rollout, batch = first_rollout(gkd)
    tokenizer = gkd.processing_class
    assert completions_of(rollout) == [list(ids) for ids in batch["completion_ids"]]
    assert tokenizer.decode(batch["completion_ids"][0], skip_special_tokens=True).strip() == "The sea is near."
    assert batch["prompt"][0] == [{"role": "user", "content": "Tell me about the sea."}]


def test_lmbda_1_samples_the_student_and_seq_kd_the_teacher(tmp_path):
    student = first_rollout(trainer(tmp_path, lmbda=1.0, max_new_tokens=5))[0]
    teacher = first_rollout(trainer(tmp_path, lmbda=0.0, seq_kd=True, max_new_tokens=5))[0]
    dataset = first_rollout(trainer(tmp_path, lmbda=0.0, max_new_tokens=5))[0]
    for sampled in (student, teacher):
        assert all(1 <= len(c) <= 5 for c in completions_of(sampled))
    assert completions_of(student) != completions_of(dataset) != completions_of(teacher)


def test_the_share_of_on_policy_steps_is_lmbda_and_draws_repeat(tmp_path):
    gkd = trainer(tmp_path, lmbda=0.3, seq_kd=True)
    gkd.model.train()
    draws = []
    for step in range(400):
        gkd.state.global_step = step
        draws.append(gkd.completion_source())
    assert set(draws) == {"student", "teacher"}
    assert 0.25 < draws.count("student") / len(draws) < 0.35
    gkd.state.global_step = 17
    assert gkd.completion_source() == draws[17]  # a resumed run draws the same coin
    gkd.model.eval()
    assert gkd.completion_source() == "dataset"  # evaluation scores the dataset's completions


def test_bad_inputs_are_refused_in_one_line(tmp_path):
    with pytest.raises(PlaitError, match=r"GKD's train dataset has columns \['text'\]"):
        trainer(tmp_path, data=Dataset.from_list([{"text": "hello"}] * 4))
    with pytest.raises(PlaitError, match="lmbda=1.5"):
        config(tmp_path, lmbda=1.5)
    with pytest.raises(PlaitError, match="needs a teacher"):
        GKDTrainer(str(tiny_model_path()), args=config(tmp_path), train_dataset=rows())


def test_gkd_is_registered_with_the_distill_losses():
    method = make_plugins().methods.get("method.gkd").obj
    assert method.loss_family == "distill" and method.config.__name__ == "GKDConfig"
    import plait

    assert plait.GKDConfig is GKDConfig and plait.GKDTrainer is GKDTrainer


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def teacher_state() -> dict:
    """The tiny model fine-tuned on every row's completion (full-batch Adam): a peaked teacher."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    prepared = GKDTrainer.prepare(SimpleNamespace(plugins=make_plugins()), rows(), tokenizer, config("/tmp/t"), "teacher")
    prompts, completions = prepared["prompt_ids"], prepared["completion_ids"]
    batch = pack(prompts, completions, 0, torch.device("cpu"))
    width = batch["prompt_length"]
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, width:] = batch["input_ids"][:, width:].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(20):
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_students_divergence_to_the_teacher_falls(tmp_path):
    start = time.time()
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    teacher.load_state_dict(teacher_state())
    gkd = trainer(tmp_path, teacher=teacher, data=rows(WORDS[:6]), lmbda=0.5, max_steps=10, max_new_tokens=4,
                  per_device_train_batch_size=6, learning_rate=1e-2, logging_steps=5)
    gkd.eval_dataset = gkd.prepare(rows(WORDS[6:]), gkd.processing_class, gkd.args, "eval")
    before = gkd.evaluate()["eval_divergence"]
    gkd.train()
    after = gkd.evaluate()["eval_divergence"]
    assert after < 0.6 * before, (before, after)  # held-out prompts, the dataset's completions
    logged = [h for h in gkd.state.log_history if "on_policy" in h]
    assert 0 < sum(h["on_policy"] for h in logged) < len(logged)  # both sources were used
    print(f"GKD divergence {before:.3f} -> {after:.3f} ({time.time() - start:.1f} s)")
