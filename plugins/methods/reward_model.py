"""Reward models: a sequence classifier with one output trained on preference pairs.

Ouyang et al. 2022, "Training language models to follow instructions with human feedback",
§3.5 and eq. 1. The backbone with a scalar head reads prompt + completion and scores the last
non-pad token; one forward over ``2B`` rows [chosen…; rejected…] gives the rewards of both sides,
packed into a :class:`plait.engine.batches.PairwiseRewards` (with the dataset's optional per-pair
``margin`` column) for the composed ``reward_model.*`` losses (Bradley-Terry by default, with
``center_rewards_coefficient`` shared into it). The saved folder is an ordinary
``AutoModelForSequenceClassification`` checkpoint, usable by path as a reward in GRPO/RLOO.
"""

from __future__ import annotations

import copy
import logging
from typing import ClassVar

import attrs
import torch
from transformers import AutoModelForSequenceClassification

from plait import Method, PlaitError, hookimpl
from plait.data.prepare import is_stream, prepare_dataset
from plait.engine.batches import PairwiseRewards
from plait.engine.config import method_config
from plait.engine.layout import contiguous_index, pad_multiple_field, pad_token_id
from plait.engine.objective import LossChoice, Objective
from plait.engine.trainer import PlaitTrainer
from plait.params import non_negative, positive
from plait.plugins.data.collators.preference import preference_collator_name

logger = logging.getLogger("plait")


@attrs.define
class RewardParams(LossChoice):
    """The reward model's own knobs; names and defaults follow TRL's RewardConfig.

    Pairs longer than ``max_length`` (prompt + chosen or prompt + rejected) are dropped, as TRL
    1.16 does; ``truncation_mode`` (plait's) ``"keep_start"`` or ``"keep_end"`` truncates them instead."""

    field_help: ClassVar[dict[str, str]] = {
        "center_rewards_coefficient": "c of the c*(r_chosen + r_rejected)^2 term keeping rewards near 0 (null: off)",
        "max_length": "most tokens of prompt + chosen (or rejected); longer pairs are dropped (null: no limit)",
        "truncation_mode": "truncate long pairs instead of dropping them: 'keep_start' or 'keep_end' (null: drop)",
        "pad_to_multiple_of": "round batch lengths up to this multiple (null: never; auto: 128 on AWS Neuron only)",
        "padding_free": "a batch's sequences back to back in one row, no padding (null: where the model allows)",
        "prefix_sharing": "in a padding-free batch, compute each pair's prompt once (null: where the attention can)",
        "model_init_kwargs": "keyword arguments for the policy's from_pretrained (dtype, attn_implementation, ...)",
        "dataset_num_proc": "worker processes that tokenise the dataset (null: the main process only)",
    }

    default_loss = "bradley_terry"
    center_rewards_coefficient: float | None = attrs.field(default=None, validator=attrs.validators.optional(non_negative))
    max_length: int | None = attrs.field(default=1024, validator=attrs.validators.optional(positive))
    truncation_mode: str | None = None
    pad_to_multiple_of: int | str | None = pad_multiple_field()
    # plait's (TRL 1.16's RewardConfig has none): the 2B sequences back to back in one row, no padding;
    # None: where the model's attention runs per sequence (plait.engine.attention) and it has a score head
    padding_free: bool | None = None
    # plait's: in a padding-free batch each pair's prompt is computed once (plait.engine.attention.packed_segments);
    # None: where the model's attention can (plait_sdpa)
    prefix_sharing: bool | None = None
    model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None


RewardConfig = method_config(
    "RewardConfig", RewardParams,
    defaults={"learning_rate": 1e-4, "logging_steps": 10, "remove_unused_columns": False, "disable_dropout": True,
              "router_aux_loss_coef": 0.0},  # TRL's RewardConfig has no router_aux_loss_coef: no load-balancing loss
)


def drop_longer_pairs(dataset, max_length: int | None, split: str):
    """``dataset`` without the pairs whose chosen or rejected sequence (prompt included) is longer than ``max_length``."""
    if max_length is None:
        return dataset

    def fits(row) -> bool:
        return len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"])) <= max_length

    if is_stream(dataset):  # dropped lazily as they are read; a stream has no count to report
        return dataset.filter(fits)
    kept = dataset.filter(fits, desc=f"plait: dropping {split} pairs longer than max_length={max_length}")
    if len(kept) == 0:
        raise PlaitError(f"every one of the {len(dataset)} {split} pairs is longer than max_length={max_length} "
                         "tokens; raise max_length, or set truncation_mode='keep_start' to truncate them")
    if len(kept) < len(dataset):
        logger.warning("reward model: dropped %d of %d %s pairs longer than max_length=%d tokens (as TRL does); "
                       "raise max_length, or set truncation_mode='keep_start' to truncate them instead",
                       len(dataset) - len(kept), len(dataset), split, max_length)
    return kept


class ScalarRewardModel:
    """What a model path is loaded as: a sequence classifier with one output. A causal-LM
    checkpoint gets a new, randomly initialised score head on top of its backbone."""

    @staticmethod
    def from_pretrained(path, **kwargs):
        return AutoModelForSequenceClassification.from_pretrained(path, **{"num_labels": 1, **kwargs})


def head_trainable(peft_config, task_type: str = "SEQ_CLS", who: str = "reward model"):
    """PEFT's classification tasks (SEQ_CLS, TOKEN_CLS) keep the new head trainable (modules_to_save);
    without one the new, random head would stay frozen. Copied, so the caller's config is left as given."""
    if peft_config is None or str(getattr(peft_config, "task_type", None)) in (task_type, f"TaskType.{task_type}"):
        return peft_config
    logger.info("%s: peft_config.task_type=%r -> %r so the classification head is trained",
                who, getattr(peft_config, "task_type", None), task_type)
    peft_config = copy.deepcopy(peft_config)
    peft_config.task_type = task_type
    return peft_config


def pooled_positions(ids: torch.Tensor, lengths: torch.Tensor, pad_id: int | None,
                     index: torch.Tensor | None = None) -> torch.Tensor:
    """For each sequence of a padding-free row ``ids`` ``[N]``, the place in the row its classifier
    reads: its last token that is not ``pad_id`` (its first when all are), as transformers pools padded
    rows. ``index`` ``[rows, ≥max(lengths)]``: where each sequence's tokens sit in the row (a
    prefix-shared batch's ``seq_index``); default, the sequences back to back in order."""
    lengths = lengths.to(ids.device)
    width = int(lengths.max())
    index = contiguous_index(lengths, width) if index is None else index[:, :width].to(ids.device)
    offsets = torch.arange(width, device=ids.device)
    readable = offsets < lengths[:, None]
    if pad_id is not None:
        readable &= ids[index] != pad_id
    last = torch.where(readable, offsets, 0).amax(1)
    return index.gather(1, last[:, None])[:, 0]


def score_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The per-token ``score`` layer of a decoder's sequence classifier (inside DDP and PEFT
    wrappers; PEFT's trained copy of it), or None."""
    model = getattr(model, "module", model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(model, "score", None)


class RewardTrainer(PlaitTrainer):
    """Bradley-Terry reward modelling with ``reward_model.*`` losses composed by name."""

    method = "reward_model"
    config_class = RewardConfig
    auto_model_class = ScalarRewardModel

    def __init__(self, model, args=None, peft_config=None, **kwargs):
        super().__init__(model, args=args, peft_config=head_trainable(peft_config), **kwargs)

    def validate(self, args) -> None:
        p = args.params
        self.objective = Objective.build(
            p.loss_specs(), self.plugins.losses, family="reward_model", consumes=PairwiseRewards,
            shared={"center_rewards_coefficient": p.center_rewards_coefficient or 0.0},
            metrics=PairwiseRewards.reward_metrics,
        )

    def before_peft(self, model, args, **kwargs):
        name = type(model).__name__
        if not name.endswith("ForSequenceClassification"):
            raise PlaitError(f"model is a {name}; a reward model is a …ForSequenceClassification with num_labels=1: "
                             "pass the checkpoint's path (a new score head is added) or load it with "
                             "AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)")
        if model.config.num_labels != 1:
            raise PlaitError(f"model has num_labels={model.config.num_labels}, but reward models require "
                             "`num_labels=1` (one score per sequence): load it with num_labels=1")
        return super().before_peft(model, args, **kwargs)

    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        p = args.params
        if p.truncation_mode is not None:
            return prepare_dataset(
                dataset, processing_class, "preference", plugins=self.plugins, max_length=p.max_length,
                truncation_mode=p.truncation_mode, num_proc=p.dataset_num_proc,
            )
        dataset = prepare_dataset(dataset, processing_class, "preference", plugins=self.plugins,
                                  num_proc=p.dataset_num_proc)
        return drop_longer_pairs(dataset, p.max_length, split)

    def wants_padding_free(self, args) -> bool | None:
        wanted = args.params.padding_free
        if score_head(self._policy) is not None:
            return wanted
        if wanted:  # its per-token scores are what a packed row's sequences are read from
            raise PlaitError(f"padding_free=True needs a classifier with a per-token `score` head; "
                             f"{type(self._policy).__name__} has none: set padding_free=False")
        return False  # a classifier without one pools inside its forward

    def wants_prefix_sharing(self, args) -> bool | None:
        return args.params.prefix_sharing

    def make_collator(self, processing_class, args):
        name = preference_collator_name(self.padding_free, self.prefix_sharing)
        return self.collator(name, processing_class, pad_to_multiple_of=args.params.pad_to_multiple_of)

    def after_init(self) -> None:
        # The classifier scores the last token that is not padding: it must know the pad id the
        # collator pads with (and the saved checkpoint must, for whoever scores with it later).
        config, pad_id = self.model.config.get_text_config(), pad_token_id(self.processing_class)
        if config.pad_token_id != pad_id:
            config.pad_token_id = pad_id

    def eval_predictions(self, model, inputs):
        """As TRL 1.16 hands them to ``compute_metrics``: the scores ``[2B, 1]`` of the batch's rows
        (its chosen completions, then its rejected ones) and no labels."""
        return self.scores(model, inputs)[:, None], ()

    def scores(self, model, inputs) -> torch.Tensor:
        """Each row's score ``[2B]``: the head read at the row's last token that is not the pad id
        (transformers' pooling, which skips a trailing EOS where EOS is the pad token, as SmolLM2's
        is). Padded rows: the classifier's own pooled output. A padding-free row: one forward, the
        head's per-token output (caught on its way out) read at that token of each sequence."""
        if "position_ids" not in inputs:
            return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False).logits[:, 0]
        per_token = []
        catch = score_head(model).register_forward_hook(lambda module, args, output: per_token.append(output))
        try:
            model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False)
        finally:
            catch.remove()
        scored = pooled_positions(inputs["input_ids"][0], inputs["seq_lengths"], self._policy.config.get_text_config().pad_token_id,
                                  inputs.get("seq_index"))
        return per_token[0][0, scored.to(per_token[0].device), 0]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rewards = self.scores(model, inputs)
        chosen, rejected = rewards.float().chunk(2)
        if "margin" in inputs:
            batch = PairwiseRewards(chosen, rejected, inputs["margin"].to(chosen.dtype))
        else:
            batch = PairwiseRewards(chosen, rejected)
        loss, parts = self.objective(batch)
        self.record(self.objective.metrics(batch, parts))
        return (loss, rewards) if return_outputs else loss


@hookimpl
def register_methods(register):
    register("method.reward_model", Method(config=RewardConfig, trainer=RewardTrainer, loss_family="reward_model",
                                           summary="Reward modelling: a scalar-head sequence classifier, Bradley-Terry loss"))
