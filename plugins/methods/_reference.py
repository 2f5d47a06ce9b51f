"""The frozen reference of the offline preference methods (DPO, KTO), in one place.

Both regularise the policy towards a reference π_ref (:class:`plait.engine.models.Reference`): a
separate frozen model (a copy of the policy, or ``ref_model``), with ``peft_config`` and no
``ref_model`` the policy with its adapters off, or for a policy already wrapped in PEFT a frozen
copy of its adapter. With ``precompute_ref_log_probs`` the reference's log-probs are computed
once before training, cached by everything they depend on, and carried by the dataset, so no
reference is loaded. ``sync_ref_model`` (TR-DPO) mixes the policy into a separate reference.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from plait.engine.layout import flat_index, pad_token_id, rows_from_flat
from plait.engine.models import Reference, SyncReference, cached_tensors
from plait.engine.trainer import PlaitTrainer
from plait.errors import PlaitError


class PaddingFreeRows:
    """For an offline method whose ``padding_free`` and ``prefix_sharing`` fields may lay its rows back
    to back, each prompt once (DPO, KTO, ORPO, CPO): the fields' answers, and evaluation predictions
    put back in rows."""

    def wants_padding_free(self, args) -> bool | None:
        return args.params.padding_free

    def wants_prefix_sharing(self, args) -> bool | None:
        return args.params.prefix_sharing

    def eval_predictions(self, model, inputs):
        """A padding-free batch's logits and ids put back in the rows TRL 1.16 hands ``compute_metrics``
        (right padded with the pad id), so metrics read the same arrays whichever the layout."""
        logits, ids = super().eval_predictions(model, inputs)
        if "seq_lengths" not in inputs:
            return logits, ids
        lengths, width, index = inputs["seq_lengths"], inputs["completion_mask"].shape[1], flat_index(inputs)
        return (rows_from_flat(logits, lengths, width, index=index),
                rows_from_flat(ids, lengths, width, pad_token_id(self.processing_class), index=index))


class ReferenceTrainer(PaddingFreeRows, PlaitTrainer):
    """Base of offline methods with a reference; their params inherit
    :class:`plait.engine.models.ReferenceSync` and have ``ref_model_init_kwargs``,
    ``precompute_ref_log_probs``, ``precompute_ref_batch_size``, ``max_length``,
    ``truncation_mode`` and ``pad_to_multiple_of``."""

    takes_images = True  # DPO and KTO: every forward (the reference's too) gets the rows' images

    def __init__(self, model, ref_model=None, args=None, **kwargs):
        if ref_model is not None and ref_model is model:  # the reference would move with every update
            raise PlaitError(f"ref_model is the model being trained; {type(self).__name__} needs a frozen reference: "
                             "omit ref_model (a frozen copy of the model is made) or pass a separate model")
        super().__init__(model, args=args, ref_model=ref_model, **kwargs)

    def before_peft(self, model, args, ref_model=None):
        self.reference = Reference.for_policy(model, ref_model, args.params.ref_model_init_kwargs,
                                              peft_config=self.peft_config)
        if args.params.sync_ref_model:
            self.reference.check_syncable(model, self.peft_config)
        return model

    def after_init(self) -> None:
        if self.args.params.precompute_ref_log_probs:
            self.reference = Reference.none()  # every batch carries its cached reference log-probs
        self.reference.prepare(self.accelerator, synced=self.args.params.sync_ref_model)
        if self.args.params.sync_ref_model:
            self.add_callback(SyncReference(self.reference))

    def refuse_on_stream(self, args) -> str | None:
        if args.params.precompute_ref_log_probs:
            return ("precompute_ref_log_probs=True scores every row before training; set it to False (the reference "
                    "then scores each batch as it is read)")
        return None

    def with_reference_logps(self, dataset, processing_class, args, columns: Sequence[str],
                             compute: Callable[[dict], Sequence[torch.Tensor]], **depends_on):
        """``dataset`` with the reference's log-probs added as ``columns``: ``compute(batch)`` gives
        one ``[rows]`` tensor per column for a collated batch. Computed once and cached by
        everything the numbers depend on (``depends_on`` adds what the method's own knobs change)."""
        p = args.params
        size = p.precompute_ref_batch_size or args.per_device_train_batch_size
        depends_on = {
            "method": self.method, "columns": list(columns), "reference": self.reference.model or self._policy,
            "adapters_off": self.reference.adapters_off, "adapter": self.reference.adapter,
            "tokenizer": processing_class, "data": dataset,
            "max_length": p.max_length, "truncation_mode": p.truncation_mode, "pad_to_multiple_of": p.pad_to_multiple_of,
            "batch_size": size, "chunked_logprobs": args.chunked_logprobs, **depends_on,
        }

        def run() -> dict[str, torch.Tensor]:
            collate = self.batch_collator(processing_class, args)
            self.args = args  # token_logprobs reads it; Trainer.__init__ sets the same object later
            parts = defaultdict(list)
            for start in tqdm(range(0, len(dataset), size), desc="Reference log-probs"):
                batch = collate([dataset[i] for i in range(start, min(start + size, len(dataset)))])
                for column, values in zip(columns, compute(batch), strict=True):
                    parts[column].append(values.float().cpu())
            return {column: torch.cat(parts[column]) for column in columns}

        cached = cached_tensors(depends_on, run)
        for column in columns:
            dataset = dataset.add_column(column, cached[column].tolist())
        return dataset
