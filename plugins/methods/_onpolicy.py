"""What distillation and PPO share: sample the current policy, serve each rollout as micro-batches.

Not a plugin (underscore): a base for method plugins that learn from their own samples one
completion per prompt. One *rollout* is ``per_device_train_batch_size × micro_steps`` prompts per
process, sampled through the configured generation backend (``generation.<name>``, found in the
registry) and turned into a buffer of tensors by the method's :meth:`OnPolicyTrainer.rollout`;
the buffer is then served ``passes`` times, reshuffled and cut into ``micro_steps``
micro-batches each pass (PPO's epochs × minibatches; distillation uses one pass).

The data loader hands out the same prompts for every micro-step of a rollout (so the
transformers Trainer counts steps and epochs correctly); only the first of them is sampled from.
GRPO's grouped sampler (:class:`plait.online.GroupSampler`) does this with groups of one.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from plait import PlaitError
from plait.chat import is_conversational
from plait.generation import Generations, SamplingParams
from plait.objective import LossChoice
from plait.online import GroupSampler, PromptData, RolloutBuffer, format_table, prompt_text
from plait.params import in_range, positive
from plait.trainer import PlaitTrainer


def _optional(validator):
    return attrs.validators.optional(validator)


def _int_at_least(low: int):
    def check(instance, attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{attribute.name}={value!r} must be an integer >= {low}")

    return check


@attrs.define
class OnPolicyParams(LossChoice):
    """Sampling and data knobs every on-policy method shares, and its losses; names follow TRL's configs.

    Subclasses add ``temperature`` and the completion length under their own default, and name
    their ``default_loss``.
    """

    max_prompt_length: int | None = attrs.field(default=None, validator=_optional(_int_at_least(1)))
    top_p: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))
    top_k: int | None = attrs.field(default=None, validator=_optional(_int_at_least(0)))
    min_p: float | None = attrs.field(default=None, validator=_optional(in_range(0.0, 1.0)))
    repetition_penalty: float = attrs.field(default=1.0, validator=positive)
    generation_kwargs: dict | None = None
    generation_backend: str = "transformers"
    generation_max_batch_size: int | None = attrs.field(default=None, validator=_optional(_int_at_least(1)))
    disable_dropout: bool = True
    shuffle_dataset: bool = True
    log_completions: bool = False
    num_completions_to_print: int | None = attrs.field(default=None, validator=_optional(_int_at_least(1)))
    model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None

    def sampling(self, max_completion_length: int, temperature: float) -> SamplingParams:
        return SamplingParams(
            max_completion_length=max_completion_length, temperature=temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            generation_kwargs=dict(self.generation_kwargs or {}),
        )


class OnPolicyTrainer(PromptData, PlaitTrainer):
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
        self.plugins.generation_backends.get(args.params.generation_backend, family="generation")  # fail now

    def after_init(self) -> None:
        p = self.args.params
        if p.disable_dropout:
            disable_dropout(self.model)
        factory = self.plugins.generation_backends.get(p.generation_backend, family="generation").obj
        self.backend = factory(self.policy_module(), self.processing_class, self.args)
        self.backend.start()
        self._synced_step = -1
        self.buffer = RolloutBuffer(self.micro_steps, self.passes, split_rows, self.args.seed)
        self._completions_table: list[dict] = []

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

    # -- completions table --------------------------------------------------------------------
    def keep_completions(self, prompts: list, texts: list[str], **columns: list[float]) -> None:
        if self.args.params.log_completions:
            self._completions_table = [
                {"step": self.state.global_step, "prompt": prompt_text(prompt), "completion": text,
                 **{name: float(values[i]) for name, values in columns.items()}}
                for i, (prompt, text) in enumerate(zip(prompts, texts))
            ]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        rows, self._completions_table = getattr(self, "_completions_table", []), []
        if rows and self.accelerator.is_main_process:
            limit = self.args.params.num_completions_to_print
            print(format_table(rows[:limit] if limit else rows))


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def disable_dropout(model: torch.nn.Module) -> None:
    """Sampling and scoring must see the same function as the update: no dropout anywhere."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def pack(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int, device) -> dict:
    """Left-padded prompts then right-padded completions: ``input_ids`` [N, P + C] and masks.

    ``completion_mask`` [N, C] marks the sampled tokens; ``prompt_length`` is P, where completions start.
    """
    n = len(prompt_ids)
    width = max(len(ids) for ids in prompt_ids)
    length = max(1, max(len(ids) for ids in completion_ids))
    input_ids = torch.full((n, width + length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width + length), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, width - len(prompt):width] = torch.tensor(prompt)
        attention[i, width - len(prompt):width + len(completion)] = 1
        if completion:
            input_ids[i, width:width + len(completion)] = torch.tensor(completion)
    return {"input_ids": input_ids.to(device), "attention_mask": attention.to(device),
            "completion_mask": attention[:, width:].to(device), "prompt_length": width}


def split_rows(buffer: dict, parts: int, generator: torch.Generator) -> list[dict]:
    """Shuffle a buffer's rows and cut them into ``parts`` micro-batches, trimming padding columns.

    Tensors of width P + C (``input_ids``, ``attention_mask``) and of width C (completion-aligned)
    are trimmed alike; tensors that are not per-row (0-dim normalisers) are shared.
    """
    n = buffer["input_ids"].shape[0]
    if n % parts:
        raise PlaitError(f"a rollout of {n} rows does not split into {parts} micro-batches")
    full = buffer["input_ids"].shape[1]
    prompt = buffer["prompt_length"]
    order = torch.randperm(n, generator=generator).to(buffer["input_ids"].device)
    chunks = []
    for rows in order.chunk(parts):
        keep = max(int(buffer["attention_mask"][rows].sum(0).nonzero().max()) + 1, prompt + 1)
        chunk = {}
        for key, value in buffer.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n:
                value = value[rows]
                if value.dim() > 1 and value.shape[1] == full:
                    value = value[:, :keep]
                elif value.dim() > 1 and value.shape[1] == full - prompt:
                    value = value[:, :keep - prompt]
            chunk[key] = value
        chunks.append(chunk)
    return chunks


