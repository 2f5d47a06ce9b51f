"""The chassis of online methods (GRPO, RLOO): sample, score, estimate advantages, re-use a buffer.

One *generation batch* is ``per_device_train_batch_size × processes × steps_per_generation``
completions (or ``generation_batch_size``): ``num_generations`` per prompt, groups kept
together. Per generation batch the trainer

1. samples completions through the configured generation backend (``generation.<name>``),
2. computes the sampling policy's log-probs when the buffer outlives one optimizer step
   (``num_iterations`` > 1 or more micro-batches than one accumulation window), and the
   reference's when the method needs them (beta > 0),
3. scores every completion with the reward functions (:mod:`plait.online.scoring`), gathers the scores
   of all processes, and turns them into advantages with a registered estimator,
4. serves the buffer, shuffled and cut into ``steps_per_generation`` micro-batches,
   ``num_iterations`` times over; each micro-batch becomes a :class:`plait.engine.batches.PolicyTokens`
   for the method's composed losses.

The data loader hands out the same prompts for every micro-step of a generation batch (so the
transformers Trainer counts steps and epochs correctly); only the first of them is generated from.
A method subclasses :class:`OnlineTrainer` and says how advantages come from rewards and which
ratio its clip metrics use. Nothing here names a concrete loss, reward, estimator or backend.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
from typing import Any, Callable, ClassVar

import attrs
import torch
from torch import Tensor
from torch.utils.data import Sampler

from plait.data import vision
from plait.data.chat import is_conversational, text_of
from plait.engine.attention import prompt_shared_layout
from plait.engine.batches import PolicyTokens, Rollout, gather_ragged, masked_mean
from plait.engine.models import Reference, ReferenceSync, SyncReference
from plait.engine.objective import LossChoice, Objective
from plait.engine.trainer import PlaitTrainer
from plait.errors import PlaitError
from plait.params import int_at_least, non_negative, one_of, positive

from .generation import GenerationChoice, Generations, padded_width, padding_multiple, resolve_backend
from .importance_sampling import importance_sampling_metrics, importance_weights
from .rollouts import Agent, AgentChoice
from .scoring import (
    RewardChoice,
    RewardLogs,
    UnscoredBatches,
    compute_rewards,
    resolve_advantage_estimator,
    resolve_reward_funcs,
    reward_metrics,
    reward_weights,
)

logger = logging.getLogger("plait")

IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
def _optional(validator):
    return attrs.validators.optional(validator)


@attrs.define
class OnlineParams(ReferenceSync, AgentChoice, GenerationChoice, LossChoice, RewardChoice):
    """Knobs every online method shares, its losses included; names and defaults follow TRL's GRPOConfig.
    How completions are sampled and logged is :class:`plait.online.generation.GenerationChoice`; tools,
    environments and rollout functions (multi-turn episodes) are :class:`plait.online.rollouts.AgentChoice`.

    ``num_generations_eval`` completions per prompt are sampled in evaluation (None: ``num_generations``).
    The sampler's importance ratio ρ (see :mod:`plait.online.importance_sampling`) is bounded to
    [``vllm_importance_sampling_clip_min``, ``vllm_importance_sampling_clip_max``] (None: unbounded on
    that side): truncated there by the ``*_truncate`` modes, zeroed outside by the ``*_mask`` modes.
    ``vllm_importance_sampling_cap`` is TRL's deprecated name for the upper bound; when given it wins.
    ``padding_free`` (plait's; None: wherever the models attend a packed row per sequence, see
    :meth:`plait.engine.trainer.PlaitTrainer.wants_padding_free`) computes the log-probs of a rollout's
    rows with their tokens back to back in one row, without the prompts' left and the
    completions' right padding. ``prefix_sharing`` (plait's; None: wherever the models' attention can,
    :func:`plait.engine.attention.shares_prefixes`) computes there each prompt once for all the completions
    of it in a micro-batch (:func:`packed_token_logprobs`).

    Subclasses name their ``default_loss``."""

    # generation
    num_generations: int = attrs.field(default=8, validator=int_at_least(2))
    num_generations_eval: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    generation_batch_size: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    steps_per_generation: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    max_prompt_length: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    max_completion_length: int = attrs.field(default=512, validator=int_at_least(1))
    temperature: float = attrs.field(default=1.0, validator=positive)
    # sampler/trainer mismatch (backends that report log-probs, e.g. a bf16 vLLM engine)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = attrs.field(default="sequence_mask", validator=one_of(IS_MODES))
    vllm_importance_sampling_clip_max: float | None = attrs.field(default=3.0, validator=_optional(positive))
    vllm_importance_sampling_clip_min: float | None = attrs.field(default=None, validator=_optional(non_negative))
    vllm_importance_sampling_cap: float | None = attrs.field(default=None, validator=_optional(positive))
    # optimisation
    num_iterations: int = attrs.field(default=1, validator=int_at_least(1))
    epsilon: float = attrs.field(default=0.2, validator=positive)
    epsilon_high: float | None = attrs.field(default=None, validator=_optional(positive))
    delta: float | None = attrs.field(default=None, validator=_optional(positive))
    beta: float = attrs.field(default=0.0, validator=non_negative)
    mask_truncated_completions: bool = False
    shuffle_dataset: bool = True
    # models and data
    model_init_kwargs: dict | None = None
    padding_free: bool | None = None
    prefix_sharing: bool | None = None
    dataset_num_proc: int | None = None

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        low, high = self.importance_sampling_bounds()
        if low is not None and high is not None and low >= high:
            raise PlaitError(f"vllm_importance_sampling_clip_min={low} must be below vllm_importance_sampling_clip_max="
                             f"{high}; lower the first or raise the second")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("truncate")
                and low is None and high is None):
            raise PlaitError(f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} truncates the ratio "
                             "but neither vllm_importance_sampling_clip_min nor vllm_importance_sampling_clip_max is "
                             "set; set one (e.g. vllm_importance_sampling_clip_max=3.0)")

    def importance_sampling_bounds(self) -> tuple[float | None, float | None]:
        """(C_min, C_max) of the importance ratio; TRL's deprecated ``vllm_importance_sampling_cap``,
        when given, is C_max."""
        high = self.vllm_importance_sampling_cap
        return self.vllm_importance_sampling_clip_min, (self.vllm_importance_sampling_clip_max if high is None else high)

    def generations_per_prompt(self, training: bool) -> int:
        """Completions per prompt: ``num_generations`` in training, ``num_generations_eval`` (when set) in evaluation."""
        return self.num_generations if training or self.num_generations_eval is None else self.num_generations_eval


def completion_columns(input_ids: Tensor, prompt_length: int) -> Tensor:
    """[B, T] mask of the completion columns (prompts are left-padded to ``prompt_length``): the only
    tokens whose log-probs the online losses read, so the only positions the output layer projects."""
    columns = torch.arange(input_ids.shape[1], device=input_ids.device) >= prompt_length
    return columns.expand_as(input_ids)


# ---------------------------------------------------------------------------------------------
# Sizes and the sampler
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class GenerationSizes:
    """How one generation batch divides: completions per process, micro-batches, prompts."""

    per_device: int
    processes: int
    steps_per_generation: int
    num_generations: int

    @property
    def local(self) -> int:
        return self.per_device * self.steps_per_generation

    @property
    def total(self) -> int:
        return self.local * self.processes

    @property
    def prompts(self) -> int:
        return self.total // self.num_generations


def generation_sizes(args) -> GenerationSizes:
    """Resolve and check the generation batch of a config, before any model loads."""
    p = args.params
    per_device, processes, accumulation = args.per_device_train_batch_size, args.world_size, args.gradient_accumulation_steps
    step = per_device * processes
    if p.generation_batch_size is not None and p.steps_per_generation is not None:
        raise PlaitError(f"generation_batch_size={p.generation_batch_size} and steps_per_generation="
                         f"{p.steps_per_generation} both set the generation batch; give only one")
    if p.generation_batch_size is not None:
        if p.generation_batch_size % step:
            raise PlaitError(
                f"generation_batch_size={p.generation_batch_size} is not a multiple of per_device_train_batch_size "
                f"{per_device} × {processes} processes = {step}; use a multiple of {step}")
        spg = p.generation_batch_size // step
    else:
        spg = p.steps_per_generation or accumulation
    sizes = GenerationSizes(per_device, processes, spg, p.num_generations)
    if sizes.total % p.num_generations:
        g = p.num_generations
        divisors = [d for d in range(2, sizes.total + 1) if sizes.total % d == 0][:4]
        multiple = math.lcm(step, g)
        raise PlaitError(
            f"the generation batch of {sizes.total} completions (per_device_train_batch_size {per_device} × "
            f"{processes} processes × steps_per_generation {spg}) is not divisible by num_generations={g}; "
            f"set num_generations to a divisor of {sizes.total} (e.g. {', '.join(map(str, divisors)) or 'none ≥ 2'}) "
            f"or set generation_batch_size to a multiple of {multiple} (e.g. {multiple})")
    return sizes


class GroupSampler(Sampler[int]):
    """Dataset indices for generation batches: each prompt ``group_size`` times in a row.

    Prompts are drawn (shuffled per pass when ``shuffle``) ``prompts_per_batch`` at a time; each
    batch's index list is emitted ``repeat`` times, once per micro-step that re-uses it. Only
    whole generation batches are emitted.
    """

    def __init__(self, size: int, group_size: int, prompts_per_batch: int, repeat: int = 1,
                 shuffle: bool = True, seed: int = 0):
        if size < prompts_per_batch:
            raise PlaitError(f"the dataset has {size} prompts but one generation batch needs {prompts_per_batch}; "
                             "add prompts or make the generation batch smaller")
        self.size, self.group_size, self.prompts_per_batch = size, group_size, prompts_per_batch
        self.repeat, self.shuffle, self.seed, self.epoch = repeat, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(range(self.size))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
            self.epoch += 1  # a fresh order on the next pass even if nobody calls set_epoch
        for start in range(0, self.size - self.prompts_per_batch + 1, self.prompts_per_batch):
            rows = [i for i in order[start:start + self.prompts_per_batch] for _ in range(self.group_size)]
            for _ in range(self.repeat):
                yield from rows

    def __len__(self) -> int:
        return (self.size // self.prompts_per_batch) * self.prompts_per_batch * self.group_size * self.repeat


# ---------------------------------------------------------------------------------------------
# The rollout buffer
# ---------------------------------------------------------------------------------------------


class RolloutBuffer:
    """One rollout served as micro-batches, and where the run stands in it.

    A fresh rollout is sampled every ``micro_steps × passes`` micro-steps; each pass over it
    starts with a reshuffle, ``split(rollout, micro_steps, generator)``, into ``micro_steps``
    micro-batches. A checkpoint may fall anywhere in a rollout (``save_steps`` is the user's to
    choose), so :meth:`state_dict` holds the position, the shuffle generator and, mid-rollout,
    the rollout itself: resuming serves the same micro-batches an uninterrupted run would have.
    """

    def __init__(self, micro_steps: int, passes: int, split: Callable[[dict, int, torch.Generator], list[dict]],
                 seed: int):
        self.micro_steps, self.passes, self.split = micro_steps, passes, split
        self.step = 0  # micro-steps served so far
        self.rollout: dict | None = None
        self.chunks: list[dict] = []
        self.generator = torch.Generator().manual_seed(seed)
        self._pass_start = self.generator.get_state()  # the generator as this pass's shuffle found it

    @property
    def per_rollout(self) -> int:
        return self.micro_steps * self.passes

    def next(self, sample: Callable[[], dict]) -> dict:
        """The next micro-batch; ``sample()`` is called when a new rollout is due."""
        if self.step % self.per_rollout == 0:
            self.rollout = sample()
        if self.step % self.micro_steps == 0:  # a fresh shuffle for every pass over the rollout
            self._reshuffle()
        chunk = self.chunks[self.step % self.micro_steps]
        self.step += 1
        return chunk

    def _reshuffle(self) -> None:
        self._pass_start = self.generator.get_state()
        self.chunks = self.split(self.rollout, self.micro_steps, self.generator)

    def state_dict(self) -> dict:
        """The position, the generator and (mid-rollout) the rollout on the CPU; mid-pass the
        generator is saved as the pass found it, so the same shuffle is cut again on load."""
        mid_pass = self.step % self.micro_steps != 0
        state = {"step": self.step, "generator": self._pass_start if mid_pass else self.generator.get_state()}
        if self.step % self.per_rollout:
            state["rollout"] = {k: v.cpu() if torch.is_tensor(v) else v for k, v in self.rollout.items()}
        return state

    def load_state_dict(self, state: dict, device) -> None:
        self.step = state["step"]
        self.generator.set_state(state["generator"])
        rollout = state.get("rollout")
        self.rollout = None if rollout is None else {k: v.to(device) if torch.is_tensor(v) else v
                                                     for k, v in rollout.items()}
        self.chunks = []
        if self.step % self.micro_steps:
            self._reshuffle()


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


class PromptData:
    """The data of a trainer that learns from its own samples: rows are prompts (the ``prompt_only``
    task, cut to ``max_prompt_length``), batched left-padded by ``collator.prompt_only``.
    Shared by :class:`OnlineTrainer` and the on-policy PPO/distillation base."""

    gives_eval_predictions = False  # no logits and labels for compute_metrics: evaluation samples and scores

    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        from plait.data.prepare import prepare_dataset

        p = args.params
        return prepare_dataset(dataset, processing_class, "prompt_only", plugins=self.plugins,
                               max_length=p.max_prompt_length, num_proc=p.dataset_num_proc,
                               chat_template_kwargs=p.chat_template_kwargs)

    def make_collator(self, processing_class, args):
        return self.plugins.collators.get("collator.prompt_only").obj(processing_class)


class CompletionsTable:
    """The completions table of a trainer that learns from its own samples (``log_completions``):
    the rows of the latest rollout (step, prompt, completion, per-row numbers such as rewards) are
    printed at the next log, ``num_completions_to_print`` of them, and all are sent to wandb when
    ``report_to`` includes it; ``log_unique_prompts`` keeps one row per prompt.
    Shared by :class:`OnlineTrainer` and the on-policy PPO/distillation base."""

    _completions_table: list[dict] = []

    def keep_completions(self, prompts: list, texts: list[str], **columns) -> None:
        if self.args.params.log_completions:
            self._completions_table = [
                {"step": self.state.global_step, "prompt": prompt_text(prompt), "completion": text,
                 **{name: _table_value(values[i]) for name, values in columns.items()}}
                for i, (prompt, text) in enumerate(zip(prompts, texts))
            ]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        p = self.args.params
        rows, self._completions_table = self._completions_table, []
        if not rows or not self.accelerator.is_main_process:
            return
        if p.log_unique_prompts:
            seen: set[str] = set()
            rows = [row for row in rows if not (row["prompt"] in seen or seen.add(row["prompt"]))]
        print(format_table(rows[:p.num_completions_to_print] if p.num_completions_to_print else rows))
        if "wandb" in (self.args.report_to or []):
            import wandb

            if wandb.run is not None:
                columns = list(rows[0])
                wandb.log({"completions": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])})


class OnlineTrainer(PromptData, CompletionsTable, PlaitTrainer):
    """Base of GRPO/RLOO trainers. Subclasses set ``method``, ``config_class``, ``loss_family``
    and ``shared_loss_fields``, give their params an ``advantage_spec()``, and implement
    :meth:`advantages`."""

    loss_family: ClassVar[str]
    shared_loss_fields: ClassVar[tuple[str, ...]] = ()  # params every loss that takes them receives
    # The constructor's reward arguments, read by validate(). Class defaults, because validate()
    # also runs on a trainer whose __init__ never ran (`plait <method> --check`: a recipe gives its
    # rewards as the config's reward_funcs).
    _reward_specs = None
    _reward_processing_classes = None
    _agent_args: dict = {}  # tools, environment_factory, rollout_func given to the constructor
    _images = False  # does the training data hold images (a VLM's prompts)?
    takes_images = True  # generation and every forward get the prompts' images (plait.data.vision)

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, plugins=None, tools=None, rollout_func=None,
                 environment_factory=None):
        self._reward_specs = reward_funcs
        self._reward_processing_classes = reward_processing_classes
        self._agent_args = {"tools": tools, "rollout_func": rollout_func, "environment_factory": environment_factory}
        self._images = vision.holds_images(train_dataset)
        super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, peft_config=peft_config, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config, plugins=plugins)

    # -- construction -------------------------------------------------------------------------
    def validate(self, args) -> None:
        p = args.params
        if args.remove_unused_columns:
            raise PlaitError("remove_unused_columns=True would drop the prompt and the columns reward functions read; "
                             "set remove_unused_columns=False (the default of online methods)")
        self.sizes = generation_sizes(args)
        if args.eval_strategy != "no":
            eval_rows, g = args.per_device_eval_batch_size * args.world_size, p.generations_per_prompt(training=False)
            if eval_rows % g:
                name = "num_generations" if p.num_generations_eval is None else "num_generations_eval"
                raise PlaitError(
                    f"per_device_eval_batch_size {args.per_device_eval_batch_size} × {args.world_size} processes = "
                    f"{eval_rows} is not divisible by {name}={g}; make it a multiple")
        specs = self._reward_specs
        if specs is not None and p.reward_funcs is not None:
            raise PlaitError("reward functions are given both as the reward_funcs argument and in the config's "
                             "reward_funcs; give them once")
        specs = specs if specs is not None else p.reward_funcs
        self.agent = Agent.from_params(p, self.plugins, **self._agent_args)  # multi-turn episodes (plait.online.rollouts)
        owned = self.agent is not None and self.agent.owns_reward  # an environment that scores its episodes
        if specs is None and owned:
            specs = []
        if specs is None:
            raise PlaitError(f"{type(self).__name__} needs reward_funcs: a registered name (e.g. 'think_format'), "
                             "a callable, or a reward-model path")
        entries = list(specs) if isinstance(specs, (list, tuple)) else [specs]
        if p.reward_weights is not None and len(p.reward_weights) != len(entries):
            raise PlaitError(f"reward_weights has {len(p.reward_weights)} values for {len(entries)} reward functions; "
                             "give one weight per reward function")
        self.objective = self.build_objective(p)
        if p.sync_ref_model and not self.uses_reference(p):  # TRL 1.16 refuses it too
            raise PlaitError(f"sync_ref_model=True but beta={p.beta} uses no reference model, so there is nothing to "
                             "sync; set sync_ref_model=False or beta > 0")
        self.backend_component = resolve_backend(self.plugins, args)  # unknown names and options fail now
        if self._images and not self.backend_component.options.get("images"):
            raise PlaitError(f"the prompts hold images but {self.backend_component.name} cannot pass images to the model; "
                             "set use_vllm=False to sample with generation.transformers")
        self.reward_funcs = ((self._resolve_rewards(entries) if entries else [])
                             + ([self.agent.reward_function()] if owned else []))
        weights = p.reward_weights if p.reward_weights is None or not owned else [*p.reward_weights, 1.0]
        self.reward_weights = reward_weights(self.reward_funcs, weights)

    def _resolve_rewards(self, entries: list) -> list:
        classes = self._reward_processing_classes
        if classes is None:
            return resolve_reward_funcs(entries, self.plugins)
        classes = list(classes) if isinstance(classes, (list, tuple)) else [classes]
        if len(classes) != len(entries):
            raise PlaitError(f"reward_processing_classes has {len(classes)} entries for {len(entries)} reward "
                             "functions; give one per reward function (None where unused)")
        funcs = [resolve_reward_funcs([e], self.plugins, c, field=f"reward_funcs[{i}]")[0]
                 for i, (e, c) in enumerate(zip(entries, classes))]
        seen: dict[str, int] = {}
        for i, func in enumerate(funcs):  # unique names, so each reward gets its own metrics
            seen[func.name] = seen.get(func.name, 0) + 1
            if seen[func.name] > 1:
                funcs[i] = attrs.evolve(func, name=f"{func.name}_{seen[func.name]}")
        return funcs

    def build_objective(self, p) -> Objective:
        """The advantage estimator the params name and the ``loss_family`` losses they list."""
        self.estimator = resolve_advantage_estimator(p.advantage_spec(), self.plugins, field="advantage_estimator")
        shared = {name: getattr(p, name) for name in self.shared_loss_fields if getattr(p, name) is not None}
        return Objective.build(p.loss_specs(), self.plugins.losses, family=self.loss_family, consumes=PolicyTokens,
                               shared=shared, field=p.loss_field)

    def uses_reference(self, p) -> bool:
        """A KL term with beta > 0 (the config's, or one a loss entry sets itself) needs the reference."""
        return p.beta > 0 or any((getattr(term.params, "beta", 0.0) or 0.0) > 0 for term in self.objective.terms)

    def before_peft(self, model, args, **kwargs):
        if kwargs:
            raise PlaitError(f"{type(self).__name__} got unexpected arguments {sorted(kwargs)}")
        if self.uses_reference(args.params):
            # With adapters the reference is the same weights with adapters off (or a frozen adapter copy)
            self.reference = Reference.for_policy(model, peft_config=self.peft_config)
            if args.params.sync_ref_model:
                self.reference.check_syncable(model, self.peft_config)
        else:
            self.reference = Reference.none()  # beta = 0: no reference model at all
        return model

    def after_init(self) -> None:
        p = self.args.params
        self.loss_is_scaled_for_ga = True  # every loss plugin normalises for accumulation itself
        if self.reference.model is not None:
            self.reference.model = self.accelerator.prepare_model(self.reference.model, evaluation_mode=True)
        if p.sync_ref_model:
            self.add_callback(SyncReference(self.reference))
        self.backend = self.backend_component.obj(self.model, self.processing_class, self.args)
        self.backend.start()
        self._synced_step = -1
        self.padding_multiple = padding_multiple(p.pad_to_multiple_of, self.accelerator.device)
        split = functools.partial(split_rows, multiple=self.padding_multiple)
        self.buffer = RolloutBuffer(self.sizes.steps_per_generation, p.num_iterations, split, self.args.seed)
        self.unscored = UnscoredBatches([f.name for f in self.reward_funcs], p.max_unscored_batches)

    # -- data loading -------------------------------------------------------------------------
    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise PlaitError(f"{type(self).__name__}.train() needs a train_dataset of prompts")
        # One loader batch is one process's whole generation batch; it is re-served per micro-step.
        return self._get_dataloader(self.train_dataset, "Training", self.sizes.local, self._get_train_sampler,
                                    is_training=True)

    def _get_train_sampler(self, train_dataset=None):
        p = self.args.params
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return GroupSampler(len(dataset), p.num_generations, self.sizes.prompts,
                            repeat=self.sizes.steps_per_generation * p.num_iterations,
                            shuffle=p.shuffle_dataset, seed=self.args.seed)

    def _get_eval_sampler(self, eval_dataset):
        g = self.args.params.generations_per_prompt(training=False)
        prompts = self.args.per_device_eval_batch_size * self.args.world_size // g
        return GroupSampler(len(eval_dataset) // prompts * prompts, g, prompts, shuffle=False)

    @property
    def group_size(self) -> int:
        """Completions per prompt in the rollout being built (evaluation may use fewer)."""
        return self.args.params.generations_per_prompt(training=self.model.training)

    # -- the buffer ---------------------------------------------------------------------------
    def _prepare_inputs(self, inputs):
        if not self.model.training:  # evaluation: a fresh rollout, scored and used once
            return self.rollout(inputs)
        return self.buffer.next(lambda: self.rollout(inputs))

    def resume_state(self) -> dict:
        return {**super().resume_state(), "buffer": self.buffer.state_dict(),
                "num_tokens": getattr(self, "_tokens_seen", 0)}

    def load_resume_state(self, state: dict) -> None:
        super().load_resume_state(state)
        self.buffer.load_state_dict(state["buffer"], self.accelerator.device)
        self._tokens_seen = state["num_tokens"]

    def needs_old_logps(self) -> bool:
        """Does the policy change while the buffer is in use? (then ratios need π_old)."""
        uses = self.sizes.steps_per_generation * self.args.params.num_iterations
        return self.args.gradient_accumulation_steps % uses != 0

    # -- one rollout --------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, inputs: dict) -> dict:
        p = self.args.params
        device = self.accelerator.device
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
        prompts = inputs["prompt"]
        columns = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "prompt", vision.KEY)}
        n, g = len(prompt_ids), self.group_size
        images = inputs.get(vision.KEY)  # a VLM's per-row image inputs (plait.data.vision), aligned with the rows

        if self.agent is None:
            # an override of generate (async GRPO's worker) that takes no images is called as before
            generations = self.generate(prompt_ids, g) if images is None else self.generate(prompt_ids, g, images=images)
        else:  # tools, an environment or a rollout_func: multi-turn episodes (plait.online.rollouts)
            generations = self.agent.run(self, prompts, columns, g)
            prompt_ids, columns = generations.prompt_ids, {**columns, **self.agent.columns(generations)}
        batch = pack(prompt_ids, generations.completion_ids, self._pad_id(), device, self.padding_multiple)
        if images is not None:
            batch[vision.KEY] = images
        if self.agent is not None:  # inserted tokens leave the completion mask for the tool mask
            Agent.masks(batch, generations)
        completion_mask = batch["completion_mask"]
        finished = torch.tensor(generations.finished, device=device)
        loss_mask = completion_mask * finished.unsqueeze(-1) if p.mask_truncated_completions else completion_mask

        with self.compute_loss_context_manager():
            old = self.policy_logps(batch) if (self.needs_old_logps() or generations.logprobs is not None) else None
            ref = None
            if self.reference.available:
                ref = self.reference(self.model_wrapped, lambda m: self.logps_of(m, batch))
        weights = sampler = None
        if generations.logprobs is not None:  # the sampler's own log-probs (off-policy masking reads them too)
            sampler = _pad_floats(generations.logprobs, batch["completion_mask"].shape[1], device)
        if sampler is not None and p.vllm_importance_sampling_correction:
            low, high = p.importance_sampling_bounds()
            weights = importance_weights(old, sampler, completion_mask, p.vllm_importance_sampling_mode, high, low)
            self.record(importance_sampling_metrics(old, sampler, completion_mask, p.vllm_importance_sampling_mode,
                                                    high, low))

        completions = [[{"role": "assistant", "content": t}] if is_conversational(pr) else t
                       for t, pr in zip(generations.texts, prompts)]
        if getattr(generations, "messages", None) is not None:  # an episode's assistant and tool messages
            completions = generations.messages
        logs = RewardLogs()  # what the reward functions log (log_extra, log_metric)
        rewards = compute_rewards(self.reward_funcs, prompts=prompts, completions=completions,
                                  completion_ids=generations.completion_ids, columns=columns,
                                  trainer_state=self.state, on_error=p.reward_error_policy,
                                  timeout=p.reward_timeout, logs=logs).to(device)
        self._record_logged_metrics(logs.metrics)
        everyone = self.accelerator.gather(rewards)
        if self.model.training:
            self.unscored.check(everyone)
        advantages = self.advantages(everyone, batch=batch, old_logps=old, ref_logps=ref)
        start = self.accelerator.process_index * n
        local = advantages[start:start + n].to(device)

        tokens = self.accelerator.gather(loss_mask.sum().reshape(1)).sum().float()
        per_step = tokens / self.accelerator.num_processes  # dapo's normaliser, per process ...
        if self.model.training:  # ... scaled to the share of the generation batch one optimizer step sees
            per_step = per_step * self.args.gradient_accumulation_steps / self.sizes.steps_per_generation
        self._record_rollout(everyone, completion_mask, finished, advantages)
        scores = everyone[start:start + n]
        table = {**{f.name: scores[:, k] for k, f in enumerate(self.reward_funcs)}, **logs.extra, "advantage": local}
        if columns.get("images") is not None:  # the prompt's image(s), by size
            table = {"image": [vision.describe(vision.load_images(row)) for row in columns["images"]], **table}
        self.keep_completions(prompts, generations.texts, **table)
        out = {
            "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "completion_mask": loss_mask,
            "advantages": local, "prompt_length": batch["prompt_length"],
            "num_items_in_batch": per_step,
        }
        for key, value in (("old_logps", old), ("ref_logps", ref), ("importance_weights", weights), (vision.KEY, images),
                           ("sampling_logps", sampler), ("tool_mask", batch.get("tool_mask"))):
            if value is not None:
                out[key] = value
        return out

    def generate(self, prompt_ids: list[list[int]], g: int, images: vision.RowInputs | None = None) -> Generations:
        """Sample one completion per row. Rows come as whole groups when the process's share of the
        generation batch holds whole groups; then each prompt is sent once with n = g."""
        backend = self.backend
        if not backend.shares_weights and self._synced_step != self.state.global_step:
            backend.load_weights(self.accelerator.unwrap_model(self.model))
            self._synced_step = self.state.global_step
        sampling = self.args.params.sampling()
        grouped = len(prompt_ids) % g == 0 and all(
            prompt_ids[i] == prompt_ids[i - i % g] for i in range(len(prompt_ids)))
        with_images = {} if images is None else {"images": images.select(slice(None, None, g) if grouped else slice(None))}
        if grouped:
            out = backend.generate(prompt_ids[::g], attrs.evolve(sampling, num_generations=g), **with_images)
        else:
            out = backend.generate(prompt_ids, sampling, **with_images)
        backend.sleep()  # the policy trains now: an engine may release its memory (it wakes to generate)
        return out

    def wants_padding_free(self, args) -> bool | None:
        return args.params.padding_free

    def wants_prefix_sharing(self, args) -> bool | None:
        return args.params.prefix_sharing

    def rows_logprobs(self, model, input_ids: Tensor, attention_mask: Tensor, **kwargs):
        """``token_logprobs`` of rollout rows ``[N, P + C]`` (left-padded prompts, right-padded
        completions), every statistic ``[N, P + C]``: one forward over the padded rows, or with
        ``self.padding_free`` over their real tokens back to back (:func:`packed_token_logprobs`)."""
        if self.padding_free:
            return packed_token_logprobs(self.token_logprobs, model, input_ids, attention_mask,
                                         share_prompts=self.prefix_sharing, **kwargs)
        return self.token_logprobs(model, input_ids, attention_mask, **kwargs)

    def logps_of(self, model, batch: dict) -> Tensor:
        """Completion-token log-probs ``[N, C]`` of ``model``, per_device_train_batch_size rows at a time."""
        size, width = self.args.per_device_train_batch_size, batch["prompt_length"]
        parts = []
        for start in range(0, batch["input_ids"].shape[0], size):
            rows = slice(start, start + size)
            ids = batch["input_ids"][rows]
            out = self.rows_logprobs(model, ids, batch["attention_mask"][rows], temperature=self.args.params.temperature,
                                     select=completion_columns(ids, width), **vision.model_inputs(batch, rows))
            parts.append(out.logps[:, width:].float())
        return torch.cat(parts)

    def policy_logps(self, batch: dict) -> Tensor:
        return self.logps_of(self.model_wrapped, batch)

    def advantages(self, rewards: Tensor, *, batch: dict, old_logps: Tensor | None, ref_logps: Tensor | None) -> Tensor:
        """Advantages ``[N_all]`` of every process's completions from their scores ``[N_all, K]``."""
        raise NotImplementedError

    def gather_rollout(self, rewards: Tensor) -> Rollout:
        return Rollout(rewards=rewards.float().cpu(), weights=self.reward_weights, group_size=self.group_size)

    # -- the loss ------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        p = self.args.params
        width = inputs["prompt_length"]
        out = self.rows_logprobs(model, inputs["input_ids"], inputs["attention_mask"], temperature=p.temperature,
                                 with_entropy=True, select=completion_columns(inputs["input_ids"], width),
                                 **vision.model_inputs(inputs))
        logps, mask = out.logps[:, width:], inputs["completion_mask"]
        training = self.model.training
        batch = PolicyTokens(
            logps=logps, old_logps=inputs.get("old_logps", logps.detach()), advantages=inputs["advantages"],
            mask=mask, ref_logps=inputs.get("ref_logps"), importance_weights=inputs.get("importance_weights"),
            num_items_in_batch=inputs["num_items_in_batch"],
            gradient_accumulation_steps=self.current_gradient_accumulation_steps if training else 1,
            max_completion_length=p.max_completion_length,
            entropy=out.entropy[:, width:], sampling_logps=inputs.get("sampling_logps"),
            gather=functools.partial(gather_ragged, self.accelerator), tool_mask=inputs.get("tool_mask"),
        )
        loss, parts = self.objective(batch)
        metrics = {"entropy": masked_mean(out.entropy[:, width:].detach(), mask)}
        if batch.ref_logps is not None:
            r = batch.ref_logps - logps.detach()
            metrics["kl"] = masked_mean(torch.exp(r) - r - 1, mask)
        metrics.update(self.clip_metrics(batch))
        if len(parts) > 1:
            metrics.update({f"loss/{name}": value.detach() for name, value in parts.items()})
        self.record(metrics)
        return (loss, None) if return_outputs else loss

    def clip_ratio(self, batch: PolicyTokens) -> Tensor:
        """The importance ratio the clip acts on, ``[B, T]`` or ``[B, 1]`` (metrics only)."""
        return torch.exp(batch.logps.detach() - batch.old_logps)

    def clip_metrics(self, batch: PolicyTokens) -> dict[str, Tensor]:
        p = self.args.params
        ratio = self.clip_ratio(batch).expand_as(batch.logps)
        advantages = batch.token_advantages.expand_as(batch.logps)
        high = p.epsilon if p.epsilon_high is None else p.epsilon_high
        low_clipped = (ratio < 1 - p.epsilon) & (advantages < 0)
        high_clipped = (ratio > 1 + high) & (advantages > 0)
        return {
            "clip_ratio/low_mean": masked_mean(low_clipped.float(), batch.mask),
            "clip_ratio/high_mean": masked_mean(high_clipped.float(), batch.mask),
            "clip_ratio/region_mean": masked_mean((low_clipped | high_clipped).float(), batch.mask),
        }

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- metrics and completions --------------------------------------------------------------
    def _record_logged_metrics(self, metrics: dict[str, list[float]]) -> None:
        """The scalars reward functions logged with ``log_metric``: each the mean of the values every
        process logged for this generation batch (TRL 1.16's rule), then averaged per logging window."""
        from accelerate.utils import gather_object

        names = sorted(set(gather_object(list(metrics))))  # every process records the same names, in order
        for name in names:
            values = metrics.get(name, [])
            local = torch.tensor([sum(values), len(values)], dtype=torch.float64, device=self.accelerator.device)
            total, count = self.accelerator.gather(local).view(-1, 2).sum(0).tolist()
            self.record({name: total / count})

    def _record_rollout(self, rewards: Tensor, completion_mask: Tensor, finished: Tensor, advantages: Tensor) -> None:
        metrics = reward_metrics(rewards.cpu(), [f.name for f in self.reward_funcs], self.group_size, self.reward_weights)
        lengths = self.accelerator.gather(completion_mask.sum(-1).float())
        done = self.accelerator.gather(finished.float())
        metrics.update({
            "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": 1 - done.mean().item(),
            "advantages/std": advantages.float().std().item() if advantages.numel() > 1 else 0.0,
        })
        if self.model.training:
            self._tokens_seen = getattr(self, "_tokens_seen", 0) + int(lengths.sum().item())
            metrics["num_tokens"] = self._tokens_seen
        self.record(metrics)

    def _pad_id(self) -> int:
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def pack(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int, device,
         multiple: int | None = None) -> dict:
    """Left-padded prompts then right-padded completions: ``input_ids`` [N, P + C] and masks.

    ``completion_mask`` [N, C] marks the sampled tokens; ``prompt_length`` is P, where completions
    start. With ``multiple`` (``pad_to_multiple_of``) P and C are rounded up to multiples of it.
    """
    n = len(prompt_ids)
    width = padded_width(max(len(ids) for ids in prompt_ids), multiple)
    length = padded_width(max(1, max(len(ids) for ids in completion_ids)), multiple)
    input_ids = torch.full((n, width + length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width + length), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, width - len(prompt):width] = torch.tensor(prompt)
        attention[i, width - len(prompt):width + len(completion)] = 1
        if completion:
            input_ids[i, width:width + len(completion)] = torch.tensor(completion)
    return {"input_ids": input_ids.to(device), "attention_mask": attention.to(device),
            "completion_mask": attention[:, width:].to(device), "prompt_length": width}


def packed_token_logprobs(token_logprobs, model, input_ids: Tensor, attention_mask: Tensor,
                          select: Tensor | None = None, share_prompts: bool = False, **kwargs):
    """``token_logprobs(model, ...)`` of padded rows ``[B, T]`` computed padding-free: the rows' real
    tokens (``attention_mask``, wherever the padding sits) back to back in one row ``[1, N]`` with
    ``position_ids`` restarting at 0 for each, every statistic put back at its place in ``[B, T]``
    (0 at padding). Equal to the padded forward for models whose positions are relative (RoPE):
    there a left-padded row's offset positions change nothing but rounding.

    ``share_prompts`` (with ``select``): rows whose tokens before the first selected column are the
    same (a group's completions of one prompt) compute that prompt once
    (:func:`plait.engine.attention.prompt_shared_layout`, for a model whose attention reads a branch): the
    statistics of the selected tokens are the same."""
    keep = attention_mask.bool()
    if share_prompts and select is not None:
        unselected = keep & (select.to(keep.device).long().cumsum(1) == 0)  # real tokens before the first selected column
        rows = [[t for t, real in zip(ids, reals) if real] for ids, reals in zip(input_ids.tolist(), keep.tolist())]
        flat, positions, index = prompt_shared_layout(rows, unselected.sum(1).tolist())
        flat, positions = (torch.tensor([values], device=input_ids.device) for values in (flat, positions))
        places = torch.tensor([i for row in index for i in row], device=input_ids.device)
    else:
        lengths = keep.sum(-1)
        starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        positions = (torch.arange(int(lengths.sum()), device=input_ids.device) - starts)[None]
        flat, places = input_ids[keep][None], torch.arange(int(lengths.sum()), device=input_ids.device)
    flat_select = None
    if select is not None:  # each selected token's place in the packed row
        flat_select = torch.zeros_like(flat, dtype=torch.bool)
        flat_select[0, places[select.to(keep.device)[keep]]] = True
    out = token_logprobs(model, flat, position_ids=positions, select=flat_select, **kwargs)

    def in_rows(value: Tensor) -> Tensor:
        layout = keep.reshape(*keep.shape, *[1] * (value.dim() - 2))
        return value.new_zeros((*keep.shape, *value.shape[2:])).masked_scatter(layout, value[0][places])

    return attrs.evolve(out, **{name: in_rows(value) for name, value in attrs.asdict(out, recurse=False).items()
                                if value is not None})


def _pad_floats(rows: list[list[float]], width: int, device) -> Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)


def split_rows(buffer: dict, parts: int, generator: torch.Generator, multiple: int | None = None) -> list[dict]:
    """Shuffle a rollout's rows and cut them into ``parts`` micro-batches, trimming the completion
    columns that are padding in every row of a micro-batch (to a multiple of ``multiple`` when set).

    Tensors of width P + C (``input_ids``, ``attention_mask``) and of width C (completion-aligned:
    masks, log-probs, weights) are trimmed alike; tensors that are not per-row (0-dim normalisers) are shared.
    """
    n = buffer["input_ids"].shape[0]
    if n % parts:
        raise PlaitError(f"a rollout of {n} rows does not split into {parts} micro-batches")
    full, prompt = buffer["input_ids"].shape[1], buffer["prompt_length"]
    order = torch.randperm(n, generator=generator).to(buffer["input_ids"].device)
    chunks = []
    for rows in order.chunk(parts):
        used = int(buffer["attention_mask"][rows].sum(0).nonzero().max()) + 1 - prompt
        keep = prompt + min(padded_width(max(used, 1), multiple), full - prompt)
        chunk = {}
        for key, value in buffer.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n:
                value = value[rows]
                if value.dim() > 1 and value.shape[1] == full:
                    value = value[:, :keep]
                elif value.dim() > 1 and value.shape[1] == full - prompt:
                    value = value[:, :keep - prompt]
            elif isinstance(value, vision.RowInputs):
                value = value.select(rows)
            chunk[key] = value
        chunks.append(chunk)
    return chunks


def _table_value(value: Any) -> Any:
    """A number of the completions table as a float; anything else (a column a reward logged) as it is."""
    if torch.is_tensor(value) or (isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)):
        return float(value)
    return value


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if is_conversational(prompt):
        return "\n".join(f"{m['role']}: {text_of(m.get('content'), '[image]')}" for m in prompt)
    return str(prompt)


def format_table(rows: list[dict]) -> str:
    columns = list(rows[0])

    def cell(value: Any) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        text = text.replace("\n", "⏎")
        return text if len(text) <= 60 else text[:57] + "..."

    cells = [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = " | ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line, rule, *(" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells)])

