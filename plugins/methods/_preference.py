"""The reference-free offline preference methods (ORPO, CPO), in one place.

Their data is DPO's: preference rows prepared as ``plait dpo`` prepares them (prompt, chosen and
rejected ids; ``keep_start`` truncation at ``max_length``, a pair whose prompt leaves no room
dropped) and collated as DPO's: padding-free with each pair's prompt computed once where the
model's attention can (``padding_free``, ``prefix_sharing``), else ``collator.preference``'s 2B
padded rows [chosen…; rejected…]. One forward
gives the policy's summed completion log-probs; no reference model is loaded, so the
:class:`plait.engine.batches.PreferenceLogps` the losses get carries zeros as the reference's log-probs,
and a ``dpo.*`` loss composed with them is its reference-free form. What TRL 1.16 logs follows the
objective's convention (:meth:`plait.engine.objective.Objective.metrics`): the preference family's
rewards/* and logps/* (β·log π here), replaced or extended by the losses' ``metrics=`` (CPO's shaped
rewards, ORPO's log-odds); the method adds logits/* and nll_loss.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from plait import PlaitError
from plait.data.prepare import prepare_dataset
from plait.engine.batches import PreferenceLogps, logit_metrics
from plait.engine.layout import pad_multiple_field, row_token_logprobs, rows_attended
from plait.engine.objective import LossChoice, Objective
from plait.engine.trainer import PlaitTrainer
from plait.params import positive
from plait.plugins.data.collators.preference import preference_collator_name

from ._reference import PaddingFreeRows

# TrainingArguments defaults TRL 1.16's ORPOConfig and CPOConfig override
CONFIG_DEFAULTS = {"learning_rate": 1e-6, "logging_steps": 10, "remove_unused_columns": False, "disable_dropout": True}


@attrs.define
class PreferenceParams(LossChoice):
    """The fields ORPOConfig and CPOConfig share (TRL 1.16's names and defaults)."""

    field_help: ClassVar[dict[str, str]] = {
        "beta": "inverse temperature beta of the preference loss (larger: a sharper preference)",
        "max_length": "most tokens of prompt + completion; longer rows are cut per truncation_mode (null: no limit)",
        "max_completion_length": "TRL's limit for encoder-decoder models; ignored for causal LMs",
        "truncation_mode": "'keep_start' cuts the completion's end, 'keep_end' the prompt's start first",
        "pad_to_multiple_of": "round batch lengths up to this multiple (null: never; auto: 128 on AWS Neuron only)",
        "padding_free": "chosen and rejected back to back in one row, no padding (null: where the attention can)",
        "prefix_sharing": "in a padding-free batch, compute each pair's prompt once (null: where the attention can)",
        "padding_value": "TRL's padding id; must stay null (plait pads with the tokenizer's pad token)",
        "generate_during_eval": "TRL's sampling in evaluation; must stay false (use LogCompletionsCallback)",
        "is_encoder_decoder": "TRL's encoder-decoder switch; must stay null (plait trains causal LMs)",
        "model_init_kwargs": "keyword arguments for the policy's from_pretrained (dtype, attn_implementation, ...)",
        "dataset_num_proc": "worker processes that tokenise the dataset (null: the main process only)",
    }

    beta: float = attrs.field(default=0.1, validator=positive)
    max_length: int | None = 1024
    # TRL reads it for encoder-decoder models only; plait trains causal LMs, where TRL ignores it too
    max_completion_length: int | None = None
    truncation_mode: str = "keep_start"  # plait's, as DPOConfig's
    pad_to_multiple_of: int | str | None = pad_multiple_field()
    # plait's, as DPOConfig's (TRL 1.16's ORPO and CPO pad): the pairs back to back in one row, and
    # each pair's prompt computed once; None: where the models' attention can (plait.engine.attention)
    padding_free: bool | None = None
    prefix_sharing: bool | None = None
    padding_value: int | None = None
    generate_during_eval: bool = False
    is_encoder_decoder: bool | None = None
    model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.is_encoder_decoder:
            raise PlaitError("is_encoder_decoder=True: plait trains causal language models; leave it None")
        if self.padding_value is not None:
            raise PlaitError(f"padding_value={self.padding_value!r}: plait pads with the tokenizer's pad token and "
                             "padded positions never reach a loss; leave it None (pad_token sets the token)")
        if self.generate_during_eval:
            raise PlaitError("generate_during_eval=True is not supported; leave it False and add "
                             "plait.LogCompletionsCallback to see completions during evaluation")


class PreferenceTrainer(PaddingFreeRows, PlaitTrainer):
    """Base of the reference-free preference methods; subclasses set ``nll_loss`` (the loss whose
    value is logged as nll_loss), ``shared`` (the config fields that fill the losses' parameters
    of the same name) and ``trains_on_prompt`` (whether batches carry the chosen rows'
    whole-sequence log-probs), and may extend :meth:`loss_specs`."""

    nll_loss: ClassVar[str]
    shared: ClassVar[tuple[str, ...]] = ("beta",)
    trains_on_prompt: ClassVar[bool] = False
    takes_images = True  # ORPO, CPO: the forward is row_token_logprobs, which passes the rows' images

    def loss_specs(self, p) -> list[dict]:
        return p.loss_specs()

    def validate(self, args) -> None:
        p = args.params
        self.objective = Objective.build(self.loss_specs(p), self.plugins.losses, family=self.method,
                                         consumes=PreferenceLogps, shared={k: getattr(p, k) for k in self.shared},
                                         metrics=lambda batch: batch.reward_metrics(p.beta))

    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        p = args.params
        return prepare_dataset(dataset, processing_class, "preference", plugins=self.plugins, max_length=p.max_length,
                               truncation_mode=p.truncation_mode, num_proc=p.dataset_num_proc)

    def make_collator(self, processing_class, args):
        name = preference_collator_name(self.padding_free, self.prefix_sharing)
        return self.collator(name, processing_class, pad_to_multiple_of=args.params.pad_to_multiple_of)

    def preference_logps(self, model, inputs) -> tuple[PreferenceLogps, torch.Tensor]:
        """The policy's log-probs of the 2B rows as a reference-free batch, and each row's mean logit."""
        out = row_token_logprobs(self.token_logprobs, model, inputs, completion_only=not self.trains_on_prompt,
                                 with_logit_mean=True)
        mask = inputs["completion_mask"]
        chosen, rejected = (out.logps * mask).sum(-1).chunk(2)
        lengths_chosen, lengths_rejected = mask.sum(-1).to(chosen.dtype).chunk(2)
        zeros = chosen.detach().new_zeros(chosen.shape)
        whole = {}
        if self.trains_on_prompt:  # every token with an attended predecessor, the prompt's included
            attended = rows_attended(inputs)
            predicted = torch.cat([torch.zeros_like(attended[:, :1]), attended[:, 1:] * attended[:, :-1]], dim=1)
            whole = {"chosen_sequence_logps": (out.logps * predicted).sum(-1).chunk(2)[0],
                     "chosen_sequence_lengths": predicted.sum(-1).to(chosen.dtype).chunk(2)[0]}
        batch = PreferenceLogps(chosen, rejected, zeros, zeros, lengths_chosen, lengths_rejected, **whole)
        return batch, out.logit_mean.detach()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch, logit_mean = self.preference_logps(model, inputs)
        loss, parts = self.objective(batch)
        self.record({**self.objective.metrics(batch, parts), **logit_metrics(logit_mean, inputs["completion_mask"]),
                     "nll_loss": self.nll_value(batch, parts)})
        return (loss, None) if return_outputs else loss

    def nll_value(self, batch: PreferenceLogps, parts: dict) -> torch.Tensor:
        """The NLL term's mean, logged as TRL 1.16's nll_loss whether or not the objective composes it."""
        if self.nll_loss in parts:
            return parts[self.nll_loss].detach()
        with torch.no_grad():
            return self.plugins.losses.get(self.nll_loss).obj(batch, None).mean()
