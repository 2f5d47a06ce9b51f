"""Process reward models: a token classifier that judges every reasoning step where it ends.

Lightman et al. 2023, "Let's Verify Step by Step" (§2.4: the PRM predicts each step's correctness
after the step's last token) and Uesato et al. 2022. Rows are TRL's stepwise supervision:
``{prompt, completions: [step, ...], labels: [bool, ...]}``. Each row becomes the token layout of
:mod:`plait.data.stepwise` (prompt, then every step followed by ``step_separator``), labelled
at the last token of each separator with 1 (correct) or 0 and -100 elsewhere;
``train_on_last_step_only`` keeps only the last step's label in training (evaluation reads every
step). An ``AutoModelForTokenClassification`` with two labels reads the sequence, and the loss is
the cross-entropy at the labelled positions only (mean over the micro-batch's steps, as TRL's
PRMTrainer). Logged: ``accuracy`` over steps and ``accuracy/last_step`` over rows.

The saved folder is an ordinary token-classification checkpoint whose config also records
``step_separator``; ``plugins/reward_sources/process_reward_models.py`` scores GRPO completions
with it (per-step P(correct), aggregated ``min``, ``last`` or ``mean``).
"""

from __future__ import annotations

import logging
from typing import ClassVar

import attrs
import torch
import torch.nn.functional as F
from transformers import AutoModelForTokenClassification

from plait import Method, PlaitError, hookimpl
from plait.data.chat import is_conversational
from plait.data.stepwise import encode_steps, separator_ids
from plait.engine.config import method_config
from plait.engine.trainer import PlaitTrainer
from plait.params import int_at_least

from .reward_model import head_trainable

logger = logging.getLogger("plait")
IGNORE = -100
COLUMNS = ("prompt", "completions", "labels")
_optional_length = attrs.validators.optional(int_at_least(1))


def _separator(instance, attribute, value) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"step_separator={value!r} must be a non-empty string, e.g. '\\n'")


@attrs.define
class PRMParams:
    """The PRM's knobs; names and defaults follow TRL's PRMConfig (0.x, the last TRL that shipped it)."""

    field_help: ClassVar[dict[str, str]] = {
        "max_length": "the whole sequence keeps its first this many tokens (null: no limit)",
        "max_prompt_length": "the prompt keeps its last this many tokens (null: no limit)",
        "max_completion_length": "the steps together keep their first this many tokens (null: no limit)",
        "step_separator": "text after each step; a step is scored at its separator's last token",
        "train_on_last_step_only": "train on the last step's label only (evaluation reads every step)",
        "model_init_kwargs": "keyword arguments for the policy's from_pretrained (dtype, attn_implementation, ...)",
        "dataset_num_proc": "worker processes that tokenise the dataset (null: the main process only)",
    }

    max_length: int | None = attrs.field(default=1024, validator=_optional_length)
    max_prompt_length: int | None = attrs.field(default=512, validator=_optional_length)
    max_completion_length: int | None = attrs.field(default=None, validator=_optional_length)
    step_separator: str = attrs.field(default="\n", validator=_separator)
    train_on_last_step_only: bool = False
    model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None


PRMConfig = method_config(
    "PRMConfig", PRMParams,
    defaults={"learning_rate": 1e-5, "logging_steps": 10, "remove_unused_columns": False, "disable_dropout": True,
              "router_aux_loss_coef": 0.0},  # TRL's PRMConfig had no router_aux_loss_coef: no load-balancing loss
)


def check_row(row: dict, index: int) -> None:
    """One stepwise-supervision row, or a one-line error naming the row and the column."""
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise PlaitError(f"PRM dataset row {index} has no {missing[0]!r} column; give rows "
                         "{prompt, completions: [step, ...], labels: [bool, ...]}")
    steps, labels = row["completions"], row["labels"]
    if not isinstance(row["prompt"], str) and not is_conversational(row["prompt"]):
        raise PlaitError(f"PRM dataset row {index}: prompt is {type(row['prompt']).__name__}; give a string "
                         "or a list of {role, content} messages")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) for s in steps):
        raise PlaitError(f"PRM dataset row {index}: completions must be a non-empty list of step strings, "
                         f"got {steps!r:.60}")
    if not isinstance(labels, list) or len(labels) != len(steps) or not all(isinstance(x, bool) for x in labels):
        raise PlaitError(f"PRM dataset row {index}: labels must be one bool per step ({len(steps)} steps), "
                         f"got {labels!r:.60}")


def tokenize_row(row: dict, processing_class, p: PRMParams, train: bool) -> dict:
    """``input_ids`` and ``labels`` (1/0 at each step's separator end, -100 elsewhere) of one row."""
    ids, positions = encode_steps(processing_class, row["prompt"], row["completions"], p.step_separator,
                                  max_prompt_length=p.max_prompt_length,
                                  max_completion_length=p.max_completion_length, max_length=p.max_length)
    labels = [IGNORE] * len(ids)
    steps = list(zip(positions, row["labels"]))
    for position, label in steps[-1:] if train and p.train_on_last_step_only else steps:
        if position is not None:
            labels[position] = int(label)
    return {"input_ids": ids, "labels": labels}


class TokenClassifier:
    """What a model path is loaded as: a token classifier with two labels (step wrong / right).
    A causal-LM checkpoint gets a new, randomly initialised classification head."""

    @staticmethod
    def from_pretrained(path, **kwargs):
        return AutoModelForTokenClassification.from_pretrained(path, **{"num_labels": 2, **kwargs})


class PRMTrainer(PlaitTrainer):
    """A process reward model: two-label token classification at the step separators."""

    method = "prm"
    config_class = PRMConfig
    auto_model_class = TokenClassifier

    def __init__(self, model, args=None, peft_config=None, **kwargs):
        super().__init__(model, args=args, peft_config=head_trainable(peft_config, "TOKEN_CLS", "PRM"), **kwargs)

    def before_peft(self, model, args, **kwargs):
        name = type(model).__name__
        if not name.endswith("ForTokenClassification"):
            raise PlaitError(f"model is a {name}; a PRM is a …ForTokenClassification with num_labels=2: pass the "
                             "checkpoint's path (a new head is added) or load it with "
                             "AutoModelForTokenClassification.from_pretrained(path, num_labels=2)")
        if model.config.num_labels != 2:
            raise PlaitError(f"model has num_labels={model.config.num_labels}; a PRM has two (step wrong, step "
                             "right): load it with num_labels=2")
        return super().before_peft(model, args, **kwargs)

    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        import datasets

        if isinstance(dataset, list):
            dataset = datasets.Dataset.from_list(dataset)
        p, train = args.params, split == "train"
        separator_ids(processing_class, p.step_separator)  # refuse a separator the tokenizer drops, once

        def tokenize(row, index):
            check_row(row, index)
            return tokenize_row(row, processing_class, p, train)

        # explicit features: the input's own bool `labels` type would otherwise be kept (-100 read as True)
        tokens = datasets.Sequence(datasets.Value("int64"))
        encoded = dataset.map(tokenize, with_indices=True, remove_columns=dataset.column_names,
                              features=datasets.Features({"input_ids": tokens, "labels": tokens}),
                              num_proc=p.dataset_num_proc, desc=f"plait: tokenising {split} steps for the PRM")
        kept = encoded.filter(lambda row: any(x != IGNORE for x in row["labels"]))
        if len(kept) == 0:
            raise PlaitError(f"no {split} row keeps a labelled step under max_length={p.max_length}, "
                             f"max_prompt_length={p.max_prompt_length}, max_completion_length="
                             f"{p.max_completion_length}; raise them")
        if len(kept) < len(encoded):
            logger.warning("PRM: dropped %d of %d %s rows whose every labelled step was truncated away",
                           len(encoded) - len(kept), len(encoded), split)
        return kept

    def make_collator(self, processing_class, args):
        return self.collator("collator.token_classification", processing_class)

    def after_init(self) -> None:
        # the reward source reads the separator the PRM was trained with from the saved config
        self.model.config.step_separator = self.args.params.step_separator

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False)
        labels = inputs["labels"]
        steps = labels != IGNORE
        logits = outputs.logits[steps].float()
        loss = F.cross_entropy(logits, labels[steps])
        with torch.no_grad():
            right = (logits.argmax(-1) == labels[steps]).float()
            # each row's last labelled position: the highest index holding a label
            index = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
            last = torch.where(steps, index, -1).amax(-1)
            rows = last >= 0
            last_right = outputs.logits[rows, last[rows]].argmax(-1) == labels[rows, last[rows]]
            self.record({"accuracy": right.mean(), "accuracy/last_step": last_right.float().mean()})
        return (loss, outputs) if return_outputs else loss


@hookimpl
def register_methods(register):
    register("method.prm", Method(config=PRMConfig, trainer=PRMTrainer,
                                  summary="Process reward model: token classification at step separators"))
