"""KTO: Kahneman-Tversky Optimization (Ethayarajh et al. 2024) on unpaired good/bad examples.

Each example is a prompt, one completion and a boolean label (desirable or not); preference
pairs are split into one desirable and one undesirable example by the data layer. The reference
point z is the policy/reference log-ratio on *mismatched* pairs (prompt i with the completion
of another example), averaged over every process and clamped at 0, without gradient (paper,
Sec. 4.1). Each row's partner is fixed when the data is prepared (:func:`mismatched_partners`):
never a row with the same prompt, and under TRL's default sequential sampling one of the rows
of its own batch. The method packs the log-probs into a :class:`plait.engine.batches.UnpairedLogps`
and hands it to the composed ``kto.*`` losses (``kto.kto`` by default, ``kto.apo_zero_unpaired``).
The reference is handled as in DPO: a frozen copy, the policy with adapters off under PEFT, a
frozen adapter copy for a PEFT policy, or log-probs precomputed once; TR-DPO's sync applies.
A row and its mismatched pair begin with the same prompt: where batches share prompts
(``prefix_sharing``), the reference scores both in one forward that holds the prompt once.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Sequence

import attrs
import torch
from datasets import Dataset

from plait import Method, hookimpl
from plait.data.prepare import is_stream, prepare_dataset
from plait.engine.batches import UnpairedLogps
from plait.engine.config import method_config
from plait.engine.layout import pad_multiple_field, row_token_logprobs
from plait.engine.models import ReferenceSync
from plait.engine.objective import LossChoice, Objective
from plait.params import positive

from ._reference import ReferenceTrainer

logger = logging.getLogger("plait")


@attrs.define
class KTOParams(ReferenceSync, LossChoice):
    """KTO's own knobs (TR-DPO's from :class:`ReferenceSync`); names and defaults follow TRL's KTOConfig.

    ``truncation_mode`` is plait's: TRL 1.16 always keeps the start (``keep_start``, the default)."""

    field_help: ClassVar[dict[str, str]] = {
        "beta": "KTO's beta: how strongly the policy is held to the reference (larger: closer)",
        "desirable_weight": "weight lambda_D of the loss on desirable examples",
        "undesirable_weight": "weight lambda_U of the loss on undesirable examples",
        "max_length": "most tokens of prompt + completion; longer rows are cut per truncation_mode (null: no limit)",
        "truncation_mode": "'keep_start' cuts the completion's end, 'keep_end' the prompt's start first",
        "pad_to_multiple_of": "round batch lengths up to this multiple (null: never; auto: 128 on AWS Neuron only)",
        "padding_free": "each side's sequences back to back in one row, no padding (null: where the attention can)",
        "prefix_sharing": "in a padding-free batch, compute each distinct prompt once (null: where the attention can)",
        "precompute_ref_log_probs": "compute the reference's log-probs once before training, so no reference is loaded",
        "precompute_ref_batch_size": "batch size of that precomputation (null: per_device_train_batch_size)",
        "model_init_kwargs": "keyword arguments for the policy's from_pretrained (dtype, attn_implementation, ...)",
        "ref_model_init_kwargs": "keyword arguments for from_pretrained of a ref_model given as a path or hub id",
        "dataset_num_proc": "worker processes that tokenise the dataset (null: the main process only)",
    }

    default_loss = "kto"
    beta: float = attrs.field(default=0.1, validator=positive)
    desirable_weight: float = attrs.field(default=1.0, validator=positive)
    undesirable_weight: float = attrs.field(default=1.0, validator=positive)
    max_length: int | None = attrs.field(default=1024, validator=attrs.validators.optional(positive))
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | str | None = pad_multiple_field()
    # plait's (TRL 1.16's KTOConfig has none): each side's sequences back to back in one row, no padding;
    # None: where the models' attention runs per sequence (plait.engine.attention)
    padding_free: bool | None = None
    # plait's: in a padding-free batch each distinct prompt computed once, and the reference scores a row
    # and its mismatched pair in one forward over the prompt; None: where the models' attention reads
    # branches (plait.engine.attention.shares_prefixes)
    prefix_sharing: bool | None = None
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    model_init_kwargs: dict | None = None
    ref_model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None


KTOConfig = method_config(
    "KTOConfig", KTOParams,
    # sequential: a batch is consecutive rows, so its mismatched completions are its own (TRL's default)
    defaults={"learning_rate": 1e-6, "logging_steps": 10, "remove_unused_columns": False, "disable_dropout": True,
              "train_sampling_strategy": "sequential"},
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


def mismatched_partners(prompts: Sequence[Sequence[int]], batch_size: int) -> list[int]:
    """For each row, the row whose completion its KL pair borrows; never a row with the same prompt.

    Rows are taken in consecutive blocks of ``batch_size``, the batches a sequential sampler
    serves: within a block, the smallest rotation under which no row meets its own prompt, so
    the mismatched completions of a batch are the batch's own completions, as the KTO paper
    recommends (Sec. 4.1; TRL 1.16 always rotates by one). A block no rotation clears (a single
    row, or one prompt filling most of it) borrows, row by row, the nearest earlier row of the
    dataset with another prompt. Only when every row has the same prompt does a row borrow
    another row's completion for it. Deterministic: the same rows give the same partners.
    """
    index: dict[tuple, int] = {}
    keys = [index.setdefault(tuple(p), len(index)) for p in prompts]
    partners: list[int] = []
    for start in range(0, len(keys), batch_size):
        block = keys[start:start + batch_size]
        size = len(block)
        shift = next((s for s in range(1, size) if all(block[k] != block[k - s] for k in range(size))), None)
        if shift is not None:
            partners += [start + (k - shift) % size for k in range(size)]
        else:
            partners += [_nearest_other_prompt(keys, start + k) for k in range(size)]
    if len(index) == 1 and len(keys) > 1:
        logger.warning("KTO: every row has the same prompt, so each KL pair is that prompt with another row's "
                       "completion; the estimate z is only meaningful with several prompts")
    return partners


def _nearest_other_prompt(keys: list[int], row: int) -> int:
    for back in range(1, len(keys)):
        if keys[row - back] != keys[row]:  # negative indices wrap: the search is cyclic
            return (row - back) % len(keys)
    return (row - 1) % len(keys)  # one prompt throughout: another row, or the row itself when alone


ROW = "kto_row"  # a column numbering the rows while KTO prepares them


def _fit(completion: list[int], room: int, truncation_mode: str) -> list[int]:
    """``completion`` cut to ``room`` tokens from the side ``truncation_mode`` drops."""
    room = max(room, 0)
    if len(completion) <= room:
        return completion
    return completion[:room] if truncation_mode == "keep_start" else completion[len(completion) - room:]


class KTOTrainer(ReferenceTrainer):
    """Unpaired preference optimisation against a reference, with ``kto.*`` losses composed by name."""

    method = "kto"
    config_class = KTOConfig

    def validate(self, args) -> None:
        p = args.params
        shared = {"beta": p.beta, "desirable_weight": p.desirable_weight, "undesirable_weight": p.undesirable_weight}
        self.objective = Objective.build(p.loss_specs(), self.plugins.losses, family="kto", consumes=UnpairedLogps,
                                         shared=shared, metrics=lambda batch: batch.reward_metrics(p.beta))

    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        p = args.params
        numbered = isinstance(dataset, Dataset) and p.max_length is not None
        # numbered, to find each row's untruncated completion after rows were dropped
        rows = dataset.add_column(ROW, list(range(len(dataset)))) if numbered else dataset

        def prepared(max_length):
            return prepare_dataset(rows, processing_class, "unpaired", plugins=self.plugins, max_length=max_length,
                                   truncation_mode=p.truncation_mode, num_proc=p.dataset_num_proc)

        dataset, untruncated = prepared(p.max_length), None
        if numbered:  # the same rows again, whole: what they report was reported by the pass above
            level = logger.level
            logger.setLevel(logging.ERROR)
            try:
                untruncated = prepared(None)
            finally:
                logger.setLevel(level)
        if is_stream(dataset):
            return self.with_streamed_partners(dataset, args, split)
        if split == "train":
            check_class_balance(dataset["label"], p.desirable_weight, p.undesirable_weight)
        dataset = self.with_mismatched_completions(dataset, args, split, untruncated)
        if p.precompute_ref_log_probs:
            dataset = self.with_reference_logps(
                dataset, processing_class, args, ("ref_logps", "ref_kl_logps"),
                lambda batch: list(self.reference_logps(self._policy, batch)))
        return dataset

    @staticmethod
    def with_mismatched_completions(dataset, args, split: str, untruncated=None):
        """``dataset`` with each row's KL completion (``kl_completion_ids``) fixed by
        :func:`mismatched_partners` over the split's batches, cut so that the prompt and it fit
        ``max_length`` as ``truncation_mode`` says.

        The partner's completion is cut from its whole text (``untruncated``: the rows prepared without
        ``max_length``, matched by their ``ROW`` number), not from what was left of it beside its own
        prompt: a shorter borrowing prompt leaves it more room, as in TRL 1.16."""
        p = args.params
        size = args.per_device_train_batch_size if split == "train" else args.per_device_eval_batch_size
        prompts, completions = list(dataset["prompt_ids"]), list(dataset["completion_ids"])
        if untruncated is not None:  # a preference pair gives two rows of one ROW: its label tells them apart
            whole = dict(zip(zip(untruncated[ROW], untruncated["label"]), untruncated["completion_ids"]))
            completions = [whole[key] for key in zip(dataset[ROW], dataset["label"])]
            dataset = dataset.remove_columns(ROW)
        borrowed = [completions[j] for j in mismatched_partners(prompts, size)]
        if p.max_length is not None:
            borrowed = [_fit(c, p.max_length - len(prompt), p.truncation_mode) for prompt, c in zip(prompts, borrowed)]
        return dataset.add_column("kl_completion_ids", borrowed)

    @staticmethod
    def with_streamed_partners(dataset, args, split: str):
        """A stream's KL completions, fixed lazily by :func:`mismatched_partners` within each block of a batch's
        rows as they are read (the blocks the whole-dataset path rotates in; a block no rotation clears borrows
        from within itself only). Partners are cut from their truncated completions (the stream is tokenised
        once), and the class balance is not checked (the stream has no end to count to)."""
        p = args.params
        size = args.per_device_train_batch_size if split == "train" else args.per_device_eval_batch_size

        def partners(block: dict) -> dict:
            borrowed = [block["completion_ids"][j] for j in mismatched_partners(block["prompt_ids"], size)]
            if p.max_length is not None:
                borrowed = [_fit(c, p.max_length - len(prompt), p.truncation_mode)
                            for prompt, c in zip(block["prompt_ids"], borrowed)]
            return {**block, "kl_completion_ids": borrowed}

        return dataset.map(partners, batched=True, batch_size=size)

    def make_collator(self, processing_class, args):
        name = ("collator.unpaired_prefix_shared" if self.prefix_sharing
                else "collator.unpaired_padding_free" if self.padding_free else "collator.unpaired")
        return self.collator(name, processing_class, pad_to_multiple_of=args.params.pad_to_multiple_of)

    # -- one step -----------------------------------------------------------------------------
    def completion_logps(self, model, inputs, prefix: str = "") -> torch.Tensor:
        """Summed log-probs of each row's completion, ``[B]`` (``prefix="kl_"``: the mismatched pairs)."""
        out = row_token_logprobs(self.token_logprobs, model, inputs, prefix=prefix, completion_only=True)
        return (out.logps * inputs[f"{prefix}completion_mask"]).sum(-1)

    def reference_logps(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's summed log-probs of each row's completion and of its mismatched pair's, ``[B]``
        each: cached, or from one forward over both (``both_``, each prompt once) where the batch has it."""
        if "ref_logps" in inputs:
            return inputs["ref_logps"], inputs["ref_kl_logps"]
        if "both_input_ids" in inputs:
            return self.reference(model, lambda m: self.completion_logps(m, inputs, "both_")).chunk(2)
        return tuple(self.reference(model, lambda m: self.completion_logps(m, inputs, prefix)) for prefix in ("", "kl_"))

    def kl_logratios(self, model, inputs, reference: torch.Tensor | None = None) -> torch.Tensor:
        """log π − log π_ref of every mismatched pair in this batch, ``[B]``, without gradient
        (``reference``: the pairs' reference log-probs, when already computed)."""
        with torch.no_grad():
            policy = self.completion_logps(model, inputs, "kl_")
        return policy - (self.reference_logps(model, inputs)[1] if reference is None else reference)

    def kl_estimate(self, model, inputs, reference: torch.Tensor | None = None) -> torch.Tensor:
        """z = max(0, mean of the mismatched pairs' log-ratios over every process), a 0-dim tensor."""
        ratios = self.kl_logratios(model, inputs, reference).float()
        # sum and count rather than a mean per process: ranks may hold different batch sizes
        totals = self.accelerator.gather(torch.stack([ratios.sum(), ratios.new_tensor(ratios.numel())])[None])
        total, count = totals.reshape(-1, 2).sum(0)
        return (total / count).clamp(min=0).detach()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps = self.completion_logps(model, inputs)
        ref, ref_kl = self.reference_logps(model, inputs)
        desirable = inputs["label"].bool()
        batch = UnpairedLogps(logps, ref, desirable, self.kl_estimate(model, inputs, ref_kl))
        loss, parts = self.objective(batch)
        self.record(self.objective.metrics(batch, parts))  # NaN entries (a class absent from a batch) are skipped
        return (loss, None) if return_outputs else loss


@hookimpl
def register_methods(register):
    register("method.kto", Method(config=KTOConfig, trainer=KTOTrainer, loss_family="kto",
                                  summary="Kahneman-Tversky Optimization on unpaired desirable/undesirable examples"))
