"""Online DPO: DPO on pairs the policy samples itself, ranked by a judge (Guo et al. 2024, "Direct
Language Model Alignment from Online AI Feedback", §3, Algorithm 1).

Per micro-batch of prompts the policy samples two completions for each through the configured
generation backend (:class:`plait.online.generation.GenerationChoice`: transformers, vLLM colocate or
server, as GRPO). A judge (``register_judges``: ``judge.reward_model``, ``judge.rules``,
``judge.pairwise`` or a third party's) names the better one; the pair, chosen first, goes through
the composed ``dpo.*`` losses (``dpo.sigmoid`` by default, TRL's ``loss_type`` or plait's ``loss``
list) against the reference (:class:`plait.engine.models.Reference`: a frozen copy, ``ref_model``, or the
policy with its adapters off). A tie (-1) keeps the pair out of the loss (it still counts in the
metrics). The sampling, the data of prompts, the completions table and the buffer are
:class:`plait.online.chassis.OnlineTrainer`'s; only the pairing and the loss are this module's.

TRL 1.16's OnlineDPOTrainer takes ``reward_funcs`` (summed with ``reward_weights``) where older
TRL took a ``judge``; plait takes both: ``reward_funcs`` (or ``reward_model_path``) become a
``judge.rules`` of those rewards, ``judge=`` (an object, a registered name, or ``{name, **params}``;
``judge:`` in a recipe's training section) names any judge. With a judge that scores completions,
``missing_eos_penalty`` is subtracted from the score of each completion that did not end.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import attrs
import torch

from plait import Method, PlaitError, hookimpl
from plait.engine.batches import PreferenceLogps
from plait.engine.config import method_config
from plait.engine.models import Reference
from plait.engine.objective import Objective
from plait.engine.trainer import PlaitTrainer
from plait.online.buffer import GenerationSizes, completion_columns
from plait.online.chassis import Draft, OnlineParams, OnlineTrainer, RolloutTrainer
from plait.params import int_at_least, positive
from plait.registry import Component

PAIR = 2  # completions per prompt


def _two(instance, attribute, value) -> None:
    if value != PAIR:
        raise ValueError(f"{attribute.name}={value!r}: online DPO samples exactly 2 completions per prompt (a pair)")


def _beta(instance, attribute, value) -> None:
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in values):
        raise ValueError(f"beta={value!r} must be a number > 0, or a list of them (one per epoch, the last kept)")


def _optional(validator):
    return attrs.validators.optional(validator)


@attrs.define
class OnlineDPOParams(OnlineParams):
    """Online DPO's knobs; names and defaults follow TRL 1.16's OnlineDPOConfig.

    ``max_new_tokens`` tokens are sampled per completion; ``max_length`` bounds prompt + completion
    in the loss (the prompt's leftmost tokens are dropped beyond it). ``beta`` may be a list: one
    value per epoch, the last one kept after. ``judge`` names the judge (see the module docstring);
    ``reward_model_path`` is a reward-model folder judged by ``judge.reward_model``.
    ``max_completion_length`` is the online base's name for ``max_new_tokens`` (give one of them).
    """
    field_help: ClassVar[dict[str, str]] = {
        "num_generations": "completions per prompt: a pair",
        "max_new_tokens": "most tokens sampled per completion",
        "max_completion_length": "the online methods' name for max_new_tokens (give one of them)",
        "max_length": "most tokens of prompt + completion in the loss (the prompt's start is dropped beyond it)",
        "temperature": "sampling temperature",
        "beta": "DPO's beta; a list gives one value per epoch (the last one kept after)",
        "missing_eos_penalty": "subtracted from the score of a completion that never ends (null: none)",
        "reward_model_path": "a reward-model folder that judges the pairs (judge.reward_model)",
        "judge": "a registered judge by name or {name, ...params} (plait list judges)",
    }

    default_loss = "sigmoid"
    num_generations: int = attrs.field(default=PAIR, validator=_two)
    max_new_tokens: int = attrs.field(default=64, validator=int_at_least(1))
    max_completion_length: int | None = attrs.field(default=None, validator=_optional(int_at_least(1)))
    max_length: int = attrs.field(default=512, validator=int_at_least(2))
    temperature: float = attrs.field(default=0.9, validator=positive)
    beta: Any = attrs.field(default=0.1, validator=_beta)
    missing_eos_penalty: float | None = None
    reward_model_path: str | None = None
    judge: Any = None

    def __attrs_post_init__(self) -> None:
        if self.max_completion_length is None:
            self.max_completion_length = self.max_new_tokens
        elif self.max_new_tokens not in (64, self.max_completion_length):
            raise PlaitError(f"max_completion_length={self.max_completion_length} and max_new_tokens="
                             f"{self.max_new_tokens} both set the completion length; give only max_new_tokens")
        else:
            self.max_new_tokens = self.max_completion_length
        if self.max_length <= self.max_new_tokens:
            raise PlaitError(f"max_length={self.max_length} leaves no room for a prompt before max_new_tokens="
                             f"{self.max_new_tokens} sampled tokens; raise max_length or lower max_new_tokens")
        for name in ("generation_batch_size", "steps_per_generation"):
            if getattr(self, name) is not None:
                raise PlaitError(f"{name}={getattr(self, name)}: online DPO samples the pairs of each micro-batch "
                                 "when it trains on them (as TRL); remove it")
        super().__attrs_post_init__()

    def beta_at(self, epoch: float | None) -> float:
        """TRL's rule: ``beta[epoch]`` for a list (the last value once epochs run past it)."""
        if not isinstance(self.beta, (list, tuple)):
            return float(self.beta)
        index = int(epoch or 0)
        return float(self.beta[min(index, len(self.beta) - 1)])


OnlineDPOConfig = method_config(
    "OnlineDPOConfig", OnlineDPOParams,
    defaults={"learning_rate": 5e-7, "logging_steps": 10, "remove_unused_columns": False, "disable_dropout": True,
              "vllm_gpu_memory_utilization": 0.55},  # TRL's OnlineDPOConfig default for the colocated engine
)


def resolve_judge(spec: Any, plugins, field: str = "judge"):
    """A judge from a registered name, ``{name, **params}`` or an object ``judge(prompts, pairs)``."""
    if callable(spec) and not isinstance(spec, (str, Mapping)):
        return spec
    values: dict = {}
    if isinstance(spec, Mapping):
        values = dict(spec)
        if "name" not in values:
            raise PlaitError(f"{field} has no 'name'; write e.g. {{name: rules, rewards: [think_format]}}")
        spec = values.pop("name")
    if not isinstance(spec, str):
        raise PlaitError(f"{field}={spec!r:.80} is not a judge; give a registered name (e.g. 'pairwise'), "
                         "{name, **params}, or an object judge(prompts, completion_pairs) -> list[int]")
    component: Component = plugins.judges.get(spec, family="judge")
    if component.params is None:
        component.make_params(**values)  # "takes no parameters" when some are given
        return component.obj
    missing = [a.name for a in attrs.fields(component.params) if a.default is attrs.NOTHING and a.name not in values]
    if missing:
        short = component.name.removeprefix("judge.")
        raise PlaitError(f"{field}: judge {component.name!r} needs {', '.join(missing)}; write it as "
                         f"{{name: {short}, {', '.join(f'{m}: ...' for m in missing)}}}")
    return component.obj(component.make_params(**values), plugins)


class OnlineDPOTrainer(OnlineTrainer):
    """DPO on self-sampled pairs: two completions per prompt, a judge picks the chosen one."""

    method = "online_dpo"
    config_class = OnlineDPOConfig
    takes_images = False  # its pair sampling and judges read text only
    loss_family = "dpo"
    prompt_collator = "collator.prompt_only"
    _judge_spec = None  # the constructor's judge; a class default because validate() runs without __init__

    def __init__(self, model, ref_model=None, reward_funcs=None, judge=None, args=None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, reward_processing_classes=None,
                 peft_config=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 preprocess_logits_for_metrics=None, quantization_config=None, plugins=None):
        self._reward_specs, self._reward_processing_classes, self._judge_spec = reward_funcs, reward_processing_classes, judge
        PlaitTrainer.__init__(self, model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                              eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                              callbacks=callbacks, optimizers=optimizers, plugins=plugins, compute_metrics=compute_metrics,
                              preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                              quantization_config=quantization_config, ref_model=ref_model)

    # -- construction -------------------------------------------------------------------------
    def rollout_plan(self, args) -> GenerationSizes:
        # per_device_train_batch_size counts prompts, as in TRL: each micro-batch samples its own pairs
        return GenerationSizes(PAIR * args.per_device_train_batch_size, args.world_size, 1, PAIR,
                               args.params.num_iterations)

    def validate(self, args) -> None:
        p = args.params
        if args.remove_unused_columns:
            raise PlaitError("remove_unused_columns=True would drop the prompt and the columns judges read; "
                             "set remove_unused_columns=False (online DPO's default)")
        RolloutTrainer.validate(self, args)  # the chassis' sizes and backend; GRPO's reward checks are not ours
        if p.rollout_filters:
            raise PlaitError(f"rollout_filters={p.rollout_filters!r}: online DPO's judge ranks pairs, so there are no "
                             "group rewards to filter on; drop rollout_filters")
        if args.eval_strategy != "no" and args.per_device_eval_batch_size % PAIR:
            raise PlaitError(f"per_device_eval_batch_size={args.per_device_eval_batch_size} counts evaluation "
                             "completions, two per prompt; make it even")
        self.judge = self._resolve_judge(p)
        if p.missing_eos_penalty is not None and not hasattr(self.judge, "scores"):
            raise PlaitError(f"missing_eos_penalty={p.missing_eos_penalty} lowers completion scores, but the judge "
                             f"{type(self.judge).__name__} only ranks pairs; use a scoring judge (rules, reward_model) "
                             "or drop missing_eos_penalty")
        self._beta = p.beta_at(0)
        self.objective = self.build_objective(p)
        self.reward_funcs = []  # the judge scores; the base's reward bookkeeping stays empty

    def _resolve_judge(self, p):
        judges = [s for s in (self._judge_spec, p.judge) if s is not None]
        rewards = self._reward_specs if self._reward_specs is not None else p.reward_funcs
        if self._reward_specs is not None and p.reward_funcs is not None:
            raise PlaitError("reward functions are given both as the reward_funcs argument and in the config's "
                             "reward_funcs; give them once")
        entries = [] if rewards is None else list(rewards) if isinstance(rewards, (list, tuple)) else [rewards]
        if p.reward_model_path is not None:
            entries = [p.reward_model_path, *entries]
        if len(judges) > 1:
            raise PlaitError("the judge is given both as the judge argument and in the config's judge; give it once")
        if judges and entries:
            raise PlaitError("give a judge or reward_funcs / reward_model_path, not both (reward functions are "
                             "judge.rules: judge: {name: rules, rewards: [...]})")
        if judges:
            return resolve_judge(judges[0], self.plugins)
        if not entries:
            raise PlaitError("OnlineDPOTrainer needs a judge to rank its pairs: judge= (e.g. 'pairwise' with a "
                             "model, or {name: rules, rewards: [...]}), reward_funcs, or reward_model_path")
        return resolve_judge({"name": "rules", "rewards": self._resolve_rewards(entries), "weights": p.reward_weights,
                              "on_error": p.reward_error_policy, "timeout": p.reward_timeout}, self.plugins)

    def build_objective(self, p) -> Objective:
        return Objective.build(p.loss_specs(), self.plugins.losses, family=self.loss_family, consumes=PreferenceLogps,
                               shared={"beta": self._beta}, field=p.loss_field)

    def uses_reference(self, p) -> bool:
        return True  # every dpo.* loss compares with the reference

    def before_peft(self, model, args, ref_model=None):
        self.reference = Reference.for_policy(model, ref_model, peft_config=self.peft_config)
        if args.params.sync_ref_model:
            self.reference.check_syncable(model, self.peft_config)
        return model

    def after_init(self) -> None:
        super().after_init()
        self.loss_is_scaled_for_ga = None  # dpo.* losses are means over pairs: the Trainer divides by accumulation

    def split_rollout(self, rollout: dict, parts: int, generator: torch.Generator) -> list[dict]:
        return [rollout]  # each micro-batch samples its own pairs, used whole ``num_iterations`` times

    @property
    def group_size(self) -> int:
        return PAIR

    @property
    def beta(self) -> float:
        return self.args.params.beta_at(self.state.epoch)

    # -- one rollout: sample pairs, judge them, put chosen rows first -------------------------
    def score(self, draft: Draft) -> None:
        """The judge's verdict on each pair (``draft.winners``) and, from a scoring judge, each completion's score."""
        draft.winners, draft.scores = self.judge_pairs(draft.prompts, draft.completions,
                                                       draft.generations.completion_ids, draft.columns, draft.finished)

    def estimate(self, draft: Draft) -> None:
        """The pairs chosen rows first (``draft.pairs``), with the reference's log-probs."""
        winners = draft.winners
        first = torch.arange(0, len(draft.prompt_ids), PAIR, device=self.accelerator.device)
        draft.chosen = first + winners.clamp(min=0)  # a tie keeps the sampled order (and stays out of the loss)
        draft.order = torch.cat([draft.chosen, first + 1 - winners.clamp(min=0)])
        out = {key: draft.batch[key][draft.order] for key in ("input_ids", "attention_mask", "completion_mask")}
        out.update(prompt_length=draft.batch["prompt_length"], decided=(winners >= 0).repeat(PAIR))
        with self.compute_loss_context_manager():
            out["ref_logps"] = self.reference(self.model_wrapped, lambda m: self.logps_of(m, out))
        draft.pairs = out

    def record_rollout(self, draft: Draft) -> dict:
        out, winners, scores, chosen, order = draft.pairs, draft.winners, draft.scores, draft.chosen, draft.order
        metrics = {"val/contain_eos_token": draft.finished.float().mean(), "judge/ties": (winners < 0).float().mean()}
        if scores is not None:
            out["scores"] = scores[order]
            metrics.update({"objective/scores": scores.mean(),
                            "objective/scores_margin": (scores[chosen] - scores[order[len(chosen):]]).mean()})
        self.record(metrics)
        table = {"chosen": torch.zeros(len(order)).index_fill(0, chosen.cpu(), 1.0), "judge": winners.repeat_interleave(PAIR)}
        if scores is not None:
            table["score"] = scores
        self.keep_completions(draft.prompts, draft.generations.texts, **table)
        return out

    def judge_pairs(self, prompts, completions, completion_ids, columns, finished) -> tuple[torch.Tensor, Any]:
        """The preferred completion of each pair (0, 1; -1 a tie) ``[B]``, and each completion's score
        ``[2B]`` when the judge scores (None otherwise)."""
        device = finished.device
        if hasattr(self.judge, "scores"):
            scores = self.judge.scores(prompts, completions, completion_ids=completion_ids, columns=columns,
                                       trainer_state=self.state).to(device)
            if self.args.params.missing_eos_penalty is not None:
                scores = scores - self.args.params.missing_eos_penalty * (~finished).float()
            first, second = scores.view(-1, PAIR).unbind(-1)
            return torch.where(first > second, 0, torch.where(second > first, 1, -1)), scores
        pairs = [completions[i:i + PAIR] for i in range(0, len(completions), PAIR)]
        verdict = list(self.judge(prompts[::PAIR], pairs))
        if len(verdict) != len(pairs) or any(v not in (-1, 0, 1) for v in verdict):
            raise PlaitError(f"judge {type(self.judge).__name__} returned {verdict!r:.120} for {len(pairs)} pairs; a "
                             "judge returns one of 0, 1 (the preferred completion) or -1 (a tie) per pair")
        return torch.tensor(verdict, device=device), None

    def pack_rollout(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> dict:
        """The packed pairs without the leftmost prompt columns beyond ``max_length`` (TRL's rule for the loss forward)."""
        batch = super().pack_rollout(prompt_ids, completion_ids)
        cut = batch["input_ids"].shape[1] - self.args.params.max_length
        if cut <= 0:
            return batch
        return {**batch, "input_ids": batch["input_ids"][:, cut:], "attention_mask": batch["attention_mask"][:, cut:],
                "prompt_length": batch["prompt_length"] - cut}

    def logps_of(self, model, batch: dict) -> torch.Tensor:
        """Completion-token log-probs ``[N, C]`` at temperature 1 (the policy DPO compares, as TRL)."""
        width = batch["prompt_length"]
        out = self.rows_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                 select=completion_columns(batch["input_ids"], width))
        return out.logps[:, width:].float()

    # -- the loss ------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        beta = self.beta
        if beta != self._beta:  # a beta schedule moved to the next epoch
            self._beta = beta
            self.objective = self.build_objective(self.args.params)
        logps = self.logps_of(model, inputs)
        mask = inputs["completion_mask"].to(logps.dtype)
        summed, ref = (logps * mask).sum(-1), (inputs["ref_logps"] * mask).sum(-1)
        (chosen, rejected), (ref_chosen, ref_rejected) = summed.chunk(2), ref.chunk(2)
        lengths_chosen, lengths_rejected = mask.sum(-1).chunk(2)
        decided = inputs["decided"].chunk(2)[0]
        if decided.any():
            batch = PreferenceLogps(chosen[decided], rejected[decided], ref_chosen[decided], ref_rejected[decided],
                                    lengths_chosen[decided], lengths_rejected[decided])
            loss, parts = self.objective(batch)
        else:  # every pair tied: nothing to learn, but every process still takes part in the backward
            loss, parts = summed.sum() * 0.0, {}

        kl = (summed - ref).detach()  # Σ_t log π − log π_ref per completion
        reward_chosen, reward_rejected = beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()
        metrics = {
            "objective/kl": kl.mean(), "objective/entropy": -summed.detach().mean(),
            "objective/non_score_reward": (-beta * kl).mean(),
            "rewards/chosen": reward_chosen.mean(), "rewards/rejected": reward_rejected.mean(),
            "rewards/margins": (reward_chosen - reward_rejected).mean(),
            "rewards/accuracies": (reward_chosen > reward_rejected).float().mean(),
            "logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean(), "beta": beta,
        }
        if "scores" in inputs:
            metrics["objective/rlhf_reward"] = (inputs["scores"] - beta * kl).mean()
        if len(parts) > 1:
            metrics.update({f"loss/{name}": value.detach() for name, value in parts.items()})
        self.record(metrics)
        return (loss, None) if return_outputs else loss


@hookimpl
def register_methods(register):
    register("method.online_dpo", Method(config=OnlineDPOConfig, trainer=OnlineDPOTrainer, loss_family="dpo",
                                         summary="Online DPO: self-sampled pairs ranked by a judge, composable dpo.* losses"))
