"""KTO: Kahneman-Tversky Optimization (Ethayarajh et al. 2024) on unpaired good/bad examples.

Each example is a prompt, one completion and a boolean label (desirable or not); preference
pairs are split into one desirable and one undesirable example by the data layer. The reference
point z is the policy/reference log-ratio on *mismatched* pairs (prompt i with the completion
of another example in the batch, built by ``collator.unpaired``), averaged over every process
and clamped at 0, without gradient (paper, Sec. 4.1). The method packs the log-probs into a
:class:`plait.batches.UnpairedLogps` and hands it to the composed ``kto.*`` losses (``kto.kto``
by default, ``kto.apo_zero_unpaired``). The reference is handled as in DPO: a frozen copy, the
policy with adapters off under PEFT, or log-probs precomputed once.
"""

from __future__ import annotations

import logging

import attrs
import torch

from plait import Method, hookimpl
from plait.batches import UnpairedLogps
from plait.config import method_config
from plait.data import prepare_dataset
from plait.objective import LossChoice, Objective
from plait.params import positive
from plait.plugins.data._collate import check_multiple, pad_token_id, padded_batch, sequences

from ._reference import ReferenceTrainer

logger = logging.getLogger("plait")


@attrs.define
class KTOParams(LossChoice):
    """KTO's own knobs; names follow TRL's KTOConfig."""

    default_loss = "kto"
    beta: float = attrs.field(default=0.1, validator=positive)
    desirable_weight: float = attrs.field(default=1.0, validator=positive)
    undesirable_weight: float = attrs.field(default=1.0, validator=positive)
    max_length: int | None = attrs.field(default=1024, validator=attrs.validators.optional(positive))
    truncation_mode: str = "keep_end"
    pad_to_multiple_of: int | None = None
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    model_init_kwargs: dict | None = None
    ref_model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None


KTOConfig = method_config(
    "KTOConfig", KTOParams,
    defaults={"learning_rate": 1e-6, "logging_steps": 10, "remove_unused_columns": False},
)


def check_class_balance(labels, desirable_weight: float, undesirable_weight: float) -> float:
    """λ_D·n_D / (λ_U·n_U); warn when it leaves [1, 4/3], the range the KTO paper recommends (Sec. 4.2)."""
    n_desirable = sum(bool(x) for x in labels)
    n_undesirable = len(labels) - n_desirable
    ratio = desirable_weight * n_desirable / (undesirable_weight * n_undesirable) if n_undesirable else float("inf")
    if not 1.0 <= ratio <= 4 / 3:
        low = undesirable_weight * n_undesirable / max(n_desirable, 1)
        logger.warning(
            "KTO: desirable_weight·n_desirable / (undesirable_weight·n_undesirable) = %.2f·%d / (%.2f·%d) = %.2f is "
            "outside [1, 4/3]; set desirable_weight in [%.2f, %.2f] (or rebalance the data) so neither class dominates",
            desirable_weight, n_desirable, undesirable_weight, n_undesirable, ratio, low, 4 / 3 * low,
        )
    return ratio


class _UnpairedBatches:
    """``collator.unpaired`` plus what a precomputed reference adds to each row: its cached
    log-probs, and the fixed mismatched completion its cached KL log-prob was computed for."""

    def __init__(self, collate, processing_class, pad_to_multiple_of):
        self.collate = collate
        self.pad_id, self.multiple = pad_token_id(processing_class), check_multiple(pad_to_multiple_of)

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.collate(rows)
        if "kl_completion_ids" in rows[0]:
            pairs = sequences([r["prompt_ids"] for r in rows], [r["kl_completion_ids"] for r in rows])
            batch.update(padded_batch(*pairs, self.pad_id, self.multiple, prefix="kl_"))
        for key in ("ref_logps", "ref_kl_logps"):
            if key in rows[0]:
                batch[key] = torch.tensor([float(r[key]) for r in rows], dtype=torch.float32)
        return batch


class KTOTrainer(ReferenceTrainer):
    """Unpaired preference optimisation against a reference, with ``kto.*`` losses composed by name."""

    method = "kto"
    config_class = KTOConfig

    def validate(self, args) -> None:
        p = args.params
        shared = {"beta": p.beta, "desirable_weight": p.desirable_weight, "undesirable_weight": p.undesirable_weight}
        self.objective = Objective.build(p.loss_specs(), self.plugins.losses, family="kto", consumes=UnpairedLogps,
                                         shared=shared)
        if args.per_device_train_batch_size < 2:
            logger.warning("KTO: per_device_train_batch_size=1 pairs each prompt with its own completion, so the KL "
                           "estimate z equals the example's own log-ratio; use a batch of 2 or more")

    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        p = args.params
        dataset = prepare_dataset(
            dataset, processing_class, "unpaired", plugins=self.plugins, max_length=p.max_length,
            truncation_mode=p.truncation_mode, num_proc=p.dataset_num_proc,
        )
        if split == "train":
            check_class_balance(dataset["label"], p.desirable_weight, p.undesirable_weight)
        if p.precompute_ref_log_probs:
            # each row's mismatched partner (the previous row's completion) is fixed before the reference sees it
            completions = list(dataset["completion_ids"])
            dataset = dataset.add_column("kl_completion_ids", completions[-1:] + completions[:-1])
            dataset = self.with_reference_logps(
                dataset, processing_class, args, ("ref_logps", "ref_kl_logps"),
                lambda batch: [self.reference(self._policy, lambda m: self.completion_logps(m, batch, prefix))
                               for prefix in ("", "kl_")])
        return dataset

    def make_collator(self, processing_class, args):
        factory = self.plugins.collators.get("collator.unpaired").obj
        pad_to = args.params.pad_to_multiple_of
        return _UnpairedBatches(factory(processing_class, pad_to_multiple_of=pad_to), processing_class, pad_to)

    # -- one step -----------------------------------------------------------------------------
    def completion_logps(self, model, inputs, prefix: str = "") -> torch.Tensor:
        """Summed log-probs of each row's completion, ``[B]`` (``prefix="kl_"``: the mismatched pairs)."""
        out = self.token_logprobs(model, inputs[f"{prefix}input_ids"], inputs[f"{prefix}attention_mask"])
        return (out.logps * inputs[f"{prefix}completion_mask"]).sum(-1)

    def kl_logratios(self, model, inputs) -> torch.Tensor:
        """log π − log π_ref of every mismatched pair in this batch, ``[B]``, without gradient."""
        with torch.no_grad():
            policy = self.completion_logps(model, inputs, "kl_")
        if "ref_kl_logps" in inputs:
            return policy - inputs["ref_kl_logps"]
        return policy - self.reference(model, lambda m: self.completion_logps(m, inputs, "kl_"))

    def kl_estimate(self, model, inputs) -> torch.Tensor:
        """z = max(0, mean of the mismatched pairs' log-ratios over every process), a 0-dim tensor."""
        ratios = self.kl_logratios(model, inputs).float()
        # sum and count rather than a mean per process: ranks may hold different batch sizes
        totals = self.accelerator.gather(torch.stack([ratios.sum(), ratios.new_tensor(ratios.numel())])[None])
        total, count = totals.reshape(-1, 2).sum(0)
        return (total / count).clamp(min=0).detach()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps = self.completion_logps(model, inputs)
        if "ref_logps" in inputs:
            ref = inputs["ref_logps"]
        else:
            ref = self.reference(model, lambda m: self.completion_logps(m, inputs))
        desirable = inputs["label"].bool()
        batch = UnpairedLogps(logps, ref, desirable, self.kl_estimate(model, inputs))
        loss, parts = self.objective(batch)

        rewards, logps = self.args.params.beta * batch.logratios.detach(), logps.detach()
        chosen, rejected = rewards[desirable], rewards[~desirable]
        metrics = {
            "rewards/chosen": _mean(chosen), "rewards/rejected": _mean(rejected),
            "rewards/margins": _mean(chosen) - _mean(rejected),  # NaN unless both classes are present
            "logps/chosen": _mean(logps[desirable]), "logps/rejected": _mean(logps[~desirable]),
            "kl": batch.kl_logratio,
        }
        if len(parts) > 1:
            metrics.update({f"loss/{name}": value.detach() for name, value in parts.items()})
        self.record(metrics)  # NaN entries (a class absent from a batch) are skipped when logged
        return (loss, None) if return_outputs else loss


def _mean(values: torch.Tensor) -> torch.Tensor:
    return values.mean() if values.numel() else values.new_tensor(float("nan"))


@hookimpl
def register_methods(register):
    register("method.kto", Method(config=KTOConfig, trainer=KTOTrainer, loss_family="kto",
                                  summary="Kahneman-Tversky Optimization on unpaired desirable/undesirable examples"))
