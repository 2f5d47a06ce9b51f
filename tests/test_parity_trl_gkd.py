"""Parity with TRL 1.16's experimental GKD: the same loss and gradient on the same batch, and the same
completion tokens from the same SFT-style row.

As tests/test_parity_trl.py: both trainers get the same tiny student (a perturbed copy) and teacher
and one hand-made batch fed straight to ``compute_loss``. TRL's GKD compares the full [B, T, V]
logits of both models; plait's goes through the chunked two-model path. TRL lives in its own venv
(``make test-parity``); in the main venv this module is skipped.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")  # noqa: E402  (only .venv-trl has it: make test-parity)

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from plait.online.buffer import pack
from plait.plugins.methods import gkd as plait_gkd  # noqa: E402
from plait.testing.tiny_model import noisy_tiny_model, tiny_model_path  # noqa: E402

pytestmark = pytest.mark.skipif(not trl.__version__.startswith("1.16."), reason="parity is pinned to TRL 1.16")

from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
ROWS = [{"messages": [{"role": "user", "content": f"Tell me about the {w}."},
                      {"role": "assistant", "content": f"The {w} is {n} metres away."}]}
        for w, n in (("sea", 3), ("sky", 40), ("tree", 7), ("moon", 1000))]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def teacher():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def student():
    return noisy_tiny_model(seed=0, scale=0.05)


def common_args(tmp_path) -> dict:
    return dict(output_dir=str(tmp_path), report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                per_device_train_batch_size=4)


def batch(seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and completions of unequal lengths, random tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [(3, 5), (6, 2), (2, 7), (4, 4)]
    prompts = [torch.randint(5, 900, (p,), generator=generator).tolist() for p, _ in lengths]
    completions = [torch.randint(5, 900, (c,), generator=generator).tolist() for _, c in lengths]
    return prompts, completions


def loss_and_grad(trainer, inputs):
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def trainers(tmp_path, tokenizer, student, teacher, **config):
    data = Dataset.from_list(ROWS)
    theirs = GKDTrainer(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), processing_class=tokenizer,
                        args=GKDConfig(**common_args(tmp_path / "trl"), **config), train_dataset=data)
    ours = plait_gkd.GKDTrainer(copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), processing_class=tokenizer,
                                args=plait_gkd.GKDConfig(**common_args(tmp_path / "plait"), **config), train_dataset=data)
    return theirs, ours


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalised_jsd_loss_and_gradient(tmp_path, tokenizer, student, teacher, beta):
    # temperature=0.7: TRL 1.16's GKD tempers sampling only; both compare untempered distributions
    theirs, ours = trainers(tmp_path, tokenizer, student, teacher, beta=beta, temperature=0.7)
    prompts, completions = batch()
    packed = pack(prompts, completions, tokenizer.pad_token_id, torch.device("cpu"))
    width = packed["prompt_length"]
    labels = torch.full_like(packed["input_ids"], -100)
    labels[:, width:] = packed["input_ids"][:, width:].masked_fill(packed["completion_mask"] == 0, -100)
    trl_inputs = {"input_ids": packed["input_ids"], "attention_mask": packed["attention_mask"], "labels": labels}
    plait_inputs = {**packed, "num_items": packed["completion_mask"].sum().float()}

    (loss, grad), (trl_loss, trl_grad) = loss_and_grad(ours, plait_inputs), loss_and_grad(theirs, trl_inputs)
    assert trl_loss > 0
    torch.testing.assert_close(loss, trl_loss, rtol=LOSS_RTOL, atol=1e-7)
    torch.testing.assert_close(grad, trl_grad, rtol=GRAD_RTOL, atol=1e-5 * trl_grad.abs().max().item())


@pytest.mark.parametrize("max_length", [1024, 30])
def test_the_datasets_completion_tokens_are_trls_labels(tmp_path, tokenizer, student, teacher, max_length):
    """A messages row: TRL's collator labels every token after the rendered prompt; plait's prepared row
    holds the same prompt ids and completion ids, and a row longer than max_length keeps its end in both."""
    theirs, ours = trainers(tmp_path, tokenizer, student, teacher, max_length=max_length)
    assert len(ours.train_dataset) == len(ROWS)
    collated = theirs.data_collator([dict(r) for r in ROWS])
    for i, row in enumerate(ours.train_dataset):
        keep = collated["attention_mask"][i].bool()
        ids, labels = collated["input_ids"][i][keep].tolist(), collated["labels"][i][keep]
        first = int((labels != -100).nonzero()[0])
        assert row["prompt_ids"] == ids[:first]
        assert row["completion_ids"] == ids[first:]
        assert len(ids) <= max_length


def test_defaults_are_trls(tmp_path):
    theirs = GKDConfig(**common_args(tmp_path))
    ours = plait_gkd.GKDConfig(output_dir=str(tmp_path))
    for field in ("temperature", "lmbda", "beta", "max_new_tokens", "seq_kd", "disable_dropout", "learning_rate",
                  "max_length", "logging_steps", "teacher_model_name_or_path", "teacher_model_init_kwargs"):
        assert getattr(ours, field) == getattr(theirs, field), field


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("with_labels", [True, False])
def test_generalized_jsd_loss_helper_equals_trls(beta, reduction, with_labels):
    """GKDTrainer.generalized_jsd_loss, TRL's static helper on whole logits, as scripts call it."""
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, 1, 2, 3, -100], [4, 5, -100, 6, 7]]) if with_labels else None
    ours = plait_gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=0.7,
                                                     reduction=reduction)
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=0.7,
                                             reduction=reduction)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    by_items = plait_gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, num_items_in_batch=7)
    torch.testing.assert_close(by_items, GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta,
                                                                         num_items_in_batch=7), rtol=1e-5, atol=1e-6)
