"""``trainer.evaluate(eval_dataset=rows)`` with rows as the user has them (TRL's trainers take raw rows
there): the rows are prepared as the constructor prepares its ``eval_dataset``, for every offline method
and an online one; the trainer's own prepared dataset, a dict of raw ones and no argument still work."""

from __future__ import annotations

import math

import pytest
from datasets import Dataset

import plait
from plait.testing.tiny_model import tiny_model_path

PAIRS = [{"prompt": "Tell me.", "chosen": " Good.", "rejected": " Bad."}] * 4
ROWS = {
    "dpo": PAIRS,
    "reward_model": PAIRS,
    "orpo": PAIRS,
    "kto": [{"prompt": "Tell me.", "completion": " Good.", "label": True},
            {"prompt": "Tell me.", "completion": " Bad.", "label": False}] * 2,
    "sft": [{"prompt": "Tell me.", "completion": " Good."}] * 4,
    "grpo": [{"prompt": "Tell me."}] * 4,
}


def length(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


@pytest.mark.parametrize("method", sorted(ROWS))
def test_evaluate_takes_raw_rows(tmp_path, method):
    record = plait.default_plugins().methods.get(method, family="method").obj
    extra = {"num_generations": 2, "max_completion_length": 4} if method == "grpo" else {}
    args = record.config(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2,
                         per_device_eval_batch_size=2, max_steps=1, **extra)
    rows = Dataset.from_list(ROWS[method])
    kwargs = {"reward_funcs": length} if method == "grpo" else {}
    trainer = record.trainer(str(tiny_model_path()), args=args, train_dataset=rows, eval_dataset=rows, **kwargs)
    for given, prefix in ((rows, "eval"), (trainer.eval_dataset, "eval"), (None, "eval"), ({"held": rows}, "eval_held")):
        metrics = trainer.evaluate(eval_dataset=given)
        assert math.isfinite(metrics[f"{prefix}_loss"]), (given, metrics)


@pytest.mark.parametrize("method", ["dpo", "kto", "sft"])
def test_the_trained_model_carries_the_method_tags(tmp_path, method):
    """As TRL's trainers tag theirs (``model.add_model_tags``); plait's tags are ``["plait", <method>]``."""
    record = plait.default_plugins().methods.get(method, family="method").obj
    args = record.config(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2, max_steps=1,
                         model_init_kwargs={"dtype": "float32"})
    trainer = record.trainer(str(tiny_model_path()), args=args, train_dataset=Dataset.from_list(ROWS[method]))
    assert trainer.model.model_tags == ["plait", method] == trainer._tag_names
