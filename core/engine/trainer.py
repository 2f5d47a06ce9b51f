"""The chassis every method's trainer stands on: transformers' Trainer, plus what plait adds.

A method subclasses :class:`PlaitTrainer` and fills in four things: how its dataset is
prepared, which collator lays out its batches, how one step turns a batch into a typed loss
batch (through :func:`plait.engine.logprobs.token_logprobs`) and which metrics it logs. The chassis
never names a concrete method or loss: it asks the registry. It adds atomic checkpoints with
run metadata, metrics averaged per logging window, plugin-contributed callbacks, and a guard
that keeps NaN/inf out of the weights: a non-finite loss or gradient norm stops the run naming
the step and the loss part (or, with ``on_nonfinite_loss="skip"``, drops that update).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from plait import __version__
from plait.data.prepare import is_stream
from plait.data.pretrained import remote_code
from plait.data.tokenizer import load_tokenizer
from plait.data.vision import holds_images, image_processor_of, limit_pixels
from plait.data.vision import model_inputs as model_inputs_of
from plait.errors import PlaitError
from plait.manager import Plugins, default_plugins
from plait.paths import honour_umask, storage_shortage

from . import run_folder
from .attention import SEQUENCE_SDPA, packs_per_sequence, shares_prefixes
from .autocast import rotary_in_compute_dtype
from .config import method_args, trains_on_cpu
from .compiled_kernels import compiled_mlps
from .cpu_linear import cpu_linears
from .layout import RegisteredCollator
from .logprobs import token_logprobs
from .memory import TORCH_SWITCH, keep_freed_heap, large_buffers_aligned
from .model_card import CardDetails, write_model_card
from .models import (
    Reference,
    agree_on_tokens,
    disable_dropout,
    load_model,
    refuse_adapters_on_adapters,
    warn_if_half_precision_weights,
    wrap_peft,
)
from .objective import Objective
from .processes import leave_process_group_at_exit, shard_on_cpu
from .redact import masked
from .rms_norm import closed_form_rms_norms
from .run_folder import config_fields, json_value

logger = logging.getLogger("plait")
METADATA_FILE = "plait_run.json"
RESUME_STATE_FILE = "plait_resume_state_{}.pt"  # per process, like the Trainer's rng_state_N.pth


class NonFiniteLossError(PlaitError):
    """A step's loss or gradient norm was NaN/inf (or the weights are): the run stops before the
    update reaches the weights, and nothing non-finite is saved."""


class PlaitTrainer(Trainer):
    """Base trainer; subclasses set ``method`` (the registry name) and implement ``compute_loss``."""

    method: ClassVar[str]
    config_class: ClassVar[type]
    auto_model_class: ClassVar[type] = AutoModelForCausalLM  # what a model path is loaded as
    takes_images: ClassVar[bool] = False  # do its forwards pass a VLM's image inputs (plait.data.vision)?
    # Does evaluation have logits and labels to hand compute_metrics (eval_predictions)? Not where rows are prompts.
    gives_eval_predictions: ClassVar[bool] = True
    # Does compute_loss call compute_loss_func(outputs, labels, num_items_in_batch) instead of the composed losses?
    takes_compute_loss_func: ClassVar[bool] = False
    # the non-finite guard's state: did a micro-batch of this optimizer step give a NaN/inf loss
    # (a device tensor, so no sync per micro-batch; None before the step's first), steps skipped
    _nonfinite_loss: torch.Tensor | None = None
    nonfinite_steps_skipped: int = 0
    _wrapper: torch.nn.Module | None = None  # what trained_module() put around the policy, if anything
    _router_aux_loss_coef: float = 0.0
    _router_aux_losses: list[torch.Tensor] | None = None  # collected while a loss with gradient is computed
    _offload_activations: bool = False
    card_details: CardDetails = CardDetails()  # what create_model_card/push_to_hub were told, for every later card
    card_datasets: tuple[str, ...] = ()  # the datasets the card names when the user named none (the CLI's recipe)
    # Is trainer.eval_dataset what the user passed (TRL's GRPO, RLOO, online DPO, distillation), its prepared rows
    # read by evaluation (_eval_prepared), or the prepared rows themselves (TRL's SFT, DPO, KTO, reward model)?
    keeps_eval_dataset_as_given: ClassVar[bool] = False
    _eval_prepared: dict[int, Any] = {}  # id(a dataset as given) -> its prepared rows, where kept as given

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        peft_config=None,
        callbacks=None,
        optimizers=(None, None),
        plugins: Plugins | None = None,
        compute_metrics=None,
        preprocess_logits_for_metrics=None,
        compute_loss_func=None,
        optimizer_cls_and_kwargs=None,
        quantization_config=None,
        **kwargs,
    ):
        self.plugins = plugins or default_plugins()
        model = os.fspath(model) if isinstance(model, os.PathLike) else model  # a pathlib.Path, as a folder name
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = self.config_class(output_dir=f"{os.path.basename(str(name).rstrip('/'))}-{self.method}")
        args = method_args(self.config_class, args)
        if trains_on_cpu(args):
            say_if_large_buffers_unaligned()
            keep_freed_heap()  # each step's activations reuse the last step's memory (plait.engine.memory)
        self._refuse_unused_arguments(compute_metrics=compute_metrics,
                                      preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                                      compute_loss_func=compute_loss_func)
        self.compute_loss_func = compute_loss_func  # validate() may read it; Trainer.__init__ sets it again
        self._refuse_images(train_dataset, eval_dataset)
        init_kwargs = with_quantization(model, getattr(args, "model_init_kwargs", None), quantization_config)
        # trust_remote_code holds for every from_pretrained below and for reward models validate() resolves
        with remote_code(args.trust_remote_code):
            self.validate(args)  # everything the config can check, before any model loads
            if train_dataset is None:  # as TRL 1.16 refuses it (plait's environments need prompts too)
                raise PlaitError(f"`train_dataset` is required: pass {type(self).__name__}(..., train_dataset=rows "
                                 "to train on)")
            self._check_stream(train_dataset, args)
            self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

            processing_class = load_tokenizer(model, processing_class, chat_template_path=args.chat_template_path,
                                              eos_token=args.eos_token, pad_token=args.pad_token)
            limit_pixels(processing_class, args.max_pixels)
            with torch.random.fork_rng(devices=[]):  # weights the folder lacks (a new score head) come from args.seed
                torch.manual_seed(args.seed)
                model = load_model(model, init_kwargs, auto_class=self.auto_model_class)
            if args.eos_token is not None or args.pad_token is not None:
                agree_on_tokens(processing_class, model, eos=args.eos_token is not None, pad=args.pad_token is not None)
            self._router_aux_loss_coef = router_aux_loss_coefficient(model, args.router_aux_loss_coef)
            self.peft_config = peft_config
            refuse_adapters_on_adapters(model, peft_config)
            model = self.before_peft(model, args, **kwargs)
            with torch.random.fork_rng(devices=[]):  # new adapters start from args.seed on any launcher
                torch.manual_seed(args.seed)
                model = wrap_peft(model, peft_config, args.gradient_checkpointing)
            warn_if_half_precision_weights(model)
            if args.disable_dropout:
                for module in (model, *self.held_models()):
                    disable_dropout(module)
            for module in (model, *self.held_models()):  # acts only under autocast (bf16/fp16 runs)
                rotary_in_compute_dtype(module)
            if trains_on_cpu(args):
                for module in (model, *self.held_models()):  # a reference's norms compute a batch as the policy's
                    closed_form_rms_norms(module)  # float32 norms differentiated in half autograd's passes
                cpu_linears(model)  # bf16 linears: input casts shared, weight gradients from row-major operands
                compiled_mlps(model)  # bf16 SwiGLU forward and backward, one compiled loop each
            self._policy = model  # the model before accelerate wraps it; datasets may need it (cached reference)
            self.padding_free = self._padding_free(args, processing_class)
            self.prefix_sharing = self._prefix_sharing(args)

            train_dataset = self.prepare(train_dataset, processing_class, args, "train")
            given = eval_dataset
            if isinstance(eval_dataset, dict):
                eval_dataset = {k: self.prepare(v, processing_class, args, k) for k, v in eval_dataset.items()}
            elif eval_dataset is not None:
                eval_dataset = self.prepare(eval_dataset, processing_class, args, "eval")
            if self.keeps_eval_dataset_as_given and given is not None:  # prepared now all the same: bad rows fail here
                pairs = given.items() if isinstance(given, dict) else [(None, given)]
                self._eval_prepared = {id(raw): eval_dataset[k] if k is not None else eval_dataset for k, raw in pairs}
                eval_dataset = given
            data_collator = data_collator or self.batch_collator(processing_class, args)

            callbacks = list(callbacks or [])
            for contributed in self.plugins.hook.trainer_callbacks(method=self.method, args=args):
                callbacks.extend(contributed or [])
            super().__init__(
                model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                optimizers=optimizers, compute_metrics=compute_metrics,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics, compute_loss_func=compute_loss_func,
                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            )
            leave_process_group_at_exit(self)
            for module in self.auxiliary_modules().values():
                module.to(args.device)
            trained = self.trained_module(self._policy)
            if trained is not self._policy:
                self.model = self.model_wrapped = self._wrapper = trained
            if hasattr(self._policy, "add_model_tags"):  # as TRL tags its models: the card push_to_hub writes
                self._policy.add_model_tags(self._tag_names)
            if self._router_aux_loss_coef:
                self._add_router_aux_loss(self._policy)  # the outermost policy: PEFT passes the request on
            self._offload_activations = args.activation_offloading and offloading_applies(args.device)
            self.after_init()

    @property
    def _tag_names(self) -> list[str]:
        """The tags a trained model carries (``model.model_tags``): TRL's trainers have ``["trl", <method>]``."""
        return ["plait", self.method]

    def release_process_group(self) -> None:
        """Drop the distributed wrappers (DDP) that hold the process group, at interpreter exit."""
        self.model_wrapped = self.model
        self.accelerator._models.clear()

    def _refuse_images(self, *datasets) -> None:
        """Image rows for a method whose forwards do not pass images: refused before any model loads."""
        if self.takes_images or not any(holds_images(d) for d in datasets if not isinstance(d, dict)):
            return
        able = sorted(c.name.split(".", 1)[1] for c in self.plugins.methods if getattr(c.obj.trainer, "takes_images", False))
        raise PlaitError(f"the dataset has an 'images' column but {type(self).__name__} does not pass images to the "
                         f"model; vision-language models train with: {', '.join(able)}")

    def _refuse_unused_arguments(self, **given) -> None:
        """transformers' Trainer arguments this method's loss or evaluation has no use for, refused by name."""
        name = type(self).__name__
        if given["compute_loss_func"] is not None and not self.takes_compute_loss_func:
            raise PlaitError(f"{name} does not take compute_loss_func: its loss is the composed {self.method}.* losses "
                             "over log-probs, not a function of the logits and labels; register a loss plugin and "
                             "name it in the config's loss instead")
        for field in ("compute_metrics", "preprocess_logits_for_metrics"):
            if given[field] is not None and not self.gives_eval_predictions:
                raise PlaitError(f"{name} does not take {field}: its evaluation rows are prompts it samples from, "
                                 "with no logits and labels to compare; its evaluation logs its own metrics")

    # -- what a method fills in ---------------------------------------------------------------
    def validate(self, args) -> None:
        """Refuse incompatible settings with the reason; called before loading anything."""

    def before_peft(self, model: PreTrainedModel, args, **kwargs) -> PreTrainedModel:
        """Last look at the bare model (e.g. copy it as the reference) before adapters wrap it."""
        if kwargs:
            raise PlaitError(f"{type(self).__name__} got unexpected arguments {sorted(kwargs)}")
        return model

    def prepare(self, dataset, processing_class, args, split: str):
        return dataset

    def refuse_on_stream(self, args) -> str | None:
        """Why this run's settings cannot train on a stream (they need the whole dataset), or None."""
        return None

    def _check_stream(self, train_dataset, args) -> None:
        """A stream (``IterableDataset``) has no length, so as in TRL ``max_steps`` says how long to train;
        its batches are read by each process itself (accelerate shards a stream), not dispatched from one."""
        if not is_stream(train_dataset):
            return
        if args.max_steps is None or args.max_steps <= 0:
            raise PlaitError(f"max_steps={args.max_steps} but train_dataset is a stream (IterableDataset), which has no "
                             "length to count epochs by; set max_steps to the number of steps to train")
        why = self.refuse_on_stream(args)
        if why:
            raise PlaitError(f"train_dataset is a stream (IterableDataset) but {why}")
        args.accelerator_config.dispatch_batches = False  # dispatching concatenates the processes' batches

    def wants_padding_free(self, args) -> bool | None:
        """Whether batches put several sequences back to back in one row: True, False, or None for
        "where the models' attention costs such a row no more than its sequences padded"
        (:func:`plait.engine.attention.packs_per_sequence`). ``make_collator`` reads the answer as
        ``self.padding_free``."""
        return False

    def _padding_free(self, args, processing_class) -> bool:
        wanted = self.wants_padding_free(args)
        images = image_processor_of(processing_class) is not None
        if wanted and images:
            raise PlaitError(f"{type(self).__name__}: padding_free=True cannot hold images (their inputs follow their "
                             "rows, plait.data.vision); set padding_free=False (or None to choose) and packing=False")
        if images:
            return False
        # plait_sdpa also when batches are padded: it attends an unpadded or right-padded batch causally, without a mask
        per_sequence = [packs_per_sequence(_bare(m)) for m in (self._policy, *self.held_models()) if _bare(m) is not None]
        return wanted is not False and (bool(wanted) or all(per_sequence))

    def wants_prefix_sharing(self, args) -> bool | None:
        """Whether a padding-free batch of preference pairs computes each pair's prompt once
        (``collator.preference_prefix_shared``): True, False, or None for "where every model's
        attention reads a branch" (:func:`plait.engine.attention.shares_prefixes`). ``make_collator`` reads the
        answer as ``self.prefix_sharing``."""
        return False

    def _prefix_sharing(self, args) -> bool:
        wanted = self.wants_prefix_sharing(args)
        if wanted is False:
            return False
        if not self.padding_free:
            if wanted:
                raise PlaitError("prefix_sharing=True shares prompts within a padding-free batch, and this run's batches are "
                                 "padded: set padding_free=True (or None), or prefix_sharing=None")
            return False
        models = [m for m in map(_bare, (self._policy, *self.held_models())) if m is not None]
        unable = [m.config._attn_implementation for m in models if not shares_prefixes(m)]
        if wanted and unable:
            raise PlaitError(f"prefix_sharing=True needs attn_implementation={SEQUENCE_SDPA!r} (no sliding window), which "
                             f"attends a branch to its prompt; the model has {unable[0]!r}: set prefix_sharing=None")
        return not unable

    def make_collator(self, processing_class, args):
        raise NotImplementedError

    def batch_collator(self, processing_class, args):
        """The method's collator; for a VLM's processor wrapped in the collator registered as the
        default for ``images`` (images become model inputs)."""
        collate = self.make_collator(processing_class, args)
        if image_processor_of(processing_class) is not None:
            wrap = self.plugins.collators.default("images", "turning a VLM's images into model inputs")
            collate = self.collator(wrap.name, processing_class, inner=collate)
        return collate

    def collator(self, name: str, processing_class, **options) -> RegisteredCollator:
        """The registered collator ``name`` built for ``processing_class`` with ``options``, as a data loader
        can carry it to worker processes (:class:`plait.engine.layout.RegisteredCollator`)."""
        return RegisteredCollator(self.plugins, name, processing_class, **options)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if shard_on_cpu(self.accelerator):  # an FSDP preset on CPU processes (plait.engine.processes)
            self.is_fsdp_enabled = True

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """``resume_from_checkpoint=True`` (or ``"latest"``) resumes from the newest *complete*
        checkpoint in output_dir; transformers alone would take the newest folder, finished or not."""
        resume_from_checkpoint = run_folder.resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """transformers' ``evaluate``; a dataset given here (rows as the user has them, or a dict of them) is
        prepared as the constructor prepares ``eval_dataset``, so ``trainer.evaluate(eval_dataset=rows)``
        works as in TRL. The trainer's own prepared datasets (or a name of one) pass as they are."""
        own = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        raw = eval_dataset is not None and not isinstance(eval_dataset, (str, dict))  # a dict comes back item by item
        if raw and not any(eval_dataset is dataset for dataset in own):
            eval_dataset = self.prepare(eval_dataset, self.processing_class, self.args, metric_key_prefix)
        return super().evaluate(eval_dataset=eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def get_eval_dataloader(self, eval_dataset=None):
        """transformers' loader; an eval dataset the trainer keeps as given is read through its prepared rows."""
        given = self.eval_dataset if eval_dataset is None else (
            self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset)
        prepared = self._eval_prepared.get(id(given))
        return super().get_eval_dataloader(eval_dataset if prepared is None else prepared)

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """TRL's name for the reference: the separate frozen model, or None where there is none to hold (the
        policy with its adapters off or a frozen adapter copy, precomputed log-probs, beta = 0), as TRL's."""
        reference = vars(self).get("reference")
        if not isinstance(reference, Reference):
            raise AttributeError(f"{type(self).__name__} has no reference model ({self.method} uses none)")
        return reference.model

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's flag: does the loss add a Mixture-of-Experts load-balancing term (``router_aux_loss_coef``)?"""
        return self._router_aux_loss_coef != 0.0

    def auxiliary_modules(self) -> dict[str, torch.nn.Module]:
        """Modules trained beside the policy (a value model, extra heads), by the checkpoint
        subfolder each is saved in: moved to the device, saved (``save_pretrained``) with every
        checkpoint and the final model, and restored on resume. None by default."""
        return {}

    def trained_module(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The one module the optimizer trains and DDP wraps: the policy, or a wrapper holding it
        and the auxiliary modules (their parameters are trained only if it holds them). The
        policy alone is what is saved as the model."""
        return policy

    def after_init(self) -> None:
        """Runs once the accelerator exists (prepare auxiliary models here)."""

    def held_models(self) -> list[torch.nn.Module]:
        """The models this trainer holds beside the policy: the reference's, a teacher, a value model."""
        held: list[torch.nn.Module] = []
        for value in vars(self).values():
            module = value.model if isinstance(value, Reference) else value
            if isinstance(module, torch.nn.Module) and not any(module is seen for seen in held):
                held.append(module)
        return held

    # -- Mixture-of-Experts load balancing and activation offloading ---------------------------
    def _add_router_aux_loss(self, policy: torch.nn.Module) -> None:
        """Every gradient-taking policy forward of a loss computation returns its router logits;
        the loss gains ``router_aux_loss_coef`` × their load-balancing loss (the mean over those
        forwards), scaled like the loss for gradient accumulation, as TRL 1.16 does."""
        policy.register_forward_pre_hook(self._request_router_logits, with_kwargs=True)
        policy.register_forward_hook(self._keep_router_aux_loss)
        method_loss = self.compute_loss

        def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            self._router_aux_losses = []
            try:
                result = method_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            finally:
                collected, self._router_aux_losses = self._router_aux_losses, None
            if not collected:  # evaluation: no gradient, no auxiliary loss
                return result
            loss = result[0] if return_outputs else result
            aux = torch.stack([value.float().to(loss.device) for value in collected]).mean()
            weighted = self._router_aux_loss_coef * aux
            if self._loss_is_scaled_for_accumulation(num_items_in_batch):
                weighted = weighted / getattr(self, "current_gradient_accumulation_steps", 1)
            self.record({"aux_loss": aux.detach()})
            return (loss + weighted, *result[1:]) if return_outputs else loss + weighted

        self.compute_loss = compute_loss

    def _request_router_logits(self, module, args, kwargs):
        if self._router_aux_losses is not None and torch.is_grad_enabled():
            return args, {**kwargs, "output_router_logits": True}
        return None

    def _keep_router_aux_loss(self, module, args, output) -> None:
        if self._router_aux_losses is None or not torch.is_grad_enabled():
            return
        aux = getattr(output, "aux_loss", None)
        if aux is None:
            raise PlaitError(f"router_aux_loss_coef={self._router_aux_loss_coef}: {type(module).__name__} returned no "
                             "aux_loss although asked for its router logits; set router_aux_loss_coef=0")
        self._router_aux_losses.append(aux)

    def _loss_is_scaled_for_accumulation(self, num_items_in_batch) -> bool:
        """Did the method already divide its loss for gradient accumulation? (the Trainer's own rule)"""
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def compute_loss_context_manager(self):
        """The Trainer's (autocast), and with ``activation_offloading`` on an accelerator the
        activations the training forward saves for backward wait in pinned CPU memory."""
        stack = super().compute_loss_context_manager()
        if self._offload_activations and self.model.training:
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=True))
        return stack

    def token_logprobs(self, model, input_ids, attention_mask=None, **kwargs):
        """:func:`plait.engine.logprobs.token_logprobs` on the path the config picks (chunked by default)."""
        return token_logprobs(model, input_ids, attention_mask, chunked=self.args.chunked_logprobs, **kwargs)

    # -- metrics ------------------------------------------------------------------------------
    @property
    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def record(self, metrics: dict[str, torch.Tensor | float]) -> None:
        """Store this step's metrics (averaged across processes) until the next log."""
        for name, value in metrics.items():
            value = torch.as_tensor(value, dtype=torch.float32, device=self.accelerator.device).detach()
            value = self.accelerator.gather_for_metrics(value.reshape(1)).nanmean()
            self._metrics[self._mode][name].append(value.item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        for name, values in self._metrics[mode].items():
            finite = [v for v in values if v == v]
            logs[prefix + name] = sum(finite) / len(finite) if finite else float("nan")
        self._metrics[mode].clear()
        if mode == "train" and getattr(self.args, "on_nonfinite_loss", "error") == "skip":
            logs["nonfinite_steps_skipped"] = self.nonfinite_steps_skipped
        super().log(logs, start_time)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
            if prediction_loss_only:  # evaluate() without compute_metrics
                return loss.detach(), None, None
            logits, labels = self.eval_predictions(model, inputs)
        return loss.detach(), logits, labels

    def eval_predictions(self, model, inputs) -> tuple[torch.Tensor, Any]:
        """What ``compute_metrics`` (after ``preprocess_logits_for_metrics``) receives for one
        evaluation batch, as TRL 1.16 gives it: the model's logits over the batch's rows (one more
        forward, only when asked for) and its ``labels``, else its ``input_ids``."""
        model_inputs = {**{k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs},
                        **model_inputs_of(inputs)}
        logits = model(**model_inputs, use_cache=False).logits
        return logits, inputs["labels"] if "labels" in inputs else inputs["input_ids"]

    # -- the non-finite guard: no NaN/inf update ever reaches the weights ----------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._nonfinite_loss is None:  # first micro-batch of an optimizer step
            for objective in self._objectives():
                objective.reset_watch()
        loss = super().training_step(model, inputs, num_items_in_batch)
        bad = ~torch.isfinite(loss)
        self._nonfinite_loss = bad if self._nonfinite_loss is None else self._nonfinite_loss | bad
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        # transformers calls this once per optimizer step, after the gradients of every micro-batch
        # are summed and clipped and right before optimizer.step(): the last moment to keep a NaN
        # out of the weights (and the only place the step's gradient norm is at hand).
        grad_norm = super()._get_grad_norm(model, grad_norm)
        self._guard_update(model, grad_norm)
        return grad_norm

    def _guard_update(self, model, grad_norm) -> None:
        """Stop (or, with ``on_nonfinite_loss="skip"``, drop this update) when the step's loss or
        gradient norm is NaN/inf. Every process takes the same decision."""
        bad_loss, self._nonfinite_loss = self._nonfinite_loss, None
        bad_loss = torch.zeros((), device=self.args.device) if bad_loss is None else bad_loss.float()
        if self.accelerator.num_processes > 1:
            bad_loss = self.accelerator.reduce(bad_loss, "sum")
        bad_loss = bool(bad_loss > 0)
        norm = float(grad_norm) if grad_norm is not None else 0.0
        # Under fp16 loss scaling an overflowing gradient is routine: the scaler skips that step itself.
        bad_grad = not math.isfinite(norm) and not self.args.fp16
        if not (bad_loss or bad_grad):
            return
        message = self._nonfinite_message(model, bad_loss, norm)
        if getattr(self.args, "on_nonfinite_loss", "error") != "skip":
            raise NonFiniteLossError(f"{message}; the weights were not updated with it and are not saved; set "
                                     "on_nonfinite_loss: skip to skip such steps instead")
        self.nonfinite_steps_skipped += 1
        logger.warning("plait: %s; skipped this update (on_nonfinite_loss=skip; %d skipped so far)",
                       message, self.nonfinite_steps_skipped)
        model.zero_grad(set_to_none=True)  # optimizers leave a parameter without gradient untouched

    def _objectives(self) -> list[Objective]:
        """The composed objectives the method built (``objective``, PPO's policy and value ones ...)."""
        return [value for value in vars(self).values() if isinstance(value, Objective)]

    def _nonfinite_message(self, model, bad_loss: bool, norm: float) -> str:
        """One line: the step, what went NaN/inf, in which loss part(s), and the likely causes."""
        step, lr = self.state.global_step + 1, self.args.learning_rate
        terms = [term for objective in self._objectives() for term in objective.nonfinite_terms()]
        all_terms = [term for objective in self._objectives() for term in objective.terms]
        every_part = ", ".join(f"loss/{t.name}" for t in all_terms)
        if bad_loss and terms:
            what = "the loss is NaN/inf in " + ", ".join(f"loss/{t.name} ({t.origin})" for t in terms)
        elif bad_loss:
            what = f"the loss is NaN/inf although every loss part ({every_part}) is finite"
        else:
            what = f"the gradient norm is {norm} although the loss ({every_part}) is finite"
        causes = []
        if not self._weights_finite(model):
            causes.append("the weights already hold NaN/inf (a broken model file, or an earlier update diverged)")
        if self.args.fp16:
            causes.append("fp16 overflow (train in bf16 or fp32, or lower learning_rate)")
        only_some = bool(terms) and len(terms) < len(all_terms)
        plugin = "the loss plugin(s) " + ", ".join(repr(t.name) for t in terms) + " producing NaN/inf on this batch"
        diverged = f"learning_rate={lr:g} too high, so the model diverged (lower it)"
        if only_some:  # the same model outputs fed every part, and only these broke
            causes.append(plugin)
        if self.state.global_step > 0:  # an update already happened
            causes.append(diverged)
        if terms and not only_some:
            causes.append(plugin)
        elif bad_loss and not terms:
            causes.append("the method's scaling of the parts (e.g. dividing by zero trained tokens)")
        elif not bad_loss:
            causes.append("a loss whose gradient is undefined where its value is finite (e.g. sqrt or log at 0)")
        return f"step {step}: {what}; likely cause: {'; or '.join(causes)}"

    def _weights_finite(self, model) -> bool:
        """Are all parameters finite, on every process? (one pass over the weights; one sync)"""
        device = self.args.device
        # under FSDP2 a parameter is a DTensor: each process checks its own shard, the reduce adds them
        flags = [(~torch.isfinite(_local(p.detach()))).any().to(device) for p in model.parameters()]
        bad = torch.stack(flags).any().float() if flags else torch.zeros((), device=device)
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad, "sum")
        return not bool(bad > 0)

    def _refuse_nonfinite_weights(self, output_dir: str) -> None:
        if not self._weights_finite(self.model):
            raise NonFiniteLossError(
                f"step {self.state.global_step}: the weights hold NaN/inf, so they are not saved to {output_dir}; an "
                f"update diverged (learning_rate={self.args.learning_rate:g} too high?) or the model file was broken")

    # -- checkpoints: atomic, with run metadata -----------------------------------------------
    def run_metadata(self) -> dict[str, Any]:
        args = self.args
        metadata = {
            "plait_version": __version__,
            "method": self.method,
            "plugins": [
                {"name": info.name, "distribution": info.distribution, "version": info.version}
                for info in self.plugins.distributions()
            ],
            "config": {k: json_value(getattr(args, k)) for k in config_fields(type(args))},
        }
        self.plugins.hook.run_metadata(metadata=metadata)
        return masked(metadata)  # tokens and keys by name (plait.engine.redact): the file sits in every checkpoint

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint into a staging folder, then rename it into place: a crash mid-save
        never leaves a half-written ``checkpoint-N`` that resume would pick up."""
        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = os.path.join(run_dir, ".staging")
        if self.args.should_save:  # as TRL: the run's folder has a card whenever it has a checkpoint (hub pushes)
            write_model_card(self, run_dir)
        staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.exists(staged):
            shutil.rmtree(staged)  # leftover of an interrupted save
        self._get_output_dir = lambda trial: staging_root
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                with open(os.path.join(staged, METADATA_FILE), "w") as handle:
                    json.dump(self.run_metadata(), handle, indent=2)
        except Exception as err:
            shortage = storage_shortage(staged, self._checkpoint_bytes())
            if self.args.should_save:
                _remove_staging(staged)
            if shortage is None:
                raise
            kept = run_folder.latest_checkpoint(run_dir)
            raise PlaitError(f"step {self.state.global_step}: could not save {name} in {run_dir}: {shortage}; "
                             f"{'the last good checkpoint ' + kept + ' is kept' if kept else 'no checkpoint is kept'}; "
                             "free space or lift the limit, then resume") from err
        finally:
            del self._get_output_dir
        if self.args.should_save:
            honour_umask(Path(staged).rglob("*"))  # safetensors writes its files 0600
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(staged, final)
            _remove_staging(staged)  # the checkpoint moved out: the emptied .staging goes too
            if self.state.best_model_checkpoint == staged:
                self.state.best_model_checkpoint = final
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()

    def _checkpoint_bytes(self) -> int:
        """About the size of a checkpoint: the weights and the optimizer's state, which dominate it."""
        tensors = list(self.model.parameters())
        if self.optimizer is not None:
            tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- exact resume: what a method keeps beyond weights, optimizer, scheduler and RNG ---------
    def resume_state(self) -> dict[str, Any]:
        """This process's training state the Trainer does not save (a rollout buffer, running
        counters); empty when there is none. Saved in every checkpoint. A method that adds its own
        extends ``super().resume_state()``."""
        return {"nonfinite_steps_skipped": self.nonfinite_steps_skipped} if self.nonfinite_steps_skipped else {}

    def load_resume_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`resume_state` returned, before the first resumed micro-step."""
        self.nonfinite_steps_skipped = state.get("nonfinite_steps_skipped", 0)

    def _save_rng_state(self, output_dir: str) -> None:
        # The Trainer saves each process's RNG here; the method's own state travels beside it.
        super()._save_rng_state(output_dir)
        state = self.resume_state()
        if state:
            torch.save(state, os.path.join(output_dir, RESUME_STATE_FILE.format(self.args.process_index)))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # The Trainer restores the RNG once per resume, right before the first resumed step: the
        # moment the method's state must be back too.
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, RESUME_STATE_FILE.format(self.args.process_index))
        if not os.path.isfile(path):
            if self.resume_state():
                logger.warning(f"{checkpoint} has no {os.path.basename(path)} (written by an older plait?); the "
                               "run resumes with fresh rollouts and counters and will not match an uninterrupted run")
            return
        self.load_resume_state(torch.load(path, weights_only=True))

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        output_dir = output_dir or self.args.output_dir
        if state_dict is not None:  # gathered from shards (FSDP): tied weights came back as separate copies
            copies = _tied_copies(self.model)
            state_dict = {k: v for k, v in state_dict.items() if k not in copies}
        if self._wrapper is None:
            super()._save(output_dir, state_dict)
        else:  # the policy is saved as the model; the wrapper's state_dict is not the policy's
            trained, self.model = self.model, self._policy
            try:
                super()._save(output_dir)
            finally:
                self.model = trained
        if self.args.should_save:
            for folder, module in self.auxiliary_modules().items():
                module.save_pretrained(os.path.join(output_dir, folder))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._wrapper is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        else:
            trained, self.model = self.model, self._policy  # the Trainer loads (and inspects) the policy
            try:
                super()._load_from_checkpoint(resume_from_checkpoint, model=self._policy)
            finally:
                self.model = trained
        for folder, module in self.auxiliary_modules().items():
            path = os.path.join(resume_from_checkpoint, folder, "model.safetensors")
            if not os.path.isfile(path):
                raise PlaitError(f"checkpoint {resume_from_checkpoint!r} has no {folder}/; it was not written by "
                                 f"{type(self).__name__}")
            module.load_state_dict(load_file(path))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self._refuse_nonfinite_weights(output_dir or self.args.output_dir)  # final save and checkpoints alike
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:  # safetensors writes its files 0600
            honour_umask(path for folder in (".", *self.auxiliary_modules())
                         for path in Path(output_dir, folder).glob("*.safetensors"))
        if self.args.should_save and not _internal_call:
            with open(os.path.join(output_dir, METADATA_FILE), "w") as handle:
                json.dump(self.run_metadata(), handle, indent=2)
            write_model_card(self, output_dir)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | list[str] | None = None,
                          tags: str | list[str] | None = None, **kwargs) -> None:
        """Write README.md into ``output_dir`` (:mod:`plait.engine.model_card`). Takes TRL's arguments and
        transformers' (``language``, ``license``, ``finetuned_from``, ... as ``push_to_hub(**kwargs)``
        passes them on); what is given is kept for the cards of later saves."""
        self.card_details = self.card_details.updated(model_name=model_name, dataset_name=dataset_name, tags=tags,
                                                      **kwargs)
        if self.args.should_save:
            write_model_card(self, self.args.output_dir)


@functools.cache
def _remove_staging(staged: str) -> None:
    """Remove a staged checkpoint folder, and ``.staging`` itself once nothing else is staged there."""
    shutil.rmtree(staged, ignore_errors=True)
    with contextlib.suppress(OSError):  # another save still staged there
        os.rmdir(os.path.dirname(staged))


def say_if_large_buffers_unaligned() -> None:
    """Once per process: where torch was not told to page-align its large CPU buffers (a tensor was
    made before plait was imported), say what that costs and how to get it (plait.engine.memory)."""
    if os.environ.get(TORCH_SWITCH) != "0" and not large_buffers_aligned():
        logger.info("plait: torch made a tensor before plait was imported, so its large CPU buffers are not "
                    "page-aligned and a CPU run's peak memory can be up to 1.6x higher; import plait first, "
                    "or set %s=1 before starting Python", TORCH_SWITCH)


def with_quantization(model: str | PreTrainedModel, init_kwargs: dict | None, quantization_config) -> dict | None:
    """``model_init_kwargs`` with the trainer's ``quantization_config`` (e.g. a BitsAndBytesConfig,
    QLoRA's 4-bit base) added, as TRL 1.16 passes it to ``from_pretrained``; it applies only to a
    model loaded here, so a loaded model or a second setting in model_init_kwargs is refused."""
    if quantization_config is None:
        return init_kwargs
    if not isinstance(model, str):
        raise PlaitError(f"quantization_config applies when model is a path or hub id, but model is a loaded "
                         f"{type(model).__name__}; pass its path, or load it with quantization_config yourself")
    if "quantization_config" in (init_kwargs or {}):
        raise PlaitError("quantization_config is given both as a trainer argument and in model_init_kwargs; "
                         "give it once")
    return {**(init_kwargs or {}), "quantization_config": quantization_config}


def router_aux_loss_coefficient(model: PreTrainedModel, coef: float | None) -> float:
    """The weight of a Mixture-of-Experts model's load-balancing loss, by TRL 1.16's rule: a model
    whose config has ``output_router_logits`` gets ``coef``, or its config's own
    ``router_aux_loss_coef`` when ``coef`` is None; any other model gets none (and refuses a coef)."""
    config = model.config.get_text_config()
    if not hasattr(config, "output_router_logits"):
        if coef:
            raise PlaitError(f"router_aux_loss_coef={coef}: {type(model).__name__} is not a Mixture-of-Experts model "
                             "that returns router logits, so there is no auxiliary loss to weigh; leave it unset")
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef)


def _bare(module: torch.nn.Module) -> PreTrainedModel | None:
    """The transformers model inside a PEFT wrapper (None for anything that is not one)."""
    module = module.get_base_model() if hasattr(module, "get_base_model") else module
    return module if isinstance(module, PreTrainedModel) else None


def _tied_copies(model: torch.nn.Module) -> set[str]:
    """The names under which a parameter appears again after its first name (tied weights)."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    return {name for name, param in model.named_parameters(remove_duplicate=False) if first[id(param)] != name}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def offloading_applies(device: torch.device) -> bool:
    """Offloading saved activations to CPU memory helps only where they would live on an accelerator."""
    if device.type == "cpu":
        _log_offloading_is_a_no_op()
        return False
    return True


@functools.cache
def _log_offloading_is_a_no_op() -> None:
    logger.info("plait: activation_offloading=True does nothing on a CPU run: the activations already are in CPU memory")
