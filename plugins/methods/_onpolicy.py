"""What distillation and PPO share: sample the current policy, serve each rollout as micro-batches.

Not a plugin (underscore): a base for method plugins that learn from their own samples one
completion per prompt. One *rollout* is ``per_device_train_batch_size × micro_steps`` prompts per
process, sampled through the configured generation backend (``generation.<name>``, found in the
registry) and turned into a buffer of tensors by the method's :meth:`OnPolicyTrainer.rollout`;
the buffer is then served ``passes`` times, reshuffled and cut into ``micro_steps``
micro-batches each pass (PPO's epochs × minibatches; distillation uses one pass).

The data loader hands out the same prompts for every micro-step of a rollout (so the
transformers Trainer counts steps and epochs correctly); only the first of them is sampled from.
GRPO's grouped sampler (:class:`plait.online.trainer.GroupSampler`) does this with groups of one.
"""

from __future__ import annotations

import functools

import attrs
import torch
from torch import Tensor

from plait import PlaitError
from plait.data.chat import is_conversational
from plait.engine.objective import LossChoice
from plait.engine.trainer import PlaitTrainer
from plait.online.generation import GenerationChoice, Generations, SamplingParams, padding_multiple, resolve_backend
from plait.online.trainer import CompletionsTable, GroupSampler, PromptData, RolloutBuffer, pack, split_rows
from plait.params import int_at_least

__all__ = ["OnPolicyParams", "OnPolicyTrainer", "pack", "split_rows"]


@attrs.define
class OnPolicyParams(GenerationChoice, LossChoice):
    """Sampling and data knobs every on-policy method shares, and its losses; names follow TRL's configs.
    How completions are sampled and logged is :class:`plait.online.generation.GenerationChoice`.

    Subclasses add ``temperature`` and the completion length under their own default, and name
    their ``default_loss``.
    """

    max_prompt_length: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
    shuffle_dataset: bool = True
    model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None


class OnPolicyTrainer(PromptData, CompletionsTable, PlaitTrainer):
    """Base of trainers that sample one completion per prompt and learn from the rollout.

    Subclasses implement :meth:`rollout_plan` (micro-steps per rollout, passes over it),
    :meth:`sampling_params`, :meth:`rollout` and ``compute_loss``; :meth:`policy_module` names the
    module the backend samples with when the trained module is a wrapper (PPO's policy + value).
    """

    # -- what a subclass fills in -------------------------------------------------------------
    def rollout_plan(self, args) -> tuple[int, int]:
        """(micro-batches per rollout, passes over each rollout)."""
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        raise NotImplementedError

    def rollout(self, inputs: dict) -> dict:
        """Sample, score and pack one rollout into a buffer of tensors (rows first)."""
        raise NotImplementedError

    def policy_module(self):
        return self._policy

    # -- construction -------------------------------------------------------------------------
    def validate(self, args) -> None:
        self.micro_steps, self.passes = self.rollout_plan(args)
        self.backend_component = resolve_backend(self.plugins, args)  # unknown names and options fail now

    def after_init(self) -> None:
        self.backend = self.backend_component.obj(self.policy_module(), self.processing_class, self.args)
        self.backend.start()
        self._synced_step = -1
        self.padding_multiple = padding_multiple(self.args.params.pad_to_multiple_of, self.accelerator.device)
        split = functools.partial(split_rows, multiple=self.padding_multiple)
        self.buffer = RolloutBuffer(self.micro_steps, self.passes, split, self.args.seed)

    # -- data loading -------------------------------------------------------------------------
    @property
    def rollout_rows(self) -> int:
        """Prompts per process in one rollout."""
        return self.args.per_device_train_batch_size * self.micro_steps

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise PlaitError(f"{type(self).__name__}.train() needs a train_dataset of prompts")
        # One loader batch is one process's whole rollout; it is re-served for every micro-step.
        return self._get_dataloader(self.train_dataset, "Training", self.rollout_rows, self._get_train_sampler,
                                    is_training=True)

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return GroupSampler(len(dataset), 1, self.rollout_rows * self.args.world_size,
                            repeat=self.micro_steps * self.passes, shuffle=self.args.params.shuffle_dataset,
                            seed=self.args.seed)

    # -- the buffer ---------------------------------------------------------------------------
    def _prepare_inputs(self, inputs):
        if not self.model.training:  # evaluation: a fresh rollout, used once
            return self.rollout(inputs)
        return self.buffer.next(lambda: self.rollout(inputs))

    def resume_state(self) -> dict:
        return {**super().resume_state(), "buffer": self.buffer.state_dict()}

    def load_resume_state(self, state: dict) -> None:
        super().load_resume_state(state)
        self.buffer.load_state_dict(state["buffer"], self.accelerator.device)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- sampling -----------------------------------------------------------------------------
    def sample(self, inputs: dict) -> tuple[list[list[int]], Generations]:
        """One completion per prompt of a collated prompt batch: (prompt ids, generations)."""
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
        if not self.backend.shares_weights and self._synced_step != self.state.global_step:
            self.backend.load_weights(self.accelerator.unwrap_model(self.policy_module()))
            self._synced_step = self.state.global_step
        generations = self.backend.generate(prompt_ids, self.sampling_params())
        self.backend.sleep()  # the policy trains now: an engine may release its memory (it wakes to generate)
        return prompt_ids, generations

    def pad_id(self) -> int:
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def pack_rollout(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> dict:
        """:func:`plait.online.trainer.pack` on this trainer's device, padded to ``pad_to_multiple_of``."""
        return pack(prompt_ids, completion_ids, self.pad_id(), self.accelerator.device, self.padding_multiple)

    def completion_texts(self, inputs: dict, generations: Generations) -> tuple[list, list]:
        """The raw prompts and the completions in the prompts' form (text, or an assistant message)."""
        prompts = inputs["prompt"]
        completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                       for t, p in zip(generations.texts, prompts)]
        return prompts, completions

    def record_lengths(self, completion_mask: Tensor, finished: Tensor) -> None:
        lengths = self.accelerator.gather(completion_mask.sum(-1).float())
        done = self.accelerator.gather(finished.float())
        self.record({"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                     "completions/max_length": lengths.max(), "completions/clipped_ratio": 1 - done.mean()})
