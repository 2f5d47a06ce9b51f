"""The trainer callbacks TRL 1.16 users import, under TRL's names and constructor arguments.

``from trl import LogCompletionsCallback`` becomes ``from plait import LogCompletionsCallback``;
each is a plain ``transformers.TrainerCallback`` that works on any plait trainer (or any
``transformers.Trainer``):

* :class:`LogCompletionsCallback`: completions of a few evaluation prompts, every ``freq`` steps,
  as a table (printed, kept in ``.table``, sent to wandb when ``report_to`` names it).
* :class:`SyncRefModelCallback`: TR-DPO's reference update π_ref ← α·π + (1−α)·π_ref every
  ``ref_model_sync_steps`` (Gorbatovski et al. 2024, eq. 4): plait's :class:`plait.engine.models.SyncReference`.
* :class:`RichProgressCallback`: progress bars and the logged metrics with ``rich``.
* :class:`BEMACallback`: bias-corrected EMA of the weights (Block & Zhang 2025, "EMA Without the
  Lag: Bias-Corrected Iterate Averaging").
* :class:`MergeModelCallback`: the trained policy merged with another model at each checkpoint
  or at the end; plait merges linearly itself (no mergekit needed).
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
from transformers import GenerationConfig, TrainerCallback

from plait.data import vision
from plait.data.pretrained import pretrained_kwargs
from plait.engine.layout import pad_token_id
from plait.engine.models import Reference, SyncReference
from plait.errors import PlaitError

logger = logging.getLogger("plait")


def _unwrap(model):
    """The model inside DDP / accelerate / DeepSpeed wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


# ---------------------------------------------------------------------------------------------
# Completions table
# ---------------------------------------------------------------------------------------------


class LogCompletionsCallback(TrainerCallback):
    """Every ``freq`` steps (default: ``eval_steps`` when the trainer evaluates, else ``logging_steps``), generate
    completions for the first ``num_prompts`` evaluation prompts and log (step, prompt, completion).

    Prompts come from the evaluation dataset's ``prompt`` column (text or messages, rendered with
    the chat template as TRL does), else its ``prompt_ids``, else the beginning of each ``input_ids``
    row: its untrained prompt (a prompt-completion row after plait tokenised it), or the first half
    of a row trained on every token (such as the text a ``formatting_func`` made). Rows with
    ``images`` (a vision-language model's processor) generate with their images, and the table shows
    each prompt's image size.
    ``generation_config`` defaults to the model's own, with ``max_new_tokens`` = 64 when it sets no
    length. Rows accumulate in ``.table`` (TRL's attribute) and are printed; wandb receives the
    table when ``report_to`` includes it.
    """

    def __init__(self, trainer, generation_config: GenerationConfig | None = None, num_prompts: int | None = None,
                 freq: int | None = None):
        if trainer.eval_dataset is None:
            raise PlaitError("LogCompletionsCallback needs the trainer's eval_dataset (its prompts are generated from); "
                             "pass eval_dataset to the trainer")
        self.trainer, self.generation_config, self.freq = trainer, generation_config, freq
        dataset = trainer.eval_dataset
        self.eval_dataset = dataset.select(range(min(num_prompts, len(dataset)))) if num_prompts is not None else dataset
        self.table: list[list[str]] = []
        self._last_logged_step = -1

    def _images(self, processing_class) -> list[list]:
        """Each prompt's images (empty lists for text-only prompts or a text tokenizer)."""
        data = self.eval_dataset
        if "images" not in data.column_names or vision.image_processor_of(processing_class) is None:
            return [[] for _ in range(len(data))]
        return [vision.load_images(images) for images in data["images"]]

    def _prompt_ids(self, tokenizer, processing_class=None) -> list[list[int]]:
        from plait.data.chat import encode

        from .data_utils import maybe_apply_chat_template

        data = self.eval_dataset
        if "prompt" in data.column_names:
            texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in data["prompt"]]
            images = self._images(processing_class)
            return [encode(processing_class or tokenizer, text, special_tokens=True, images=im)
                    for text, im in zip(texts, images)]
        if "prompt_ids" in data.column_names:
            return [list(ids) for ids in data["prompt_ids"]]
        if "input_ids" in data.column_names and "completion_mask" in data.column_names:
            return [list(ids[: list(mask).index(1)]) if mask[0] == 0 else list(ids[: max(1, len(ids) // 2)])
                    for ids, mask in zip(data["input_ids"], data["completion_mask"]) if 1 in mask]
        raise PlaitError(f"LogCompletionsCallback: the eval_dataset has no prompts (columns {data.column_names}); "
                         "give it a 'prompt' column or prompt-completion rows")

    def _generation_config(self, model) -> GenerationConfig:
        if self.generation_config is not None:
            return self.generation_config
        config = copy.deepcopy(model.generation_config)
        if config.max_new_tokens is None:
            config.max_new_tokens = 64
        return config

    @torch.no_grad()
    def completions(self, model, tokenizer, batch_size: int) -> tuple[list[str], list[str]] | tuple[list[str], list[str], list[str]]:
        """(prompt texts, completion texts) of this process's share of the prompts, and their images'
        descriptions when the prompts have images."""
        from plait.data.chat import tokenizer_of

        processing_class, tokenizer = tokenizer, tokenizer_of(tokenizer)
        accelerator = self.trainer.accelerator
        model = accelerator.unwrap_model(model)
        config = self._generation_config(model)
        pad = pad_token_id(tokenizer)
        prompts, completions, sizes = [], [], []
        images = self._images(processing_class)
        with_images = any(images)
        was_training = model.training
        model.eval()
        try:
            rows = list(zip(self._prompt_ids(tokenizer, processing_class), images))
            with accelerator.split_between_processes(rows) as mine:
                for start in range(0, len(mine), batch_size):
                    batch = [ids for ids, _ in mine[start : start + batch_size]]
                    width = max(map(len, batch))
                    ids = torch.tensor([[pad] * (width - len(r)) + r for r in batch], device=model.device)  # left pad
                    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch], device=model.device)
                    shown = [im for _, im in mine[start : start + batch_size]]
                    extra = {}
                    if with_images:  # the prompts' pixel_values etc.; no image token is sampled
                        inputs = vision.RowInputs(tuple(vision.image_inputs(processing_class, im) for im in shown),
                                                  vision.marked_tokens(processing_class))
                        extra = {**inputs.kwargs(model.device, ids),
                                 "suppress_tokens": sorted(vision.image_token_ids(processing_class))}
                        sizes += [vision.describe(im) if im else "" for im in shown]
                    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, pad_token_id=pad,
                                         **extra)
                    prompts += tokenizer.batch_decode(batch, skip_special_tokens=False)
                    completions += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        finally:
            model.train(was_training)
        return (prompts, completions, sizes) if with_images else (prompts, completions)

    def on_step_end(self, args, state, control, **kwargs):
        freq = self.freq or (state.eval_steps if args.eval_strategy != "no" else state.logging_steps)
        if state.global_step == self._last_logged_step or not freq or state.global_step % freq != 0:
            return
        from accelerate.utils import gather_object

        from plait.online.chassis import format_table

        tokenizer = kwargs.get("processing_class") or self.trainer.processing_class
        columns_out = [gather_object(c) for c in self.completions(self.trainer.model_wrapped, tokenizer,
                                                                      args.per_device_eval_batch_size)]
        self._last_logged_step = state.global_step
        if not self.trainer.accelerator.is_main_process:
            return
        self.table += [[str(state.global_step), *row] for row in zip(*columns_out)]
        columns = ["step", "prompt", "completion", "image"][: 1 + len(columns_out)]
        print(format_table([dict(zip(columns, row)) for row in self.table if row[0] == str(state.global_step)]))
        if "wandb" in (args.report_to or []):
            import wandb

            if wandb.run is not None:
                wandb.log({"completions": wandb.Table(columns=columns, data=self.table)})


# ---------------------------------------------------------------------------------------------
# Reference sync (TR-DPO)
# ---------------------------------------------------------------------------------------------


class SyncRefModelCallback(SyncReference):
    """Every ``args.ref_model_sync_steps`` steps, mix the policy into ``ref_model`` with weight
    ``args.ref_model_mixup_alpha``: π_ref ← α·π + (1−α)·π_ref (TR-DPO, Gorbatovski et al. 2024,
    eq. 4). plait's own :class:`plait.engine.models.SyncReference` on a ``ref_model`` given by hand; the
    fields are read from a plait config's params or, on TRL-style arguments, from ``args`` itself.
    ``accelerator`` unwraps the policy when given (TRL's argument)."""

    def __init__(self, ref_model, accelerator=None):
        super().__init__(Reference(ref_model) if ref_model is not None else None)
        self.ref_model, self.accelerator = ref_model, accelerator

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.reference is None:
            return
        from types import SimpleNamespace

        policy = self.accelerator.unwrap_model(model) if self.accelerator is not None else model
        super().on_step_end(args if hasattr(args, "params") else SimpleNamespace(params=args), state, control, model=policy)


# ---------------------------------------------------------------------------------------------
# Progress with rich
# ---------------------------------------------------------------------------------------------


class RichProgressCallback(TrainerCallback):
    """A rich progress bar for training (and evaluation) and a table of each log, on the main process."""

    def __init__(self):
        try:
            import rich  # noqa: F401
        except ImportError as err:
            raise PlaitError("RichProgressCallback needs the 'rich' package, which is not installed; run: pip install rich") from err
        self.progress = self.console = self.training_task = self.evaluation_task = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from rich.console import Console
            from rich.progress import Progress

            self.console = Console()
            self.progress = Progress(console=self.console)
            self.progress.start()
            self.training_task = self.progress.add_task("[blue]Training", total=state.max_steps)

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(self.training_task, completed=state.global_step)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if self.progress is None:
            return
        if self.evaluation_task is None:
            total = len(eval_dataloader) if eval_dataloader is not None and hasattr(eval_dataloader, "__len__") else None
            self.evaluation_task = self.progress.add_task("[blue]Evaluation", total=total)
        self.progress.advance(self.evaluation_task)

    def on_evaluate(self, args, state, control, **kwargs):
        if self.progress is not None and self.evaluation_task is not None:
            self.progress.remove_task(self.evaluation_task)
            self.evaluation_task = None

    on_predict = on_evaluate

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.progress is None or not logs:
            return
        from rich.table import Table

        table = Table(title=f"step {state.global_step}", box=None)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in logs.items():
            table.add_row(key, f"{value:.4g}" if isinstance(value, (int, float)) else str(value))
        self.console.print(table)

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


# ---------------------------------------------------------------------------------------------
# BEMA
# ---------------------------------------------------------------------------------------------


class BEMACallback(TrainerCallback):
    """Bias-corrected exponential moving average of the weights (Block & Zhang 2025, "EMA Without
    the Lag: Bias-Corrected Iterate Averaging", BEMA):

        θ'_t = α_t·(θ_t − θ_0) + EMA_t,   EMA_t = (1 − β_t)·EMA_{t−1} + β_t·θ_t,
        α_t = (ρ + γ·t)^(−η),             β_t = max((ρ + γ·t)^(−κ), min_ema_multiplier)

    with ρ = ``lag``, γ = ``multiplier``, η = ``bias_power``, κ = ``ema_power``; θ_0 and the EMA
    start from the weights at step ``update_after`` (τ), then update every ``update_freq`` (φ)
    steps, t being the global step as in TRL 1.16. Buffers live on ``device`` (CPU by default,
    away from the training memory). The averaged model is saved to ``<output_dir>/bema`` at the
    end of training and is :attr:`running_model` meanwhile. Only trainable parameters are averaged.
    """

    def __init__(self, update_freq: int = 400, ema_power: float = 0.5, bias_power: float = 0.2, lag: int = 10,
                 update_after: int = 0, multiplier: float = 1.0, min_ema_multiplier: float = 0.0, device: str = "cpu"):
        if update_freq < 1:
            raise PlaitError(f"BEMACallback: update_freq={update_freq!r} must be >= 1")
        if lag + multiplier * update_after <= 0:
            raise PlaitError(f"BEMACallback: lag={lag!r} must make lag + multiplier·t > 0 from the first update")
        self.update_freq, self.ema_power, self.bias_power, self.lag = update_freq, ema_power, bias_power, lag
        self.update_after, self.multiplier, self.min_ema_multiplier, self.device = update_after, multiplier, min_ema_multiplier, device
        self.running_model = None
        self.names: list[str] = []
        self.theta0: list[torch.Tensor] = []
        self.ema: list[torch.Tensor] = []

    def ema_beta(self, step: int) -> float:
        return max((self.lag + self.multiplier * step) ** (-self.ema_power), self.min_ema_multiplier)

    def bema_alpha(self, step: int) -> float:
        return (self.lag + self.multiplier * step) ** (-self.bias_power)

    def _trained(self, model) -> list[torch.Tensor]:
        params = dict(_unwrap(model).named_parameters())
        return [params[name] for name in self.names]

    @torch.no_grad()
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = _unwrap(model)
        self.running_model = copy.deepcopy(model).to(self.device)
        self.running_model.requires_grad_(False)
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self._snapshot(model)

    def _snapshot(self, model) -> None:
        self.theta0 = [p.detach().to(self.device, copy=True) for p in self._trained(model)]
        self.ema = [t.clone() for t in self.theta0]

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step < self.update_after:
            return
        if step == self.update_after:
            self._snapshot(model)
            return
        if (step - self.update_after) % self.update_freq:
            return
        beta, alpha = self.ema_beta(step), self.bema_alpha(step)
        running = dict(self.running_model.named_parameters())
        for name, theta, theta0, ema in zip(self.names, self._trained(model), self.theta0, self.ema):
            theta = theta.detach().to(self.device)
            ema.mul_(1 - beta).add_(theta, alpha=beta)
            running[name].copy_(ema + alpha * (theta - theta0))

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.running_model is not None:
            self.running_model.save_pretrained(os.path.join(args.output_dir, "bema"))


# ---------------------------------------------------------------------------------------------
# Model merging
# ---------------------------------------------------------------------------------------------


class MergeConfig:
    """TRL's merge configuration: ``method`` and the weights of the policy and the target model.

    plait merges ``linear``ly itself: every floating-point tensor becomes
    ``policy_model_weight·θ_policy + target_model_weight·θ_target`` in ``dtype``. TRL's other
    methods (``ties``, ``dare_ties``, ``slerp``) come from mergekit, which plait does not use;
    they are refused with that reason. ``target_model_path`` defaults to the model the policy was
    loaded from (the reference of the run).
    """

    def __init__(self, method: str = "linear"):
        if method != "linear":
            raise PlaitError(f"MergeConfig: method={method!r} is a mergekit merge, which plait does not implement; "
                             "use method='linear' (plait's own merge)")
        self.method = method
        self.policy_model_path: str | None = None
        self.target_model_path: str | None = None
        self.policy_model_weight = 0.5
        self.target_model_weight = 0.5
        self.dtype = "float16"


class MergeModelCallback(TrainerCallback):
    """Merge the policy with ``merge_config.target_model_path`` into ``checkpoint-<step>/merged``:
    at every save with ``merge_at_every_checkpoint``, else once when training ends;
    ``push_to_hub`` uploads each merged folder to a Hub repository named after it."""

    def __init__(self, merge_config: MergeConfig | None = None, merge_at_every_checkpoint: bool = False,
                 push_to_hub: bool = False):
        self.merge_config = merge_config or MergeConfig()
        self.merge_at_every_checkpoint, self.push_to_hub = merge_at_every_checkpoint, push_to_hub

    @torch.no_grad()
    def merge(self, model, out_dir: str, processing_class=None) -> str:
        """Write the linear merge of ``model`` and the target model to ``out_dir``."""
        from transformers import AutoModelForCausalLM
        policy = _unwrap(model)
        if hasattr(policy, "merge_and_unload"):  # PEFT: the adapters folded into a copy
            policy = copy.deepcopy(policy).merge_and_unload()
        config = self.merge_config
        target_path = config.target_model_path or policy.config._name_or_path
        target = AutoModelForCausalLM.from_pretrained(target_path, **pretrained_kwargs())
        dtype = getattr(torch, config.dtype)
        mine = policy.state_dict()
        merged = copy.deepcopy(policy).to("cpu")
        state = {}
        for name, theirs in target.state_dict().items():
            if name not in mine or mine[name].shape != theirs.shape:
                raise PlaitError(f"MergeModelCallback: the target {target_path!r} has {name!r} of another shape or none in "
                                 "the policy; merge models of one architecture")
            ours = mine[name].detach().cpu()
            state[name] = ((config.policy_model_weight * ours.float() + config.target_model_weight * theirs.float()).to(dtype)
                           if ours.is_floating_point() else ours)
        merged.load_state_dict(state, strict=False)
        merged.to(dtype).save_pretrained(out_dir)
        if processing_class is not None:
            processing_class.save_pretrained(out_dir)
        logger.info("plait: merged the policy with %s (%s, weights %g/%g) into %s", target_path, config.method,
                    config.policy_model_weight, config.target_model_weight, out_dir)
        return out_dir

    def _merge_and_maybe_push(self, args, state, model, processing_class) -> None:
        if not state.is_world_process_zero:
            return
        out_dir = self.merge(model, os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "merged"), processing_class)
        if self.push_to_hub:
            from huggingface_hub import HfApi

            api = HfApi()
            repo = api.create_repo(f"{os.path.basename(os.path.normpath(args.output_dir))}_checkpoint-{state.global_step}_merged",
                                   exist_ok=True)
            api.upload_folder(folder_path=out_dir, repo_id=repo.repo_id)

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.merge_at_every_checkpoint:
            self._merge_and_maybe_push(args, state, model, processing_class)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not self.merge_at_every_checkpoint:
            self._merge_and_maybe_push(args, state, model, processing_class)
