"""PPO for language models: a policy, a frozen reference, a reward, and a learned value model.

Ouyang et al. 2022 ("InstructGPT", §3.5) and Ziegler et al. 2019 ("Fine-Tuning Language Models
from Human Preferences"), with the clipped objective of Schulman et al. 2017. Each rollout:

1. the policy samples one completion per prompt through the configured generation backend;
2. the reward functions (a reward-model path or sequence classifier, or any registered reward,
   resolved by :mod:`plait.online.scoring`) score it; ``missing_eos_penalty`` is subtracted from
   completions that never produced EOS;
3. per token, the KL to the reference (k1: log π − log π_ref, or k3) is a penalty:
   r_t = −kl_coef·KL_t, plus the score on the last completion token (optionally whitened);
4. a token-level advantage estimator (``advantage.gae`` by default) turns rewards and the value
   model's estimates into advantages; returns R = A + V; advantages are whitened;
5. ``num_ppo_epochs`` passes over ``num_mini_batches`` minibatches (each one optimizer step of
   ``gradient_accumulation_steps`` micro-batches) minimise ``ppo.*`` policy losses +
   ``vf_coef`` × value losses, composed by name.

The value model is a backbone with a scalar head applied at every position (any
``…ForSequenceClassification`` with ``num_labels=1``), initialised from the reward model when
that is a model, else from the policy's checkpoint with a new head. Policy and value model are
one module to the transformers Trainer (one optimizer, one DDP wrapper); checkpoints hold the
policy as usual and the value model under ``value_model/``. An adaptive KL coefficient is a
``TrainerCallback`` contributed through the ``trainer_callbacks`` lifecycle hook.
"""

from __future__ import annotations

import copy
import math
import os
from typing import ClassVar

import attrs
import torch
from accelerate.utils import extract_model_from_parallel
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel, TrainerCallback
from transformers.trainer_callback import ExportableState

from plait import Method, PlaitError, hookimpl
from plait.engine.batches import PolicyTokens, Rollout, ValueTokens, masked_mean
from plait.engine.config import method_config
from plait.engine.logprobs import token_logprobs
from plait.engine.models import Reference, load_model
from plait.engine.objective import Objective, normalise_loss_specs
from plait.online.buffer import GenerationSizes
from plait.online.chassis import Draft, RolloutParams, RolloutTrainer
from plait.online.scoring import (
    RewardChoice,
    UnscoredBatches,
    resolve_advantage_estimator,
    resolve_reward_funcs,
    reward_weights,
)
from plait.params import in_range, int_at_least, non_negative, one_of, positive

KL_ESTIMATORS = ("k1", "k3")
VALUE_FOLDER = "value_model"


def _optional(validator):
    return attrs.validators.optional(validator)


@attrs.define
class PPOParams(RolloutParams, RewardChoice):
    """PPO's knobs; names and defaults follow TRL's PPOConfig.

    The reward is ``reward_funcs`` (registered names, callables, reward-model paths; or the
    trainer's ``reward_model`` argument) or TRL's ``reward_model_path``. ``loss`` and
    ``value_loss`` compose ``ppo.*`` policy and value losses; ``advantage_estimator`` names a
    token-level estimator (``gae`` with ``gamma``/``lam`` by default). ``target_kl`` turns on the
    adaptive KL controller (Ziegler et al. 2019) with horizon ``kl_horizon``.
    """

    field_help: ClassVar[dict[str, str]] = {
        "reward_model_path": "a reward-model folder that scores the completions (or give reward_funcs)",
        "value_model_path": "where the value model starts (null: the reward model, else the policy + a new head)",
        "ref_model_init_kwargs": "keyword arguments for from_pretrained of a ref_model given as a path or hub id",
        "total_episodes": "prompts trained on over the run; sets max_steps (null: from max_steps or epochs)",
        "num_ppo_epochs": "optimisation passes over each rollout batch",
        "num_mini_batches": "minibatches per rollout batch, each one optimizer step",
        "response_length": "most tokens sampled per completion",
        "temperature": "sampling temperature",
        "kl_coef": "weight of the per-token KL penalty to the reference in the reward",
        "kl_estimator": "per-token KL estimate: 'k1' (log-ratio) or 'k3' (non-negative, lower variance)",
        "target_kl": "KL the adaptive controller steers kl_coef toward (null: kl_coef stays fixed)",
        "kl_horizon": "the adaptive KL controller's horizon, in episodes (larger: slower changes)",
        "cliprange": "policy ratio clip range: [1 - cliprange, 1 + cliprange]",
        "cliprange_value": "the new value estimates are clipped to within this of the rollout's",
        "vf_coef": "weight of the value loss in the total loss",
        "gamma": "discount factor of the rewards in GAE (1.0: none)",
        "lam": "GAE's lambda: bias/variance trade-off of the advantages (1.0: Monte Carlo returns)",
        "whiten_rewards": "whiten the per-token rewards over the rollout batch (unit std, their mean kept)",
        "missing_eos_penalty": "subtracted from the score of a completion that never produced EOS (null: none)",
        "local_rollout_forward_batch_size": "rows per forward pass of the policy, value and reference over a rollout",
        "advantage_estimator": "a registered token-level estimator, name or {name, ...} (null: GAE with gamma, lam)",
        "value_loss": "value losses: names or [{name, weight, ...params}] (null: value; plait list losses)",
    }

    default_loss = "policy"
    reward_model_path: str | None = None
    value_model_path: str | None = None
    ref_model_init_kwargs: dict | None = None
    total_episodes: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    num_ppo_epochs: int = attrs.field(default=4, validator=int_at_least(1))
    num_mini_batches: int = attrs.field(default=1, validator=int_at_least(1))
    response_length: int = attrs.field(default=53, validator=int_at_least(1))
    temperature: float = attrs.field(default=0.7, validator=positive)
    kl_coef: float = attrs.field(default=0.05, validator=non_negative)
    kl_estimator: str = attrs.field(default="k1", validator=one_of(KL_ESTIMATORS))
    target_kl: float | None = attrs.field(default=None, validator=_optional(positive))
    kl_horizon: int = attrs.field(default=10000, validator=int_at_least(1))
    cliprange: float = attrs.field(default=0.2, validator=positive)
    cliprange_value: float = attrs.field(default=0.2, validator=positive)
    vf_coef: float = attrs.field(default=0.1, validator=non_negative)
    gamma: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    lam: float = attrs.field(default=0.95, validator=in_range(0.0, 1.0))
    whiten_rewards: bool = False
    missing_eos_penalty: float | None = attrs.field(default=None, validator=_optional(non_negative))
    local_rollout_forward_batch_size: int = attrs.field(default=64, validator=int_at_least(1))
    advantage_estimator: str | dict | None = None
    value_loss: list | None = None

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.value_loss_specs()  # malformed lists fail now

    def value_loss_specs(self) -> list[dict]:
        return normalise_loss_specs(self.value_loss if self.value_loss is not None else "value", field="value_loss")

    def advantage_spec(self) -> str | dict:
        if self.advantage_estimator is not None:
            return self.advantage_estimator
        return {"name": "advantage.gae", "gamma": self.gamma, "lam": self.lam}


PPOConfig = method_config(
    "PPOConfig", PPOParams,
    # plait's PPO samples and scores the function it updates: no dropout (policy, reference, value
    # model); and like the other methods without TRL's field, no load-balancing loss unless asked for
    defaults={"learning_rate": 3e-6, "logging_steps": 10, "remove_unused_columns": False, "disable_dropout": True,
              "router_aux_loss_coef": 0.0},
)


# ---------------------------------------------------------------------------------------------
# The value model and the module the Trainer optimises
# ---------------------------------------------------------------------------------------------

SCALAR_HEADS = ("score", "classifier", "v_head")


def value_head(model: nn.Module, field: str = "value_model") -> nn.Module:
    """The scalar head of a ``…ForSequenceClassification`` with one label, or a one-line error."""
    heads = [getattr(model, name, None) for name in SCALAR_HEADS]
    head = next((h for h in heads if isinstance(h, nn.Linear) and h.out_features == 1), None)
    prefix = getattr(model, "base_model_prefix", "")
    if head is None or not prefix or getattr(model, prefix, None) is None:
        raise PlaitError(f"{field} is a {type(model).__name__} without a scalar head; pass a …ForSequenceClassification "
                         "with num_labels=1 (or its path: AutoModelForSequenceClassification.from_pretrained(path, "
                         "num_labels=1))")
    return head


def token_values(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """V(x_{≤t−1}) aligned to token t, ``[B, T]`` float32 (0 at t = 0): the value of the state
    in which token t was chosen, the same alignment as :func:`plait.engine.logprobs.token_logprobs`."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    values = value_head(model)(hidden).squeeze(-1).float()
    return torch.cat([values.new_zeros(values.shape[0], 1), values[:, :-1]], dim=1)


class PolicyAndValue(nn.Module):
    """Policy and value model as one trained module: one optimizer, one DDP wrapper, one forward.

    The forward returns the policy's output with ``values`` [B, T] added; it exposes the policy's
    output layer and config so :func:`plait.engine.logprobs.token_logprobs` treats it as the policy.
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    @property
    def config(self):
        return self.policy.config

    def get_output_embeddings(self):
        return self.policy.get_output_embeddings()

    def activation_checkpointing_enable(self, **kwargs) -> None:
        self.policy.activation_checkpointing_enable(**kwargs)
        self.value_model.activation_checkpointing_enable(**kwargs)

    def gradient_checkpointing_enable(self, **kwargs) -> None:  # the name transformers < 5.20 calls
        self.policy.gradient_checkpointing_enable(**kwargs)
        self.value_model.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs):
        output = self.policy(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        output["values"] = token_values(self.value_model, input_ids, attention_mask)
        return output


def _load_value_model(spec: str | PreTrainedModel, init_kwargs: dict | None) -> PreTrainedModel:
    if isinstance(spec, str):
        spec = load_model(spec, {"num_labels": 1, **(init_kwargs or {})}, auto_class=AutoModelForSequenceClassification,
                          field="value_model")
    value_head(spec)
    return spec


# ---------------------------------------------------------------------------------------------
# KL control
# ---------------------------------------------------------------------------------------------


class KLController(TrainerCallback):
    """The KL penalty coefficient: fixed here; subclasses adapt it between rollouts.

    The trainer calls :meth:`observe` with each rollout's mean sequence KL. A controller is a
    ``TrainerCallback`` so a plugin can contribute one through the ``trainer_callbacks`` hook;
    the trainer uses the one it finds among its callbacks, else a fixed ``kl_coef``.
    """

    def __init__(self, kl_coef: float):
        self.kl_coef = float(kl_coef)

    def observe(self, kl: float, episodes: int) -> None:
        """A rollout of ``episodes`` completions had mean KL ``kl`` (nats per sequence)."""


class AdaptiveKLController(KLController, ExportableState):
    """Ziegler et al. 2019, §2.2: β ← β·(1 + clip(KL/KL_target − 1, −0.2, 0.2)·n/horizon).

    n is the number of episodes since the last update. The update is applied at the end of the
    next optimizer step, so the coefficient changes between rollouts, never inside one.
    """

    def __init__(self, kl_coef: float, target: float, horizon: int):
        super().__init__(kl_coef)
        self.target, self.horizon = float(target), int(horizon)
        self._pending: tuple[float, int] | None = None

    def observe(self, kl: float, episodes: int) -> None:
        self._pending = (kl, episodes)

    def on_step_end(self, args, state, control, **kwargs):
        if self._pending is not None:
            kl, episodes = self._pending
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.kl_coef *= 1.0 + error * episodes / self.horizon
            self._pending = None

    def state(self) -> dict:
        return {"args": {"kl_coef": self.kl_coef, "target": self.target, "horizon": self.horizon}, "attributes": {}}


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


def whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x − mean)/std over the masked entries (unbiased variance); the mean is kept when not ``shift_mean``."""
    mask = mask.to(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1.0)
    variance = (((values - mean) ** 2) * mask).sum() / (count - 1).clamp(min=1.0)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return (whitened if shift_mean else whitened + mean) * mask


class PPOTrainer(RolloutTrainer):
    """PPO with a value model, GAE (or any token-level estimator) and ``ppo.*`` losses composed by name."""

    method = "ppo"
    config_class = PPOConfig
    prompt_collator = "collator.prompt_only"

    def __init__(self, model, ref_model=None, reward_model=None, value_model=None, args=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_class=None, peft_config=None,
                 callbacks=None, optimizers=(None, None), plugins=None):
        self._reward_spec, self._reward_processing_class = reward_model, reward_processing_class
        super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, peft_config=peft_config, callbacks=callbacks,
                         optimizers=optimizers, plugins=plugins, ref_model=ref_model, value_model=value_model)

    # -- construction -------------------------------------------------------------------------
    def rollout_plan(self, args) -> GenerationSizes:
        p = args.params
        return GenerationSizes.one_per_prompt(args, args.gradient_accumulation_steps * p.num_mini_batches,
                                              p.num_ppo_epochs)

    def validate(self, args) -> None:
        super().validate(args)
        p = args.params
        self.policy_objective = Objective.build(p.loss_specs(), self.plugins.losses, family="ppo",
                                                consumes=PolicyTokens, shared={"cliprange": p.cliprange},
                                                metrics=self.policy_metrics)
        self.value_objective = Objective.build(p.value_loss_specs(), self.plugins.losses, family="ppo",
                                               consumes=ValueTokens, shared={"cliprange_value": p.cliprange_value},
                                               field="value_loss", metrics=self.value_metrics)
        self.estimator = resolve_advantage_estimator(p.advantage_spec(), self.plugins, field="advantage_estimator")
        if not self.estimator.component.options.token_level:
            raise PlaitError(f"advantage_estimator {self.estimator.name!r} gives one advantage per sequence; PPO needs a "
                             "token-level estimator such as advantage.gae")
        if self.estimator.component.options.turn_level:  # its baseline is the group's; PPO's groups are of one
            raise PlaitError(f"advantage_estimator {self.estimator.name!r} compares each turn with the other episodes of "
                             "its prompt, and PPO samples one episode per prompt (all its advantages would be 0); use "
                             "advantage.gae, or GRPO for per-turn credit")
        # validate() may run on a bare instance (recipe checks): arguments of __init__ may be absent.
        given = getattr(self, "_reward_spec", None)
        sources = {name: value for name, value in (("reward_model", given), ("reward_funcs", p.reward_funcs),
                                                   ("reward_model_path", p.reward_model_path)) if value is not None}
        if len(sources) != 1:
            got = " and ".join(sources) if sources else "none"
            raise PlaitError(f"PPO needs exactly one reward source (reward_model=, reward_funcs or reward_model_path); "
                             f"got {got}")
        (self._reward_field, spec), = sources.items()
        entries = list(spec) if isinstance(spec, (list, tuple)) else [spec]
        self.reward_funcs = resolve_reward_funcs(entries, self.plugins, getattr(self, "_reward_processing_class", None),
                                                 field=self._reward_field)
        self.reward_weights = reward_weights(self.reward_funcs, p.reward_weights)
        self.unscored = UnscoredBatches([f.name for f in self.reward_funcs], p.max_unscored_batches)
        self._reward_entries = entries
        self._check_episodes(args)

    def _check_episodes(self, args) -> None:
        """total_episodes (prompts over the run) sets max_steps; it must cover one rollout batch."""
        p = args.params
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * p.num_mini_batches * args.world_size
        self._max_steps = None
        if p.total_episodes is None:
            return
        if p.total_episodes < batch:
            raise PlaitError(
                f"total_episodes={p.total_episodes} is smaller than one rollout batch of {batch} prompts "
                f"(per_device_train_batch_size {args.per_device_train_batch_size} × gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps} × num_mini_batches {p.num_mini_batches} × {args.world_size} "
                f"processes); raise total_episodes to at least {batch} or make the batch smaller")
        self._max_steps = math.ceil(p.total_episodes / batch) * p.num_ppo_epochs * p.num_mini_batches
        if args.max_steps > 0 and args.max_steps != self._max_steps:
            raise PlaitError(f"total_episodes={p.total_episodes} and max_steps={args.max_steps} both set the length of "
                             "training; give only one")

    def before_peft(self, model, args, ref_model=None, value_model=None):
        p = args.params
        if p.kl_coef == 0 and p.target_kl is None and ref_model is None:
            self.reference = Reference.none()  # no KL penalty: no reference at all
        elif self.peft_config is not None and ref_model is None:
            self.reference = Reference.adapters_disabled()  # the policy with adapters off: no second copy
        else:
            self.reference = Reference.for_policy(model, ref_model, p.ref_model_init_kwargs)
        with torch.random.fork_rng(devices=[]):  # a new scalar head is drawn from args.seed, not the caller's RNG
            torch.manual_seed(args.seed)
            self.value_model = _load_value_model(self._value_source(model, value_model, p), p.model_init_kwargs)
        if self.value_model.config.get_text_config().vocab_size != model.config.get_text_config().vocab_size:
            raise PlaitError("value_model has a different vocabulary than the policy; it reads the policy's tokens, so "
                             "it must share the policy's tokenizer")
        return model

    def _value_source(self, policy, value_model, p):
        """value_model=, value_model_path, the reward model (a copy), or the policy's checkpoint with a new head."""
        if value_model is not None:
            return value_model
        if p.value_model_path is not None:
            return p.value_model_path
        if len(self._reward_entries) == 1:
            entry = self._reward_entries[0]
            if isinstance(entry, str) and os.path.isdir(entry):
                return entry
            if isinstance(entry, PreTrainedModel) and type(entry).__name__.endswith("ForSequenceClassification"):
                return copy.deepcopy(entry)
        source = policy.config._name_or_path
        if not source or not os.path.isdir(source):
            raise PlaitError("no value model: pass value_model= (a …ForSequenceClassification with num_labels=1) or "
                             "value_model_path, or load the policy from a folder so one can be initialised from it")
        return source

    def auxiliary_modules(self) -> dict[str, nn.Module]:
        return {VALUE_FOLDER: self.value_model}

    def trained_module(self, policy: nn.Module) -> nn.Module:
        return PolicyAndValue(policy, self.value_model)

    def after_init(self) -> None:
        super().after_init()
        self.reference.prepare(self.accelerator, synced=False)  # PPO has no TR-DPO sync
        self.kl_controller = self._kl_controller()
        self.loss_is_scaled_for_ga = False  # the losses are means over a micro-batch: the Trainer divides by GA
        if self._max_steps is not None:
            self.args.max_steps = self._max_steps

    def _kl_controller(self) -> KLController:
        """The KL controller among the callbacks, else a fixed ``kl_coef``."""
        controllers = [c for c in self.callback_handler.callbacks if isinstance(c, KLController)]
        if len(controllers) > 1:
            names = [type(c).__name__ for c in controllers]
            raise PlaitError(f"{len(controllers)} KL controllers are attached ({names}); keep one")
        return controllers[0] if controllers else KLController(self.args.params.kl_coef)

    def sampling_params(self):
        p = self.args.params
        return p.sampling(p.response_length, p.temperature)

    # -- one rollout --------------------------------------------------------------------------
    def _policy_and_values(self, model, batch: dict, rows: slice) -> tuple[Tensor, Tensor, Tensor]:
        """Completion log-probs, entropies and values of some rows under the policy+value module."""
        width = batch["prompt_length"]
        captured: list[Tensor] = []
        # Under DDP the hook goes on the wrapped module: it sees the one forward that DDP runs.
        module = extract_model_from_parallel(model)
        handle = module.register_forward_hook(lambda module, args, output: captured.append(output["values"]))
        try:
            out = token_logprobs(model, batch["input_ids"][rows], batch["attention_mask"][rows],
                                 temperature=self.args.params.temperature, with_entropy=True,
                                 chunked=self.args.chunked_logprobs)
        finally:
            handle.remove()
        return out.logps[:, width:], out.entropy[:, width:], captured[0][:, width:]

    def _reference_logps(self, batch: dict, rows: slice) -> Tensor:
        width = batch["prompt_length"]

        def logps(model):
            return token_logprobs(model, batch["input_ids"][rows], batch["attention_mask"][rows],
                                  temperature=self.args.params.temperature, chunked=self.args.chunked_logprobs).logps

        return self.reference(self._policy, logps)[:, width:]

    def score(self, draft: Draft) -> None:
        """Each completion's score (``draft.scores``): its weighted rewards (0 where none scored), less
        ``missing_eos_penalty`` when it never ended."""
        p, device = self.args.params, self.accelerator.device
        self.reward_scores(draft)
        draft.scored = Rollout(rewards=draft.rewards, weights=self.reward_weights.to(device), group_size=1)
        draft.scores = draft.scored.total_reward.nan_to_num(0.0)  # a completion no reward scored gets 0
        if p.missing_eos_penalty is not None:
            draft.scores = draft.scores - p.missing_eos_penalty * (~draft.finished).float()

    def estimate(self, draft: Draft) -> None:
        """The policy's, the value model's and the reference's view of the samples, per-token rewards
        (the KL penalty everywhere, the score on the last completion token), advantages and returns."""
        p, device, batch = self.args.params, self.accelerator.device, draft.batch
        mask = batch["completion_mask"].float()
        n, size = mask.shape[0], p.local_rollout_forward_batch_size
        parts = {"logps": [], "values": [], "ref": []}
        with self.compute_loss_context_manager():
            for start in range(0, n, size):
                rows = slice(start, start + size)
                logps, _, values = self._policy_and_values(self.model, batch, rows)
                parts["logps"].append(logps.float())
                parts["values"].append(values.float())
                parts["ref"].append(self._reference_logps(batch, rows).float() if self.reference.available else logps)
        old_logps, old_values, ref_logps = (torch.cat(parts[k]) * mask for k in ("logps", "values", "ref"))

        log_ratio = ref_logps - old_logps
        kl = -log_ratio if p.kl_estimator == "k1" else torch.expm1(log_ratio) - log_ratio
        draft.kl = kl * mask
        draft.kl_coef = self.kl_controller.kl_coef
        draft.non_score = -draft.kl_coef * draft.kl
        last = (mask.sum(-1).long() - 1).clamp(min=0)
        token_rewards = draft.non_score.clone()
        token_rewards[torch.arange(n, device=device), last] += draft.scores * (mask.sum(-1) > 0)
        if p.whiten_rewards:
            token_rewards = whiten(token_rewards, mask, shift_mean=False)

        rollout = attrs.evolve(draft.scored, token_rewards=token_rewards, values=old_values, mask=mask.bool())
        advantages = self.estimator(rollout).to(device).float() * mask
        draft.old_logps, draft.old_values, draft.returns = old_logps, old_values, advantages + old_values
        draft.advantages = whiten(advantages, mask)

    def record_rollout(self, draft: Draft) -> dict:
        """The KL controller's observation, the objective's metrics, and the buffer's tensors."""
        n, mask = len(draft.prompt_ids), draft.batch["completion_mask"].float()
        sequence_kl = draft.kl.sum(-1)
        if self.model.training:
            self._episodes = getattr(self, "_episodes", 0) + n * self.accelerator.num_processes
        self.kl_controller.observe(self.accelerator.gather(sequence_kl).mean().item(),
                                   n * self.accelerator.num_processes)
        gathered, scores, rewards = self.accelerator.gather, draft.scores, draft.rewards
        self.record({
            "objective/kl": gathered(sequence_kl).mean(),
            "objective/entropy": gathered(-(draft.old_logps * mask).sum(-1)).mean(),
            "objective/non_score_reward": gathered(draft.non_score.sum(-1)).mean(),
            "objective/rlhf_reward": gathered(scores + draft.non_score.sum(-1)).mean(),
            "objective/scores": gathered(scores).mean(),
            "objective/kl_coef": draft.kl_coef,
            "val/num_eos_tokens": gathered(draft.finished.float().sum().reshape(1)).sum(),
            "episode": getattr(self, "_episodes", 0),
            **{f"rewards/{f.name}/mean": gathered(rewards[:, k]).nanmean() for k, f in enumerate(self.reward_funcs)},
        })
        self.record_lengths(draft.batch["completion_mask"], draft.finished)
        self.keep_completions(draft.prompts, draft.generations.texts, score=scores.tolist())
        return {**draft.batch, "old_logps": draft.old_logps, "old_values": draft.old_values,
                "advantages": draft.advantages, "returns": draft.returns}

    # -- the loss ------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        p = self.args.params
        logps, entropy, values = self._policy_and_values(model, inputs, slice(None))
        mask = inputs["completion_mask"]
        policy = PolicyTokens(logps=logps, old_logps=inputs["old_logps"], advantages=inputs["advantages"], mask=mask,
                              entropy=entropy)
        critic = ValueTokens(values=values, old_values=inputs["old_values"], returns=inputs["returns"], mask=mask)
        pg, pg_parts = self.policy_objective(policy, mask=mask)
        vf, vf_parts = self.value_objective(critic, mask=mask)
        loss = pg + p.vf_coef * vf
        self.record({**self.policy_objective.metrics(policy, pg_parts), "loss/policy_avg": pg.detach(),
                     **self.value_objective.metrics(critic, vf_parts), "loss/value_avg": vf.detach()})
        return (loss, None) if return_outputs else loss

    def policy_metrics(self, batch: PolicyTokens) -> dict[str, torch.Tensor]:
        """The policy objective's default metrics (token means): half the mean squared log-ratio (approx. KL
        to the sampling policy), the fraction the clip acts on, the entropy and the importance ratio."""
        cliprange, mask = self.args.params.cliprange, batch.mask
        log_ratio = batch.logps - batch.old_logps
        ratio, a = torch.exp(log_ratio), batch.advantages
        clipped = torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
        return {"policy/approxkl": 0.5 * masked_mean(log_ratio ** 2, mask),
                "policy/clipfrac": masked_mean((-a * clipped > -a * ratio).float(), mask),
                "policy/entropy": masked_mean(batch.entropy, mask), "val/ratio": masked_mean(ratio, mask)}

    def value_metrics(self, batch: ValueTokens) -> dict[str, torch.Tensor]:
        """The value objective's default metric: the fraction of tokens whose clipped value error is the larger."""
        bound = self.args.params.cliprange_value
        clipped = batch.old_values + torch.clamp(batch.values - batch.old_values, -bound, bound)
        larger = (clipped - batch.returns) ** 2 > (batch.values - batch.returns) ** 2
        return {"val/clipfrac": masked_mean(larger.float(), batch.mask)}

    # -- run state beyond the weights (the value model is saved as an auxiliary module) ---------
    def resume_state(self) -> dict:
        # The KL coefficient an adaptive controller has reached is run state, like the episode count.
        return {**super().resume_state(), "episode": getattr(self, "_episodes", 0),
                "kl_coef": self.kl_controller.kl_coef}

    def load_resume_state(self, state: dict) -> None:
        super().load_resume_state(state)
        self._episodes = state["episode"]
        # restore_callback_states_from_checkpoint may have replaced the controller: use the attached one
        self.kl_controller = self._kl_controller()
        self.kl_controller.kl_coef = state["kl_coef"]


@hookimpl
def trainer_callbacks(method, args):
    """With ``target_kl`` set, PPO runs get the adaptive KL controller (Ziegler et al. 2019)."""
    if not isinstance(args, PPOConfig) or args.params.target_kl is None:
        return []
    p = args.params
    return [AdaptiveKLController(p.kl_coef, p.target_kl, p.kl_horizon)]


@hookimpl
def register_methods(register):
    register("method.ppo", Method(config=PPOConfig, trainer=PPOTrainer, loss_family="ppo",
                                  summary="PPO with a value model, GAE and ppo.* losses (RLHF)"))
