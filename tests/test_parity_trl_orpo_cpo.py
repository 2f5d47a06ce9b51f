"""Parity with TRL 1.16's experimental ORPO and CPO trainers: the same loss and gradient on the same batch.

As in tests/test_parity_trl.py: one tiny policy and one hand-made batch of four pairs, fed
straight to ``compute_loss``. TRL's experimental trainers take their own batch layout (chosen_* and
rejected_* ids, labels −100 outside the completion), built here from plait's collated rows, so the
tokens are the same and a mismatch is a difference in loss semantics. Intentional differences
(docs/trl-differences.md) are pinned by their own tests. TRL lives in .venv-trl only.
"""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")  # noqa: E402  (only .venv-trl has it: make test-parity)

from datasets import Dataset  # noqa: E402
from test_parity_trl import (  # noqa: E402,F401  (policy, reference, tokenizer: fixtures)
    PREFERENCE_BATCH, assert_same, common_args, loss_and_grad, policy, reference, tokenizer,
)
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # noqa: E402

from plait import PlaitError  # noqa: E402
from plait.plugins.methods import cpo as plait_cpo, orpo as plait_orpo  # noqa: E402

pytestmark = pytest.mark.skipif(not trl.__version__.startswith("1.16."), reason="parity is pinned to TRL 1.16")

PREFERENCES = Dataset.from_list([{"prompt": "Tell me.", "chosen": " Good.", "rejected": " Bad."}] * 2)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen")


def trl_layout(batch: dict) -> dict:
    """plait's [chosen…; rejected…] rows in the experimental trainers' layout."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    out = {}
    for side, half in zip(("chosen", "rejected"), range(2)):
        rows = slice(half * len(labels) // 2, (half + 1) * len(labels) // 2)
        out |= {f"{side}_input_ids": batch["input_ids"][rows], f"{side}_attention_mask": batch["attention_mask"][rows],
                f"{side}_labels": labels[rows]}
    return out


CLASSES = {"ORPO": ((ORPOConfig, ORPOTrainer), (plait_orpo.ORPOConfig, plait_orpo.ORPOTrainer)),
           "CPO": ((CPOConfig, CPOTrainer), (plait_cpo.CPOConfig, plait_cpo.CPOTrainer))}


def trainer(tmp_path, tokenizer, policy, name, framework, data=PREFERENCES, **config):
    """TRL's (framework 0) or plait's (1) trainer for one config, on its own copy of the policy."""
    args, trainer_class = CLASSES[name][framework]
    return trainer_class(model=copy.deepcopy(policy), args=args(**common_args(tmp_path), **config),
                         train_dataset=data, processing_class=tokenizer)


def trl_metrics(trainer, batch) -> dict:
    with torch.no_grad():
        _, metrics = trainer.get_batch_loss_metrics(trainer.model, batch, "train")
    return {k.removeprefix("train_"): float(v) for k, v in metrics.items()}


def plait_metrics(trainer, batch) -> dict:
    trainer._metrics["train"].clear()
    with torch.no_grad():
        trainer.compute_loss(trainer.model, batch)
    return {k: v[0] for k, v in trainer._metrics["train"].items()}


def check(tmp_path, tokenizer, policy, name, theirs_config=None, **config):
    theirs = trainer(tmp_path, tokenizer, policy, name, 0, **(config if theirs_config is None else theirs_config))
    ours = trainer(tmp_path, tokenizer, policy, name, 1, **config)
    assert_same(loss_and_grad(ours, PREFERENCE_BATCH), loss_and_grad(theirs, trl_layout(PREFERENCE_BATCH)))
    ours_logged, theirs_logged = plait_metrics(ours, PREFERENCE_BATCH), trl_metrics(theirs, trl_layout(PREFERENCE_BATCH))
    for key in METRICS:
        if key in theirs_logged and not (key == "nll_loss" and theirs_logged[key] == 0.0):
            assert ours_logged[key] == pytest.approx(theirs_logged[key], rel=1e-5, abs=1e-5), key


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo(tmp_path, tokenizer, policy, beta):
    check(tmp_path, tokenizer, policy, "ORPO", beta=beta)


CPO_CASES = [
    dict(loss_type="sigmoid"), dict(loss_type="sigmoid", label_smoothing=0.1, beta=0.3),
    dict(loss_type="hinge"), dict(loss_type="hinge", beta=2.0),
    dict(loss_type="ipo"), dict(loss_type="ipo", beta=0.5),
    dict(loss_type="simpo"), dict(loss_type="simpo", simpo_gamma=1.0, beta=2.0, label_smoothing=0.2),
    dict(loss_type="simpo", cpo_alpha=0.0),
    dict(loss_type="alphapo"), dict(loss_type="alphapo", alpha=0.25, beta=2.5, simpo_gamma=0.8),
    dict(loss_type="sigmoid", alpha=0.05), dict(loss_type="hinge", alpha=-0.02), dict(loss_type="ipo", alpha=0.3),
    dict(loss_type="sigmoid", cpo_alpha=0.3),
]


@pytest.mark.parametrize("config", CPO_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_cpo(tmp_path, tokenizer, policy, config):
    check(tmp_path, tokenizer, policy, "CPO", **config)


def test_config_fields_and_defaults_are_trl_s():
    import dataclasses

    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    for theirs, ours in ((ORPOConfig, plait_orpo.ORPOConfig), (CPOConfig, plait_cpo.CPOConfig)):
        own = {f.name: f.default for f in dataclasses.fields(theirs) if f.name not in base}
        mine = {f.name: f.default for f in dataclasses.fields(ours)}
        assert set(own) <= set(mine), set(own) - set(mine)
        differ = {k: (v, mine[k]) for k, v in own.items() if mine[k] != v}
        # plait's loss_type None means the method's default loss, TRL's default
        if differ.pop("loss_type", None) is not None:
            assert ours.params_class.default_loss == own["loss_type"]
        # cpo_alpha None = TRL's 1.0, or 0.0 with loss_type='alphapo' (docs/trl-differences.md)
        assert differ == ({"cpo_alpha": (1.0, None)} if theirs is CPOConfig else {}), differ
        for field in ("learning_rate", "logging_steps", "disable_dropout"):
            assert getattr(ours(output_dir="x"), field) == getattr(theirs(output_dir="x", bf16=False), field)


# -- the listed differences (docs/trl-differences.md) ---------------------------------------------


def test_cpo_alphapo_keeps_an_explicit_cpo_alpha_that_trl_overwrites(tmp_path, tokenizer, policy):
    assert CPOConfig(output_dir="x", bf16=False, loss_type="alphapo", cpo_alpha=0.5).cpo_alpha == 0.0
    # TRL's alphapo at any cpo_alpha is plait's alphapo at cpo_alpha=0 (its default there)
    check(tmp_path, tokenizer, policy, "CPO", theirs_config=dict(loss_type="alphapo", alpha=0.2, cpo_alpha=0.5),
          loss_type="alphapo", alpha=0.2)
    ours = trainer(tmp_path, tokenizer, policy, "CPO", 1, loss_type="alphapo", cpo_alpha=0.5)
    assert ours.objective.terms[-1].name == "dpo.sft" and ours.objective.terms[-1].weight == 0.5


def test_cpo_simpo_with_alpha_is_plait_s_alphapo_with_cpo_alpha_1(tmp_path, tokenizer, policy):
    with pytest.raises(PlaitError, match="loss_type='alphapo'"):
        trainer(tmp_path, tokenizer, policy, "CPO", 1, loss_type="simpo", alpha=0.2)
    check(tmp_path, tokenizer, policy, "CPO", theirs_config=dict(loss_type="simpo", alpha=0.2),
          loss_type="alphapo", alpha=0.2, cpo_alpha=1.0)


def test_preference_rows_are_dpo_s_without_trl_s_bos(tmp_path, tokenizer, policy):
    """TRL's experimental trainers prepend the tokenizer's BOS to every prompt that lacks it and keep a
    pair whose prompt fills max_length (an empty completion: ORPO's NaN); plait prepares rows as its DPO."""
    data = Dataset.from_list([{"prompt": "The sky is", "chosen": " very blue today.", "rejected": " red"},
                              {"prompt": "one two three four five six seven", "chosen": " a b", "rejected": " x"}])
    for name in ("ORPO", "CPO"):
        theirs = trainer(tmp_path, tokenizer, policy, name, 0, data, max_length=12)
        ours = trainer(tmp_path, tokenizer, policy, name, 1, data, max_length=12, padding_free=False)  # rows as TRL's
        assert len(theirs.train_dataset) == 2 and len(ours.train_dataset) == 1
        row, mine = theirs.train_dataset[0], ours.train_dataset[0]
        assert row["chosen_input_ids"][0] == tokenizer.bos_token_id
        ours_rows = ours.data_collator([mine])
        for i, side in enumerate(("chosen", "rejected")):  # the same tokens after TRL's BOS, up to max_length
            theirs_ids = row[f"{side}_input_ids"][1:]
            assert theirs_ids == ours_rows["input_ids"][i, :len(theirs_ids)].tolist()
