"""SFT: supervised fine-tuning on any data layout the data layer recognises.

Language-modelling text or conversations, prompt-completion pairs (the loss on the completion
only by default), assistant-only loss on conversations, packing and padding-free batches.
The loss is a composition of ``sft.*`` plugins over per-token log-probs (``sft.nll`` by
default, ``sft.dft`` for dynamic fine-tuning), normalised by the number of target tokens in the
whole accumulated batch so gradient accumulation and several processes give the same update.
"""

from __future__ import annotations

import attrs
import torch

from plait import Method, hookimpl
from plait.batches import TokenLogps
from plait.config import method_config
from plait.data import pack_dataset, prepare_dataset
from plait.objective import LossChoice, Objective
from plait.params import positive
from plait.trainer import PlaitTrainer


@attrs.define
class SFTParams(LossChoice):
    """SFT's own knobs; names follow TRL's SFTConfig."""

    default_loss = "nll"
    max_length: int | None = attrs.field(default=1024, validator=attrs.validators.optional(positive))
    truncation_mode: str = "keep_start"
    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None


SFTConfig = method_config(
    "SFTConfig", SFTParams,
    defaults={"learning_rate": 2e-5, "logging_steps": 10, "remove_unused_columns": False},
)


class SFTTrainer(PlaitTrainer):
    """Supervised fine-tuning with composable ``sft.*`` token losses."""

    method = "sft"
    config_class = SFTConfig

    def validate(self, args) -> None:
        p = args.params
        self.objective = Objective.build(p.loss_specs(), self.plugins.losses, family="sft", consumes=TokenLogps)
        if p.packing:
            self.plugins.packing_strategies.get(p.packing_strategy, family="packing")  # unknown names fail now
        self.tokens_seen = 0

    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        p = args.params
        dataset = prepare_dataset(
            dataset, processing_class, "language_modeling", plugins=self.plugins, max_length=p.max_length,
            truncation_mode=p.truncation_mode, completion_only_loss=p.completion_only_loss,
            assistant_only_loss=p.assistant_only_loss, num_proc=p.dataset_num_proc,
        )
        if p.packing:
            dataset = pack_dataset(dataset, p.packing_strategy, p.max_length, plugins=self.plugins)
        return dataset

    def make_collator(self, processing_class, args):
        p = args.params
        flat = p.padding_free or p.packing  # packed rows are several documents: positions restart per document
        name = "collator.padding_free" if flat else "collator.language_modeling"
        return self.plugins.collators.get(name).obj(processing_class, pad_to_multiple_of=p.pad_to_multiple_of)

    def after_init(self) -> None:
        # Normalise by target tokens across accumulation steps and processes (transformers counts them).
        self.model_accepts_loss_kwargs = True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        model_inputs = {k: inputs[k] for k in ("attention_mask", "position_ids") if k in inputs}
        out = self.token_logprobs(model, inputs["input_ids"], with_argmax=True, **model_inputs)
        mask = labels != -100
        mask[:, 0] = False  # nothing predicts a row's first token
        loss, parts = self.objective(TokenLogps(out.logps, mask), mask=mask, num_tokens=num_items_in_batch)
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients; the count was global

        correct = (out.argmax == inputs["input_ids"]) & mask
        tokens = mask.sum()
        if self.model.training:
            self.tokens_seen += int(self.accelerator.gather_for_metrics(tokens.reshape(1)).sum())
        metrics = {"mean_token_accuracy": correct.sum() / tokens.clamp(min=1), "num_tokens": self.tokens_seen}
        if len(parts) > 1:
            metrics.update({f"loss/{name}": value.detach() for name, value in parts.items()})
        self.record(metrics)
        return (loss, None) if return_outputs else loss


@hookimpl
def register_methods(register):
    register("method.sft", Method(config=SFTConfig, trainer=SFTTrainer, loss_family="sft",
                                  summary="Supervised fine-tuning with composable sft.* token losses"))
