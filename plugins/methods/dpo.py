"""DPO: Direct Preference Optimization (Rafailov et al. 2023) with every loss variant as a plugin.

One forward over 2B rows [chosen…; rejected…] gives the policy's summed completion log-probs;
the reference's come from a frozen copy, the policy with adapters off (PEFT), or a precomputed
cache. The method packs both into a :class:`plait.engine.batches.PreferenceLogps` with the configured
f-divergence and hands it to the composed ``dpo.*`` losses; it never names a loss itself.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import attrs
import torch

from plait import Method, PlaitError, hookimpl
from plait.data.prepare import prepare_dataset
from plait.engine.batches import PreferenceLogps, logit_metrics, masked_mean
from plait.engine.config import method_config
from plait.engine.divergences import f_divergence
from plait.engine.layout import pad_multiple_field, row_token_logprobs
from plait.engine.models import ReferenceSync
from plait.engine.objective import LossChoice, Objective
from plait.params import in_range, positive
from plait.plugins.data.collators.preference import preference_collator_name

from ._reference import ReferenceTrainer

logger = logging.getLogger("plait")

def _optional(validator):
    return attrs.validators.optional(validator)


@attrs.define
class DPOParams(ReferenceSync, LossChoice):
    """DPO's own knobs (TR-DPO's from :class:`ReferenceSync`); names and defaults follow TRL's DPOConfig."""

    field_help: ClassVar[dict[str, str]] = {
        "beta": "DPO's beta: how strongly the policy is held to the reference (larger: closer)",
        "label_smoothing": "probability that a pair's label is flipped (0 to 0.5; cdpo, robust, exo_pair, aot)",
        "f_divergence_type": "divergence to the reference: reverse_kl, forward_kl, js_divergence or alpha_divergence",
        "f_alpha_divergence_coef": "alpha of alpha_divergence",
        "max_length": "most tokens of prompt + completion; longer rows are cut per truncation_mode (null: no limit)",
        "truncation_mode": "'keep_start' cuts the completion's end, 'keep_end' the prompt's start first",
        "pad_to_multiple_of": "round batch lengths up to this multiple (null: never; auto: 128 on AWS Neuron only)",
        "padding_free": "chosen and rejected back to back in one row, no padding (null: where the attention can)",
        "prefix_sharing": "in a padding-free batch, compute each pair's prompt once (null: where the attention can)",
        "discopop_tau": "DiscoPOP's temperature tau (loss_type discopop)",
        "precompute_ref_log_probs": "compute the reference's log-probs once before training, so no reference is loaded",
        "precompute_ref_batch_size": "batch size of that precomputation (null: per_device_train_batch_size)",
        "ld_alpha": "LD-DPO: weight of completion tokens beyond the shorter completion's length (null: off)",
        "use_weighting": "weight each pair by how likely the policy is to sample it (WPO)",
        "weighting_cap": "upper bound of a pair's WPO weight (null: none; WPO's authors use 1)",
        "model_init_kwargs": "keyword arguments for the policy's from_pretrained (dtype, attn_implementation, ...)",
        "ref_model_init_kwargs": "keyword arguments for from_pretrained of a ref_model given as a path or hub id",
        "dataset_num_proc": "worker processes that tokenise the dataset (null: the main process only)",
    }

    default_loss = "sigmoid"
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = attrs.field(default=0.5, validator=positive)
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | str | None = pad_multiple_field()
    # chosen and rejected sequences back to back in one row, no padding (plait.plugins.data.collators.preference);
    # None: where the models' attention runs per sequence (plait.engine.attention; TRL 1.16 defaults False)
    padding_free: bool | None = None
    # plait's: in a padding-free batch each pair's prompt is computed once (plait.engine.attention.packed_segments);
    # None: where the models' attention can (plait_sdpa)
    prefix_sharing: bool | None = None
    # DiscoPOP's temperature (loss_type='discopop'; Lu et al. 2024)
    discopop_tau: float = attrs.field(default=0.05, validator=positive)
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    ld_alpha: float | None = attrs.field(default=None, validator=_optional(in_range(0.0, 1.0)))
    use_weighting: bool = False
    # WPO's authors cap each pair's weight at 1 in their code (wzhouad/WPO); TRL 1.16 does not (None).
    weighting_cap: float | None = attrs.field(default=None, validator=_optional(positive))
    model_init_kwargs: dict | None = None
    ref_model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        f_divergence(self.f_divergence_type, self.f_alpha_divergence_coef)  # unknown names fail now


DPOConfig = method_config(
    "DPOConfig", DPOParams,
    defaults={"learning_rate": 1e-6, "logging_steps": 10, "remove_unused_columns": False, "disable_dropout": True},
)


class DPOTrainer(ReferenceTrainer):
    """Preference optimisation against a reference, with losses composed by name."""

    method = "dpo"
    config_class = DPOConfig

    def validate(self, args) -> None:
        p = args.params
        self.objective = Objective.build(
            p.loss_specs(), self.plugins.losses, family="dpo", consumes=PreferenceLogps,
            shared={"beta": p.beta, "label_smoothing": p.label_smoothing, "discopop_tau": p.discopop_tau},
            metrics=lambda batch: batch.reward_metrics(p.beta),
        )
        self.divergence = f_divergence(p.f_divergence_type, p.f_alpha_divergence_coef)
        self._check_losses_support(p)

    def _check_losses_support(self, p) -> None:
        """Each loss declares what it supports when it registers; refuse or flag what it does not."""
        terms = self.objective.terms
        if p.f_divergence_type != "reverse_kl":
            # f-DPO (Wang et al. 2024) leaves β·log Z(x) in each score: it cancels only in chosen − rejected
            refused = [t.name for t in terms if not t.component.options.f_divergence]
            if refused:
                raise PlaitError(f"f_divergence_type={p.f_divergence_type!r} does not apply to {refused}: only losses "
                                 "built on the chosen − rejected difference register f_divergence=True; use "
                                 "f_divergence_type='reverse_kl' with them")
        if p.use_weighting:
            refused = [t.name for t in terms if t.component.options.sorts_batch]
            if refused:
                raise PlaitError(f"use_weighting=True weighs each pair's loss, but {refused} sort the batch (entry k "
                                 "is the k-th quantile, not pair k); set use_weighting=False or pick another loss")
        if p.label_smoothing and not any(_takes(t, "label_smoothing") for t in terms):
            logger.warning("DPO: label_smoothing=%s is read by none of %s (as in TRL 1.16, it serves cdpo, robust, "
                           "exo_pair, aot and aot_unpaired); for conservative DPO use loss_type='cdpo'",
                           p.label_smoothing, [t.name for t in terms])

    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        p = args.params
        dataset = prepare_dataset(
            dataset, processing_class, "preference", plugins=self.plugins, max_length=p.max_length,
            truncation_mode=p.truncation_mode, num_proc=p.dataset_num_proc,
        )
        if p.precompute_ref_log_probs:
            dataset = self.with_reference_logps(
                dataset, processing_class, args, ("ref_chosen_logps", "ref_rejected_logps"),
                lambda batch: self.reference(self._policy, lambda m: self.completion_logps(m, batch)[0]).chunk(2),
                ld_alpha=p.ld_alpha)
        return dataset

    def make_collator(self, processing_class, args):
        name = preference_collator_name(self.padding_free, self.prefix_sharing)
        return self.collator(name, processing_class, pad_to_multiple_of=args.params.pad_to_multiple_of)

    # -- one step -----------------------------------------------------------------------------
    def completion_logps(self, model, inputs) -> tuple[torch.Tensor, object]:
        """Summed log-probs over each row's completion (LD-DPO reweights the tail beyond the shorter one)."""
        out = row_token_logprobs(self.token_logprobs, model, inputs, completion_only=True, with_logit_mean=True,
                                 with_collision=self.args.params.use_weighting)
        return (out.logps * self._token_weights(inputs["completion_mask"])).sum(-1), out

    def _token_weights(self, mask: torch.Tensor) -> torch.Tensor:
        alpha = self.args.params.ld_alpha
        mask = mask.to(torch.float32)
        if alpha is None:
            return mask
        # LD-DPO (Liu et al. 2024, eq. 8): the shared-length prefix counts fully, the excess by α.
        position = mask.cumsum(-1)
        shorter = torch.minimum(*mask.sum(-1).chunk(2)).repeat(2).unsqueeze(-1)
        return torch.where(position <= shorter, 1.0, alpha) * mask

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps, out = self.completion_logps(model, inputs)
        if "ref_chosen_logps" in inputs:
            ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
        else:
            ref = self.reference(model, lambda m: self.completion_logps(m, inputs)[0])
        mask = inputs["completion_mask"]
        (chosen, rejected), (ref_chosen, ref_rejected) = logps.chunk(2), ref.chunk(2)
        lengths_chosen, lengths_rejected = mask.sum(-1).to(logps.dtype).chunk(2)
        p = self.args.params
        unweighted_chosen = (out.logps * mask).sum(-1).chunk(2)[0] if p.ld_alpha is not None else None
        batch = PreferenceLogps(chosen, rejected, ref_chosen, ref_rejected, lengths_chosen, lengths_rejected,
                                divergence=self.divergence, unweighted_chosen_logps=unweighted_chosen)
        weights = self._wpo_weights(out, mask, p.weighting_cap) if p.use_weighting else None
        loss, parts = self.objective(batch, example_weights=weights)
        self.record({**self.objective.metrics(batch, parts), **logit_metrics(out.logit_mean.detach(), mask)})
        return (loss, None) if return_outputs else loss

    @staticmethod
    def _wpo_weights(out, mask: torch.Tensor, cap: float | None) -> torch.Tensor:
        """WPO (Zhou et al. 2024, eq. 2 with weight alignment): weight each pair by how likely the policy is
        to sample it, exp(mean_t [log π(y_t) − log Σ_v π(v)²]) for chosen × rejected, no gradient; ``cap``
        bounds it (the authors' code uses 1; TRL 1.16 and plait's default: no cap)."""
        per_row = masked_mean((out.logps - out.collision).detach(), mask, dim=-1)
        chosen, rejected = per_row.chunk(2)
        weights = torch.exp(chosen + rejected)
        return weights if cap is None else weights.clamp(max=cap)


def _takes(term, name: str) -> bool:
    return term.component.params is not None and name in attrs.fields_dict(term.component.params)


@hookimpl
def register_methods(register):
    register("method.dpo", Method(config=DPOConfig, trainer=DPOTrainer, loss_family="dpo",
                           summary="Direct Preference Optimization with composable dpo.* losses"))
