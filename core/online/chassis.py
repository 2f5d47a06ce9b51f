"""The one chassis of methods that learn from their own samples, and the GRPO family's trainer on it.

:class:`RolloutTrainer` is what every online method stands on (GRPO, RLOO, online DPO, async GRPO,
PPO, distillation, GKD): prompts as data (the method names the collator that batches them), the
grouped sampler and loader, the rollout buffer served ``passes`` times over (:mod:`plait.online.buffer`),
its resume state, the prediction step, the generation backend (resolved, started, sent the policy's
weights when it holds its own, put to sleep while the policy trains), packing with the pad id, and
the completions table. One rollout is four named steps a method overrides one at a time:

1. :meth:`~RolloutTrainer.sample` draws completions through the backend and packs them into a :class:`Draft`,
2. :meth:`~RolloutTrainer.score` scores them (reward functions, a judge; nothing for distillation,
   whose teacher grades every token in the loss),
3. :meth:`~RolloutTrainer.estimate` turns scores into what the loss learns from (group advantages,
   PPO's values and GAE, a pair's order, a normaliser),
4. :meth:`~RolloutTrainer.record_rollout` logs the rollout and returns the buffer's tensors.

A method says what differs through hooks: :meth:`~RolloutTrainer.rollout_plan` (the group size, the
micro-steps and passes of a rollout), :meth:`~RolloutTrainer.sampling_params` and
:meth:`~RolloutTrainer.policy_module` (the module sampled from when the trained module wraps it, as
PPO's policy + value model); a value model or a teacher are the method's own modules.

:class:`OnlineTrainer` is the GRPO family's (GRPO, RLOO, async GRPO, online DPO): ``num_generations``
completions per prompt from the backend or an agent's episodes; scored by reward functions
(:mod:`plait.online.scoring`) gathered over every process; estimated with the sampling policy's
log-probs when the buffer outlives one optimizer step (``num_iterations`` > 1 or more micro-batches than
one accumulation window), the reference's when the method needs them (beta > 0), importance weights
and a registered advantage estimator; recorded as :class:`plait.engine.batches.PolicyTokens` rows for
the method's composed losses, served ``num_iterations`` times in ``steps_per_generation`` micro-batches.

Nothing here names a concrete loss, reward, estimator, collator or backend.
"""

from __future__ import annotations

import copy
import functools
import logging
import numbers
from typing import Any, ClassVar

import attrs
import torch
from torch import Tensor

from plait.data import vision
from plait.data.chat import is_conversational, text_of
from plait.data.prepare import is_stream
from plait.engine.attention import prompt_shared_layout
from plait.engine.batches import PolicyTokens, Rollout, gather_ragged, masked_mean
from plait.engine.layout import check_multiple, pad_token_id
from plait.engine.models import Reference, ReferenceSync, SyncReference
from plait.engine.objective import LossChoice, Objective
from plait.engine.trainer import PlaitTrainer
from plait.errors import PlaitError
from plait.params import int_at_least, non_negative, one_of, positive

from .buffer import (
    GenerationSizes,
    GroupSampler,
    RolloutBuffer,
    completion_columns,
    generation_sizes,
    pack,
    pad_floats,
    split_rows,
    whole_groups,
)
from .filtering import (PromptHistory, PromptStream, RolloutFilterChoice, RolloutGroup, joined, joined_prompt_batches,
                        resolve_rollout_filters, rows_of)
from .generation import TRL_VLLM_MODES, GenerationChoice, Generations, SamplingParams, resolve_backend
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
    total_reward,
    turn_reward_metrics,
)

logger = logging.getLogger("plait")

IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
def _optional(validator):
    return attrs.validators.optional(validator)


@attrs.define
class RolloutParams(GenerationChoice, LossChoice):
    """Sampling and data knobs of every method that learns from its own samples (:class:`RolloutTrainer`'s),
    and their losses; names follow TRL's configs. How completions are sampled and logged is
    :class:`plait.online.generation.GenerationChoice`; :class:`OnlineParams` adds the GRPO family's.

    Subclasses add ``temperature`` and the completion length under their own default, and name
    their ``default_loss``.
    """

    field_help: ClassVar[dict[str, str]] = {
        "max_prompt_length": "prompts longer than this many tokens are dropped when the data is prepared (null: none)",
        "shuffle_dataset": "draw the prompts in a new random order each pass over the dataset (seeded by seed)",
        "model_init_kwargs": "keyword arguments for the policy's from_pretrained (dtype, attn_implementation, ...)",
        "dataset_num_proc": "worker processes that tokenise the dataset (null: the main process only)",
    }

    max_prompt_length: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    shuffle_dataset: bool = True
    model_init_kwargs: dict | None = None
    dataset_num_proc: int | None = None


@attrs.define
class OnlineParams(ReferenceSync, AgentChoice, RolloutParams, RewardChoice, RolloutFilterChoice):
    """Knobs every online method shares, its losses included; names and defaults follow TRL's GRPOConfig.
    How completions are sampled and logged is :class:`plait.online.generation.GenerationChoice`; tools,
    environments and rollout functions (multi-turn episodes) are :class:`plait.online.rollouts.AgentChoice`;
    dynamic sampling (rollout filters, refilled batches) is :class:`plait.online.filtering.RolloutFilterChoice`.

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

    field_help: ClassVar[dict[str, str]] = {
        "num_generations": "completions sampled per prompt: the group its advantages are computed in (at least 2)",
        "num_generations_eval": "completions per prompt in evaluation (null: num_generations)",
        "generation_batch_size": "completions sampled at once over all processes (null: from steps_per_generation)",
        "steps_per_generation": "micro-batches each generation batch is cut into (null: gradient_accumulation_steps)",
        "max_completion_length": "most tokens sampled per completion",
        "temperature": "sampling temperature (1.0: the policy's own distribution)",
        "vllm_importance_sampling_correction": "weight the loss by pi_old/pi_sampler where a backend reports log-probs",
        "vllm_importance_sampling_mode": "that ratio per 'token' or 'sequence', truncated or masked outside its bounds",
        "vllm_importance_sampling_clip_max": "upper bound of the sampler importance ratio (null: unbounded above)",
        "vllm_importance_sampling_clip_min": "lower bound of the sampler importance ratio (null: unbounded below)",
        "vllm_importance_sampling_cap": "deprecated name of vllm_importance_sampling_clip_max; wins when given",
        "num_iterations": "optimisation passes over each generation batch before sampling again",
        "epsilon": "clip range: the policy ratio is clipped to [1 - epsilon, 1 + epsilon_high]",
        "epsilon_high": "upper clip range (DAPO's clip-higher; null: epsilon)",
        "delta": "cap on the unclipped ratio term (two-sided clipping; null: no cap)",
        "beta": "weight of the KL penalty to the reference model (0: no reference is loaded)",
        "mask_truncated_completions": "leave completions that never reached EOS out of the loss",
        "padding_free": "log-probs over rows packed back to back, no padding (null: where the attention allows)",
        "prefix_sharing": "compute each prompt once for all its completions in a micro-batch (null: where possible)",
    }

    # generation
    num_generations: int = attrs.field(default=8, validator=int_at_least(2))
    num_generations_eval: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    generation_batch_size: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    steps_per_generation: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
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
    # models and data
    padding_free: bool | None = None
    prefix_sharing: bool | None = None

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


def prompt_ids_of(inputs: dict) -> list[list[int]]:
    """The token ids of each prompt of a collated (left-padded) prompt batch."""
    return [row[mask.bool()].tolist() for row, mask in zip(inputs["input_ids"], inputs["attention_mask"])]


def prompt_columns(inputs: dict) -> dict:
    """The dataset's other columns of a prompt batch: what reward functions and judges may read."""
    return {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "prompt", vision.KEY)}


@attrs.define(slots=False)  # not slotted: a method's steps hand each other their own values as attributes
class Draft:
    """One rollout as its steps build it: :meth:`RolloutTrainer.sample` fills the prompts, the
    generations and their packed rows (``batch``); :meth:`~RolloutTrainer.score` adds ``rewards``
    (this process's, ``[N, K]``); :meth:`~RolloutTrainer.estimate` what the loss learns from."""

    inputs: dict
    prompt_ids: list[list[int]]
    generations: Generations
    batch: dict
    finished: Tensor
    columns: dict = attrs.field(default=attrs.Factory(lambda self: prompt_columns(self.inputs), takes_self=True))
    rewards: Tensor | None = None

    @property
    def prompts(self) -> list:
        return self.inputs["prompt"]

    @property
    def completions(self) -> list:
        """The completions in the prompts' form (text, or an assistant message); an episode's messages."""
        if getattr(self.generations, "messages", None) is not None:
            return self.generations.messages
        return [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                for t, p in zip(self.generations.texts, self.prompts)]


def grouped_stream(dataset, group_size: int, prompts_per_batch: int, repeat: int = 1):
    """A stream's rows in :class:`~plait.online.buffer.GroupSampler`'s order: ``prompts_per_batch`` rows at a
    time, each ``group_size`` times in a row, the batch ``repeat`` times; a last partial batch is dropped.
    Lazy (``IterableDataset.map``), so accelerate shards the result per process as it shards any stream."""

    def grouped(batch: dict) -> dict:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        # copies, as a map-style dataset reads a fresh row per index: a rollout may change its rows in place
        ordered = [copy.deepcopy(row) for _ in range(repeat) for row in rows for _ in range(group_size)]
        return {column: [row[column] for row in ordered] for column in batch}

    return dataset.map(grouped, batched=True, batch_size=prompts_per_batch, drop_last_batch=True)


class RolloutTrainer(PlaitTrainer):
    """Base of every trainer that learns from its own samples (see the module docstring).

    A method sets ``prompt_collator`` (the registered collator batching its prompts), implements
    :meth:`rollout_plan`, :meth:`sampling_params` and ``compute_loss``, and overrides the steps of
    :meth:`rollout` it does differently.
    """

    gives_eval_predictions = False  # no logits and labels for compute_metrics: evaluation samples and scores
    keeps_eval_dataset_as_given = True  # trainer.eval_dataset is the user's prompts, as TRL's online trainers keep it
    prompt_collator: ClassVar[str]  # e.g. "collator.prompt_only", named by the method's module

    def train(self, *args, **kwargs):
        """transformers' training loop; a run whose rewards never scored a completion then fails (see
        :meth:`plait.online.scoring.UnscoredBatches.finish`) instead of saving a model that learned nothing."""
        result = super().train(*args, **kwargs)
        unscored = vars(self).get("unscored")
        if unscored is not None:
            unscored.finish()
        return result

    def release_process_group(self) -> None:
        """The generation backend closes first, at interpreter exit: an in-process vLLM engine made the
        process group itself and holds groups of its own, which its shutdown leaves while they still
        work (left to vLLM's own exit hook, that found the group gone and printed a traceback after
        every colocated run)."""
        backend = vars(self).get("backend")
        if backend is not None:
            try:
                backend.close()
            except Exception as err:  # noqa: BLE001 - the run is over; leaving the group matters more
                logger.warning("closing the generation backend at exit failed: %s", err)
        super().release_process_group()

    # -- what a method says ---------------------------------------------------------------------
    def rollout_plan(self, args) -> GenerationSizes:
        """How a rollout divides: completions per prompt, micro-batches and passes over it."""
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        raise NotImplementedError

    def policy_module(self):
        """The module the backend samples with (PPO trains a wrapper of policy and value model)."""
        return self._policy

    @property
    def group_size(self) -> int:
        """Completions per prompt in the rollout being built."""
        return self.sizes.num_generations

    # -- the data: prompts (the ``prompt_only`` task, cut to ``max_prompt_length``) -------------
    def prepare(self, dataset, processing_class, args, split):
        if dataset is None:
            return None
        from plait.data.prepare import prepare_dataset

        p = args.params
        return prepare_dataset(dataset, processing_class, "prompt_only", plugins=self.plugins,
                               max_length=p.max_prompt_length, num_proc=p.dataset_num_proc,
                               chat_template_kwargs=p.chat_template_kwargs)

    def make_collator(self, processing_class, args):
        return self.collator(self.prompt_collator, processing_class)

    # -- construction -------------------------------------------------------------------------
    def validate(self, args) -> None:
        if args.auto_find_batch_size:  # transformers halves the batch on out-of-memory and retries
            raise PlaitError("auto_find_batch_size=True: halving the batch after an out-of-memory error would split "
                             "the groups of completions each rollout is made of (TRL refuses it too); set "
                             "auto_find_batch_size=False and lower per_device_train_batch_size (with "
                             "gradient_accumulation_steps to keep the batch)")
        self.sizes = self.rollout_plan(args)
        self.backend_component = resolve_backend(self.plugins, args)  # unknown names and options fail now
        # TRL's attribute: is the sampler one of the vLLM backends its use_vllm/vllm_mode name?
        self.use_vllm = self.backend_component.name.split(".", 1)[-1] in TRL_VLLM_MODES.values()

    @property
    def generation_config(self):
        """TRL's attribute: the transformers ``GenerationConfig`` the run samples with (the sampling params as
        the backend reads them), or None for a backend that samples without one (vLLM)."""
        own = getattr(self.backend, "generation_config", None)
        return own(self.sampling_params()) if callable(own) else None

    def after_init(self) -> None:
        self.backend = self.backend_component.obj(self.policy_module(), self.processing_class, self.args)
        self.backend.start()
        self._synced_step = -1
        self.padding_multiple = check_multiple(self.args.params.pad_to_multiple_of, self.accelerator.device.type)
        self.buffer = RolloutBuffer(self.sizes.steps_per_generation, self.sizes.passes, self.split_rollout,
                                    self.args.seed)

    def split_rollout(self, rollout: dict, parts: int, generator: torch.Generator) -> list[dict]:
        """One pass's micro-batches of a rollout: its rows shuffled and cut (:func:`plait.online.buffer.split_rows`)."""
        return split_rows(rollout, parts, generator, self.padding_multiple)

    # -- data loading -------------------------------------------------------------------------
    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise PlaitError(f"{type(self).__name__}.train() needs a train_dataset of prompts")
        # One loader batch is one process's whole rollout; it is re-served for every micro-step.
        dataset = self.train_dataset
        if is_stream(dataset):  # a stream takes no sampler: it is reordered as GroupSampler orders indices
            if self.args.params.shuffle_dataset:  # a buffered shuffle, the stream's stand-in for a permutation
                dataset = dataset.shuffle(seed=self.args.seed)
            sizes = self.sizes
            dataset = grouped_stream(dataset, sizes.num_generations, sizes.prompts,
                                     repeat=sizes.steps_per_generation * sizes.passes)
        return self._get_dataloader(dataset, "Training", self.sizes.local, self._get_train_sampler, is_training=True)

    def refuse_on_stream(self, args) -> str | None:
        if args.dataloader_num_workers:  # workers would each read part of the stream and split its groups
            logger.warning("dataloader_num_workers=%d with a streamed train_dataset: reading it in one process (0) "
                           "keeps each prompt's completions in one group", args.dataloader_num_workers)
            args.dataloader_num_workers = 0
        return super().refuse_on_stream(args)

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sizes = self.sizes
        return GroupSampler(len(dataset), sizes.num_generations, sizes.prompts,
                            repeat=sizes.steps_per_generation * sizes.passes,
                            shuffle=self.args.params.shuffle_dataset, seed=self.args.seed)

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

    # -- one rollout: sample, score, estimate, record -------------------------------------------
    @torch.no_grad()
    def rollout(self, inputs: dict) -> dict:
        """One rollout of a collated prompt batch, as the buffer's tensors (rows first)."""
        draft = self.sample(inputs)
        self.score(draft)
        draft = self.filter_groups(draft)
        self.estimate(draft)
        return self.record_rollout(draft)

    def sample(self, inputs: dict) -> Draft:
        """``group_size`` completions of each prompt group, packed."""
        prompt_ids = prompt_ids_of(inputs)
        return self.sampled(inputs, prompt_ids, self.generate(prompt_ids, self.group_size, inputs.get(vision.KEY)))

    def sampled(self, inputs: dict, prompt_ids: list[list[int]], generations: Generations) -> Draft:
        """The draft of completions sampled (by the backend, a worker, a teacher or a dataset) for these prompts."""
        batch = self.pack_rollout(prompt_ids, generations.completion_ids)
        return Draft(inputs, prompt_ids, generations, batch, torch.tensor(generations.finished, device=self.accelerator.device))

    def score(self, draft: Draft) -> None:
        """Score the completions (``draft.rewards``); none by default: a teacher grades them in the loss."""

    def filter_groups(self, draft: Draft) -> Draft:
        """The scored draft the rollout keeps (dynamic sampling, :mod:`plait.online.filtering`); by default all of it."""
        return draft

    def estimate(self, draft: Draft) -> None:
        """What the loss learns from the scores (advantages, values, a normaliser)."""

    def record_rollout(self, draft: Draft) -> dict:
        """Log the rollout and return the buffer's tensors: by default the packed rows."""
        return draft.batch

    # -- what the steps share ------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], g: int, images: vision.RowInputs | None = None) -> Generations:
        """Sample one completion per row. Rows come as whole groups when the process's share of the
        rollout holds whole groups; then each prompt is sent once with n = g."""
        backend = self.backend
        if not backend.shares_weights and self._synced_step != self.state.global_step:
            backend.load_weights(self.accelerator.unwrap_model(self.policy_module()))
            self._synced_step = self.state.global_step
        sampling = self.sampling_params()
        grouped = whole_groups(prompt_ids, g)
        with_images = {} if images is None else {"images": images.select(slice(None, None, g) if grouped else slice(None))}
        if grouped:
            out = backend.generate(prompt_ids[::g], attrs.evolve(sampling, num_generations=g), **with_images)
        else:
            out = backend.generate(prompt_ids, sampling, **with_images)
        backend.sleep()  # the policy trains now: an engine may release its memory (it wakes to generate)
        return out

    def pack_rollout(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> dict:
        """:func:`plait.online.buffer.pack` on this trainer's device, padded to ``pad_to_multiple_of``."""
        return pack(prompt_ids, completion_ids, pad_token_id(self.processing_class), self.accelerator.device,
                    self.padding_multiple)

    def reward_scores(self, draft: Draft, logs: RewardLogs | None = None) -> Tensor:
        """Score a draft with ``self.reward_funcs`` (``draft.rewards``, ``[N, K]``) and return every
        process's scores; in training a run of unscored batches is an error."""
        p = self.args.params
        draft.rewards = compute_rewards(self.reward_funcs, prompts=draft.prompts, completions=draft.completions,
                                        completion_ids=draft.generations.completion_ids, columns=draft.columns,
                                        trainer_state=self.state, on_error=p.reward_error_policy,
                                        timeout=p.reward_timeout, logs=logs).to(self.accelerator.device)
        everyone = self.accelerator.gather(draft.rewards)
        if self.model.training:
            self.unscored.check(everyone)
        return everyone

    def record_lengths(self, completion_mask: Tensor, finished: Tensor) -> Tensor:
        """Record the completion lengths over every process, and the share that ran out of tokens;
        return every process's lengths."""
        lengths = self.accelerator.gather(completion_mask.sum(-1).float())
        done = self.accelerator.gather(finished.float())
        self.record({"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                     "completions/max_length": lengths.max(), "completions/clipped_ratio": 1 - done.mean()})
        return lengths

    # -- the completions table (``log_completions``) ---------------------------------------------
    # The rows of the latest rollout (step, prompt, completion, per-row numbers such as rewards) are
    # printed at the next log, ``num_completions_to_print`` of them, and all are sent to wandb when
    # ``report_to`` includes it; ``log_unique_prompts`` keeps one row per prompt.
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


class OnlineTrainer(RolloutTrainer):
    """Base of the GRPO family's trainers. Subclasses set ``method``, ``config_class``, ``loss_family``,
    ``shared_loss_fields`` and ``prompt_collator``, give their params an ``advantage_spec()``, and
    implement :meth:`advantages`."""

    loss_family: ClassVar[str]
    shared_loss_fields: ClassVar[tuple[str, ...]] = ()  # params every loss that takes them receives
    # The constructor's reward arguments, read by validate(). Class defaults, because validate()
    # also runs on a trainer whose __init__ never ran (`plait <method> --check`: a recipe gives its
    # rewards as the config's reward_funcs).
    _reward_specs = None
    _reward_processing_classes = None
    _agent_args: dict = {}  # tools, environment_factory, rollout_func given to the constructor
    agent: Agent | None = None  # multi-turn episodes (plait.online.rollouts), when the run has tools or an environment
    _images = False  # does the training data hold images (a VLM's prompts)?
    _streamed = False  # is the training data a stream (rollout_filters refill prompts by index: refused)?
    takes_images = True  # generation and every forward get the prompts' images (plait.data.vision)

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, plugins=None, tools=None, rollout_func=None,
                 environment_factory=None):
        self._reward_specs = reward_funcs
        self._reward_processing_classes = reward_processing_classes
        self._agent_args = {"tools": tools, "rollout_func": rollout_func, "environment_factory": environment_factory}
        self._images = vision.holds_images(train_dataset)
        self._streamed = is_stream(train_dataset)  # rollout_filters are refused on a stream
        super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, peft_config=peft_config, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config, plugins=plugins)

    # -- construction -------------------------------------------------------------------------
    def rollout_plan(self, args) -> GenerationSizes:
        return generation_sizes(args)

    def sampling_params(self) -> SamplingParams:
        return self.args.params.sampling()

    def validate(self, args) -> None:
        p = args.params
        if args.remove_unused_columns:
            raise PlaitError("remove_unused_columns=True would drop the prompt and the columns reward functions read; "
                             "set remove_unused_columns=False (the default of online methods)")
        super().validate(args)
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
        if self._images and not self.backend_component.options.images:
            raise PlaitError(f"the prompts hold images but {self.backend_component.name} cannot pass images to the model; "
                             "set use_vllm=False to sample with generation.transformers")
        self.reward_funcs = ((self._resolve_rewards(entries) if entries else [])
                             + ([self.agent.reward_function()] if owned else []))
        weights = p.reward_weights if p.reward_weights is None or not owned else [*p.reward_weights, 1.0]
        self.reward_weights = reward_weights(self.reward_funcs, weights)
        self.rollout_filters = resolve_rollout_filters(p.rollout_filters, self.plugins)
        if self.rollout_filters:
            self.check_refillable()
        elif p.skip_dropped_prompts is not None:
            raise PlaitError(f"skip_dropped_prompts={p.skip_dropped_prompts} skips prompts the rollout_filters kept "
                             "dropping, but no rollout_filters are set; add rollout_filters: [zero_variance] or drop it")

    def check_refillable(self) -> None:
        """Dynamic sampling refills a batch with this chassis's own sampling and scoring, group by group."""
        # a chassis with its own sample step may still say how it samples a refill round (sample_refill)
        steps = ("score",) if type(self).sample_refill is not OnlineTrainer.sample_refill else ("sample", "score")
        own = [step for step in steps if getattr(type(self), step) is not getattr(OnlineTrainer, step)]
        if own:
            raise PlaitError(f"rollout_filters: {type(self).__name__} has its own {' and '.join(own)} step, so dropped "
                             "groups cannot be refilled; drop rollout_filters or use GRPOTrainer or RLOOTrainer")
        if self.sizes.local % self.sizes.num_generations:
            raise PlaitError(f"rollout_filters: each process samples {self.sizes.local} completions, not whole groups of "
                             f"num_generations={self.sizes.num_generations}; make per_device_train_batch_size × "
                             "steps_per_generation a multiple of num_generations")
        if self._images:
            raise PlaitError("rollout_filters: refilling batches of prompts with images is not supported; drop "
                             "rollout_filters for this dataset")
        if self._streamed:
            raise PlaitError("rollout_filters refill batches from the train_dataset by index, which a stream has "
                             "not; drop rollout_filters or load the dataset whole (streaming: false)")

    @property
    def reward_processing_classes(self) -> list:
        """TRL's attribute: one entry per reward function, the tokenizer a reward model scores with, None for
        a function of the text."""
        return [getattr(func.fn, "processing_class", None) for func in self.reward_funcs]

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
                               shared=shared, field=p.loss_field, metrics=self.policy_metrics)

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
        self.reference.prepare(self.accelerator, synced=p.sync_ref_model)
        if p.sync_ref_model:
            self.add_callback(SyncReference(self.reference))
        super().after_init()
        self.unscored = UnscoredBatches([f.name for f in self.reward_funcs], p.max_unscored_batches)
        self.prompt_stream, self.prompt_history, self._generated_tokens = None, None, 0
        if self.rollout_filters and self.train_dataset is not None:
            self.prompt_stream = PromptStream(len(self.train_dataset), p.shuffle_dataset, self.args.seed)
            if p.skip_dropped_prompts is not None:
                self.prompt_history = PromptHistory(p.skip_dropped_prompts, self.args.seed)

    # -- data loading -------------------------------------------------------------------------
    def _get_eval_sampler(self, eval_dataset):
        g = self.args.params.generations_per_prompt(training=False)
        prompts = self.args.per_device_eval_batch_size * self.args.world_size // g
        return GroupSampler(len(eval_dataset) // prompts * prompts, g, prompts, shuffle=False)

    @property
    def group_size(self) -> int:
        """Completions per prompt in the rollout being built (evaluation may use fewer)."""
        return self.args.params.generations_per_prompt(training=self.model.training)

    def resume_state(self) -> dict:
        state = {**super().resume_state(), "num_tokens": getattr(self, "_tokens_seen", 0)}
        if getattr(self, "prompt_stream", None) is not None:  # where refills stand in the prompts
            state["rollout_filters"] = {"stream": self.prompt_stream.state_dict(), "generated": self._generated_tokens}
            if self.prompt_history is not None:
                state["rollout_filters"]["history"] = self.prompt_history.state_dict()
        return state

    def load_resume_state(self, state: dict) -> None:
        super().load_resume_state(state)
        self._tokens_seen = state["num_tokens"]
        if getattr(self, "prompt_stream", None) is not None and "rollout_filters" in state:
            self.prompt_stream.load_state_dict(state["rollout_filters"]["stream"])
            self._generated_tokens = state["rollout_filters"]["generated"]
            if self.prompt_history is not None:
                self.prompt_history.load_state_dict(state["rollout_filters"]["history"])

    def needs_old_logps(self) -> bool:
        """Does the policy change while the buffer is in use? (then ratios need π_old)."""
        uses = self.sizes.steps_per_generation * self.args.params.num_iterations
        return self.args.gradient_accumulation_steps % uses != 0

    # -- one rollout --------------------------------------------------------------------------
    def sample(self, inputs: dict) -> Draft:
        """A group's completions from the backend, or with tools, an environment or a rollout_func
        multi-turn episodes (:mod:`plait.online.rollouts`). With ``skip_dropped_prompts`` a training batch
        first swaps the prompts the filters kept dropping for others (:meth:`chosen_prompts`)."""
        if self.prompt_history is not None and self.model.training:
            inputs = self.chosen_prompts(inputs)
        if self.agent is None:
            return super().sample(inputs)
        columns = prompt_columns(inputs)
        generations = self.agent.run(self, inputs["prompt"], columns, self.group_size)
        draft = self.sampled(inputs, generations.prompt_ids, generations)
        draft.columns = {**columns, **self.agent.columns(generations)}
        return draft

    def sampled(self, inputs: dict, prompt_ids: list[list[int]], generations: Generations) -> Draft:
        """The packed rows with the prompts' images, an episode's tool mask, and ``loss_mask``: the
        completion mask, without truncated completions under ``mask_truncated_completions``."""
        draft = super().sampled(inputs, prompt_ids, generations)
        images = inputs.get(vision.KEY)  # a VLM's per-row image inputs (plait.data.vision), aligned with the rows
        if images is not None:
            draft.batch[vision.KEY] = images
        if self.agent is not None:  # inserted tokens leave the completion mask for the tool mask
            Agent.masks(draft.batch, generations)
            Agent.turns(draft.batch, generations)  # each token's model turn and each turn's reward
        mask = draft.batch["completion_mask"]
        draft.loss_mask = mask * draft.finished.unsqueeze(-1) if self.args.params.mask_truncated_completions else mask
        return draft

    def score(self, draft: Draft) -> None:
        """Every completion's rewards; every process's (``draft.everyone``) for group statistics."""
        logs = RewardLogs()  # what the reward functions log (log_extra, log_metric)
        everyone = self.reward_scores(draft, logs)
        self._record_logged_metrics(logs.metrics)
        draft.everyone, draft.reward_logs = everyone, logs

    # -- dynamic sampling (plait.online.filtering) ---------------------------------------------
    rollout_filters: list = []
    prompt_history: PromptHistory | None = None  # skip_dropped_prompts's record of the filters' verdicts
    SKIP_DRAWS = 4  # draws from the refill stream for prompts to sample in skipped ones' place
    _skipped_prompts = 0  # prompts this process's history held back in the rollout being built

    def filter_groups(self, draft: Draft) -> Draft:
        """DAPO's dynamic sampling (Yu et al. 2025, §3.2): groups a filter drops are replaced by groups of further
        prompts, sampled and scored, up to ``max_num_gen_batches`` rounds; then the latest dropped groups fill
        what is missing. Every process runs the same number of rounds (generation and scoring gather)."""
        if not self.rollout_filters or not self.model.training:
            return draft
        p, g, device = self.args.params, self.group_size, self.accelerator.device
        wanted = len(draft.prompt_ids) // g
        kept: list[tuple[Draft, int]] = []
        dropped: list[tuple[Draft, int]] = []
        by_filter = dict.fromkeys((f.name for f in self.rollout_filters), 0)
        rounds = tokens = 0
        while True:
            rounds += 1
            tokens += sum(len(ids) for ids in draft.generations.completion_ids)
            was_dropped = []
            for index, group in enumerate(self.groups_of(draft)):
                dropper = next((f for f in self.rollout_filters if not f.keeps(group)), None)
                was_dropped.append(dropper is not None)
                if dropper is None:
                    kept.append((draft, index))
                else:
                    dropped.append((draft, index))
                    by_filter[dropper.name] += 1
            self.remember_verdicts(draft, was_dropped)
            short = int(self.accelerator.gather(torch.tensor([wanted - len(kept)], device=device)).max())
            if short <= 0 or rounds >= p.max_num_gen_batches:
                break
            draft = self.sample_refill(self.refill_inputs(wanted))
            self.score(draft)
        padding = max(wanted - len(kept), 0)
        local = torch.tensor([len(dropped), padding, tokens, self._skipped_prompts, *by_filter.values()], device=device,
                             dtype=torch.float64)
        totals = self.accelerator.gather(local).view(self.accelerator.num_processes, -1).sum(0).tolist()
        self._generated_tokens += int(totals[2])
        self._skipped_prompts = 0
        self.record({"rollout_filter/rounds": rounds, "rollout_filter/dropped_groups": totals[0],
                     "rollout_filter/padded_groups": totals[1], "rollout_filter/generated_tokens": self._generated_tokens,
                     "rollout_filter/prompts": rounds * wanted * self.accelerator.num_processes,
                     **({"rollout_filter/skipped_prompts": totals[3]} if self.prompt_history is not None else {}),
                     **{f"rollout_filter/dropped/{name}": n for name, n in zip(by_filter, totals[4:])}})
        if rounds == 1 and len(kept) == wanted:
            return draft
        return self.joined_draft(kept[:wanted] + (dropped[len(dropped) - padding:] if padding else []))

    def sample_refill(self, inputs: dict) -> Draft:
        """A refill round's groups: sampled as any batch is (a chassis that samples ahead samples them now)."""
        return self.sample(inputs)

    def remember_verdicts(self, draft: Draft, dropped: list[bool]) -> None:
        """Every process's verdicts on its groups into the :class:`PromptHistory` (each process keeps the same one)."""
        if self.prompt_history is None:
            return
        keys = [PromptHistory.key(draft.prompt_ids[i * self.group_size]) for i in range(len(dropped))]
        local = torch.tensor([keys, dropped], dtype=torch.int64, device=self.accelerator.device).T
        for key, was_dropped in self.accelerator.gather(local).tolist():
            self.prompt_history.update(key, bool(was_dropped))

    def chosen_prompts(self, inputs: dict) -> dict:
        """GRESO's pre-rollout skip (Zheng et al. 2025, Alg. 1): each prompt group of ``inputs`` whose history says
        skip is replaced by the next prompt of the refill stream that the history lets through, in up to
        ``SKIP_DRAWS`` draws from the stream (every process takes the same draws); after them the skipped
        prompts themselves fill what is missing. Counts the prompts held back for ``rollout_filter/skipped_prompts``."""
        g, step, rank, stream = self.group_size, self.state.global_step, self.accelerator.process_index, self.prompt_stream

        def split(batch: dict) -> tuple[list[int], list[int]]:  # the first rows of the groups sampled, and skipped
            ids, where = prompt_ids_of(batch), (step, stream.epoch, stream.position, rank)
            sampled = {s: self.prompt_history.samples(PromptHistory.key(ids[s]), *where, s) for s in range(0, len(ids), g)}
            return [s for s, ok in sampled.items() if ok], [s for s, ok in sampled.items() if not ok]

        def rows(batch: dict, starts: list[int]) -> dict:
            return rows_of(batch, [s + j for s in starts for j in range(g)], len(batch["input_ids"]))

        kept, skipped = split(inputs)
        parts, missing, held_back = [rows(inputs, kept)] if kept else [], len(skipped), len(skipped)
        for _ in range(self.SKIP_DRAWS):
            need = int(self.accelerator.gather(torch.tensor([missing], device=self.accelerator.device)).max())
            if need == 0:
                break
            candidates = self.refill_inputs(need)  # every process takes its share of the stream, needed or not
            through, held = split(candidates)
            if missing:
                taken = through[:missing]
                held_back += sum(s < taken[-1] for s in held) if len(taken) == missing else len(held)
                if taken:
                    parts.append(rows(candidates, taken))
                missing -= len(taken)
        if missing:  # sampled after all
            parts.append(rows(inputs, skipped[:missing]))
        self._skipped_prompts += held_back - missing
        return joined_prompt_batches(parts, pad_token_id(self.processing_class)) if skipped else inputs

    def groups_of(self, draft: Draft) -> list[RolloutGroup]:
        """This process's scored groups of a draft (whole groups: :meth:`check_refillable`)."""
        g = self.group_size
        rewards = total_reward(self.gather_rollout(draft.rewards))
        scores = draft.rewards.float().cpu()
        lengths = torch.tensor([len(ids) for ids in draft.generations.completion_ids])
        truncated = ~draft.finished.bool().cpu()
        return [RolloutGroup(draft.prompts[s], rewards[s:s + g], scores[s:s + g], lengths[s:s + g], truncated[s:s + g])
                for s in range(0, len(draft.prompt_ids), g)]

    def refill_inputs(self, groups: int) -> dict:
        """The next ``groups`` prompts of this process from the refill stream, collated ``group_size`` times each."""
        rank, g = self.accelerator.process_index, self.group_size
        everyone = self.prompt_stream.take(groups * self.accelerator.num_processes)
        return self.data_collator([self.train_dataset[i] for i in everyone[rank * groups:(rank + 1) * groups]
                                   for _ in range(g)])

    def joined_draft(self, chosen: list[tuple[Draft, int]]) -> Draft:
        """One scored draft of the chosen groups (a draft and a group's index in it), repacked."""
        g = self.group_size
        parts = [(d, list(range(i * g, (i + 1) * g)), len(d.prompt_ids)) for d, i in chosen]

        def cut(values) -> Any:  # each part's rows of a per-row value, end to end
            return joined([rows_of(values(d), rows, n) for d, rows, n in parts])

        # the prompts' padded ids differ in width between rounds; prompt_ids hold them
        inputs = cut(lambda d: {k: v for k, v in d.inputs.items() if k not in ("input_ids", "attention_mask")})
        generations = type(chosen[0][0].generations)(**cut(lambda d: attrs.asdict(d.generations, recurse=False)))
        out = self.sampled(inputs, cut(lambda d: d.prompt_ids), generations)
        out.columns = cut(lambda d: d.columns)
        out.rewards = cut(lambda d: d.rewards)
        out.everyone = self.accelerator.gather(out.rewards)
        out.reward_logs = RewardLogs(extra=cut(lambda d: d.reward_logs.extra))
        return out

    def estimate(self, draft: Draft) -> None:
        """The sampling policy's and the reference's log-probs, importance weights against the sampler's
        own log-probs, advantages from every process's scores, and the loss normaliser."""
        p, device, batch = self.args.params, self.accelerator.device, draft.batch
        logprobs = draft.generations.logprobs  # the sampler's own log-probs (off-policy masking reads them too)
        with self.compute_loss_context_manager():
            old = self.policy_logps(batch) if (self.needs_old_logps() or logprobs is not None) else None
            ref = None
            if self.reference.available:
                ref = self.reference(self.model_wrapped, lambda m: self.logps_of(m, batch))
        completion_mask = batch["completion_mask"]
        weights = sampler = None
        if logprobs is not None:
            sampler = pad_floats(logprobs, completion_mask.shape[1], device)
        if sampler is not None and p.vllm_importance_sampling_correction:
            low, high = p.importance_sampling_bounds()
            weights = importance_weights(old, sampler, completion_mask, p.vllm_importance_sampling_mode, high, low)
            self.record(importance_sampling_metrics(old, sampler, completion_mask, p.vllm_importance_sampling_mode,
                                                    high, low))
        draft.old_logps, draft.ref_logps, draft.importance_weights, draft.sampling_logps = old, ref, weights, sampler
        draft.all_advantages = self.advantages(draft.everyone, batch=batch, old_logps=old, ref_logps=ref)
        n = len(draft.prompt_ids)
        start = self.accelerator.process_index * n
        draft.advantages = draft.all_advantages[start:start + n].to(device)
        if draft.advantages.dim() == 2:  # token-level: every process's rows were padded to the widest
            draft.advantages = draft.advantages[:, :completion_mask.shape[1]]
        tokens = self.accelerator.gather(draft.loss_mask.sum().reshape(1)).sum().float()
        per_step = tokens / self.accelerator.num_processes  # dapo's normaliser, per process ...
        if self.model.training:  # ... scaled to the share of the generation batch one optimizer step sees
            per_step = per_step * self.args.gradient_accumulation_steps / self.sizes.steps_per_generation
        draft.num_items = per_step

    def record_rollout(self, draft: Draft) -> dict:
        batch, n = draft.batch, len(draft.prompt_ids)
        advantages, per_row = draft.all_advantages, draft.advantages
        if advantages.dim() == 2:  # token-level: statistics over the counted tokens, one mean per row in the table
            advantages = gather_ragged(self.accelerator, draft.advantages[draft.loss_mask.bool()].float())
            per_row = masked_mean(draft.advantages, draft.loss_mask, dim=1)
        self._record_rollout(draft.everyone, batch["completion_mask"], draft.finished, advantages)
        if "turn_rewards" in batch:
            self.record_turn_rewards(draft.everyone, batch)
        start = self.accelerator.process_index * n
        scores = draft.everyone[start:start + n]
        table = {**{f.name: scores[:, k] for k, f in enumerate(self.reward_funcs)}, **draft.reward_logs.extra,
                 "advantage": per_row}
        if draft.columns.get("images") is not None:  # the prompt's image(s), by size
            table = {"image": [vision.describe(vision.load_images(row)) for row in draft.columns["images"]], **table}
        self.keep_completions(draft.prompts, draft.generations.texts, **table)
        out = {
            "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "completion_mask": draft.loss_mask,
            "advantages": draft.advantages, "prompt_length": batch["prompt_length"], "num_items_in_batch": draft.num_items,
        }
        for key, value in (("old_logps", draft.old_logps), ("ref_logps", draft.ref_logps),
                           ("importance_weights", draft.importance_weights), (vision.KEY, batch.get(vision.KEY)),
                           ("sampling_logps", draft.sampling_logps), ("tool_mask", batch.get("tool_mask"))):
            if value is not None:
                out[key] = value
        return out

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

    def gather_rollout(self, rewards: Tensor, batch: dict | None = None) -> Rollout:
        """Every process's scores ``[N_all, K]`` as a :class:`Rollout`; for a token-level estimator also every
        process's completion ``mask`` and, in multi-turn episodes, ``turn_index`` and ``turn_rewards``
        (all padded to the widest process's; −1 and NaN outside), read from ``batch``."""
        rollout = Rollout(rewards=rewards.float().cpu(), weights=self.reward_weights, group_size=self.group_size)
        estimator = getattr(self, "estimator", None)
        if batch is None or estimator is None or not estimator.component.options.token_level:
            return rollout
        turns = {"mask": self.gather_wide(batch["completion_mask"], 0)}
        if "turn_index" in batch:
            turns.update(turn_index=self.gather_wide(batch["turn_index"], -1),
                         turn_rewards=self.gather_wide(batch["turn_rewards"], float("nan")))
        return attrs.evolve(rollout, **turns)

    def gather_wide(self, values: Tensor, pad) -> Tensor:
        """Every process's rows of ``values`` ``[n, width]``, padded with ``pad`` to the widest process's, on the CPU."""
        padded = self.accelerator.pad_across_processes(values, dim=1, pad_index=pad)
        return self.accelerator.gather(padded).cpu()

    _warned_turns = False

    def record_turn_rewards(self, rewards: Tensor, batch: dict) -> None:
        """The per-turn reward metrics (:func:`plait.online.scoring.turn_reward_metrics`) of multi-turn episodes,
        logged only when an environment gave a per-turn reward somewhere in the rollout (any process)."""
        turn_rewards = self.gather_wide(batch["turn_rewards"], float("nan"))
        if turn_rewards.isnan().all():
            return
        estimator = getattr(self, "estimator", None)
        if estimator is not None and not estimator.component.options.turn_level and not self._warned_turns:
            self._warned_turns = True
            logger.warning("plait: the environment gives per-turn rewards, which %s does not read (it scores whole "
                           "episodes); set advantage_estimator to turn_return or turn_gae to use them", estimator.name)
        rollout = Rollout(rewards=rewards.float().cpu(), weights=self.reward_weights, group_size=self.group_size,
                          turn_rewards=turn_rewards, turn_index=self.gather_wide(batch["turn_index"], -1))
        self.record(turn_reward_metrics(rollout))

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
        self.record(self.objective.metrics(batch, parts))
        return (loss, None) if return_outputs else loss

    def policy_metrics(self, batch: PolicyTokens) -> dict[str, Tensor]:
        """The policy-gradient family's default metrics (token means over the completions): the entropy,
        the k3 estimate of KL(π‖π_ref) where there is a reference (Schulman 2020), and the clip fractions."""
        metrics = {"entropy": masked_mean(batch.entropy, batch.mask)}
        if batch.ref_logps is not None:
            r = batch.ref_logps - batch.logps
            metrics["kl"] = masked_mean(torch.exp(r) - r - 1, batch.mask)
        return {**metrics, **self.clip_metrics(batch)}

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
        metrics["advantages/std"] = advantages.float().std().item() if advantages.numel() > 1 else 0.0
        lengths = self.record_lengths(completion_mask, finished)
        if self.model.training:
            self._tokens_seen = getattr(self, "_tokens_seen", 0) + int(lengths.sum().item())
            metrics["num_tokens"] = self._tokens_seen
        self.record(metrics)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


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
