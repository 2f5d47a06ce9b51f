"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", §4).

For each prompt the policy samples ``num_generations`` completions; reward functions score
them; an advantage estimator turns the scores into advantages relative to the group (no value
network); a clipped policy-gradient loss of the ``grpo.*`` family (``dapo`` by default, or any
registered one, composed by name) takes the step. The sampling, scoring and buffer re-use live
in :class:`plait.online.chassis.OnlineTrainer`; this module only says which estimator and which losses.

TRL's entropy fields map onto losses of the same family: ``entropy_coef`` ≠ 0 adds
``grpo.entropy_bonus`` weighted by it, ``use_adaptive_entropy`` adds ``grpo.adaptive_entropy_bonus``
(whose coefficient is training state, saved with checkpoints); ``top_entropy_quantile`` and
``off_policy_mask_threshold`` reach every loss that takes them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from accelerate.utils import extract_model_from_parallel

from plait import Method, PlaitError, hookimpl
from plait.engine.batches import PolicyTokens, gather_ragged
from plait.engine.config import method_config
from plait.engine.logprobs import fp32_projection
from plait.online.chassis import OnlineParams, OnlineTrainer
from plait.params import finite, in_range, non_negative, positive

# TRL's scale_rewards values -> the registered estimator that implements each
SCALE_REWARDS = {"group": "advantage.group", True: "advantage.group", "batch": "advantage.batch",
                 "none": "advantage.none", False: "advantage.none"}
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
# Method knobs handed to every loss term that accepts them (like DPO's beta)
SHARED_LOSS_FIELDS = ("epsilon", "epsilon_high", "delta", "beta", "importance_sampling_level", "use_bias_correction_kl",
                      "sapo_temperature_pos", "sapo_temperature_neg",
                      "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                      "top_entropy_quantile", "off_policy_mask_threshold", "entropy_coef", "entropy_target",
                      "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")


def _optional_level(instance, attribute, value) -> None:
    if value not in (None, "token", "sequence"):
        raise ValueError(f"{attribute.name}={value!r} must be 'token', 'sequence' or None (the loss type's own)")


@attrs.define
class GRPOParams(OnlineParams):
    """GRPO's knobs (plus the shared online ones); names and defaults follow TRL's GRPOConfig.

    ``loss_type`` names one or more ``grpo.*`` losses (``loss_weights`` for several), or ``loss``
    gives plait's list of ``{name, weight, **params}``. ``scale_rewards`` picks the advantage
    estimator (group / batch / none), ``multi_objective_aggregation="normalize_then_sum"`` is
    GDPO, and ``advantage_estimator`` names any registered one (``{name, **params}`` too).
    ``importance_sampling_level`` is token by default for every loss type, luspo too, as in TRL 1.16
    (None lets each loss type use its own). ``use_bias_correction_kl`` weights the β·KL term by the importance ratio (TRL 1.16's default).

    ``entropy_coef`` c ≠ 0 adds the entropy bonus −c·H̄ (``grpo.entropy_bonus``); with
    ``use_adaptive_entropy`` c is the starting coefficient of ``grpo.adaptive_entropy_bonus``, moved
    by ``entropy_coef_delta`` within [``entropy_coef_min``, ``entropy_coef_max``] each optimizer step
    and applied only while the entropy is at most ``entropy_target``. ``top_entropy_quantile`` ρ < 1
    keeps the policy term (and the bonus) of the top-ρ tokens by entropy only.
    ``off_policy_mask_threshold`` δ drops negative-advantage sequences that drifted more than δ
    from the sampler. ``cast_lm_head_to_fp32`` projects the output layer in float32 when computing
    log-probs and entropies (policy and reference), whatever the autocast.
    """
    field_help: ClassVar[dict[str, str]] = {
        "scale_rewards": "the advantage's scale: 'group' std, 'batch' std or 'none' (true: 'group')",
        "multi_objective_aggregation": "several rewards: 'sum_then_normalize', or 'normalize_then_sum' (GDPO)",
        "advantage_estimator": "a registered advantage estimator, by name or {name, ...params} (plait list advantages)",
        "importance_sampling_level": "importance ratios per 'token' or per 'sequence' (GSPO); null: each loss's own",
        "use_bias_correction_kl": "weight the beta*KL term by the importance ratio",
        "sapo_temperature_pos": "SAPO's gate temperature for positive advantages",
        "sapo_temperature_neg": "SAPO's gate temperature for negative advantages",
        "vespo_k_pos": "VESPO's shape k for positive advantages",
        "vespo_lambda_pos": "VESPO's scale lambda for positive advantages",
        "vespo_k_neg": "VESPO's shape k for negative advantages",
        "vespo_lambda_neg": "VESPO's scale lambda for negative advantages",
        "top_entropy_quantile": "train only the top-rho tokens by entropy (1.0: every token)",
        "entropy_coef": "entropy bonus coefficient c: the loss gains -c times the mean entropy (0: off)",
        "use_adaptive_entropy": "move entropy_coef each step toward entropy_target (adaptive entropy bonus)",
        "entropy_target": "with use_adaptive_entropy: the bonus applies while the entropy is at most this",
        "entropy_coef_delta": "with use_adaptive_entropy: the coefficient's change per optimizer step",
        "entropy_coef_min": "with use_adaptive_entropy: the coefficient's lower bound",
        "entropy_coef_max": "with use_adaptive_entropy: the coefficient's upper bound",
        "off_policy_mask_threshold": "drop negative-advantage sequences that drifted more than this from the sampler",
        "cast_lm_head_to_fp32": "compute the output layer in float32 for log-probs and entropies",
    }

    default_loss = "dapo"
    scale_rewards: str | bool = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    advantage_estimator: str | dict | None = None
    importance_sampling_level: str | None = attrs.field(default="token", validator=_optional_level)
    use_bias_correction_kl: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    sapo_temperature_pos: float = attrs.field(default=1.0, validator=positive)
    sapo_temperature_neg: float = attrs.field(default=1.05, validator=positive)
    vespo_k_pos: float = attrs.field(default=2.0, validator=non_negative)
    vespo_lambda_pos: float = attrs.field(default=3.0, validator=positive)
    vespo_k_neg: float = attrs.field(default=3.0, validator=non_negative)
    vespo_lambda_neg: float = attrs.field(default=2.0, validator=positive)
    top_entropy_quantile: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    entropy_coef: float = attrs.field(default=0.0, validator=finite)
    use_adaptive_entropy: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    entropy_target: float = attrs.field(default=0.2, validator=finite)
    entropy_coef_delta: float = attrs.field(default=0.005, validator=non_negative)
    entropy_coef_min: float = attrs.field(default=0.0, validator=finite)
    entropy_coef_max: float = attrs.field(default=1.0, validator=finite)
    off_policy_mask_threshold: float | None = attrs.field(default=None, validator=attrs.validators.optional(finite))
    cast_lm_head_to_fp32: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.scale_rewards not in SCALE_REWARDS:
            raise PlaitError(f"GRPOConfig: scale_rewards={self.scale_rewards!r} is not valid; use 'group' (or True), "
                             "'batch', or 'none' (or False)")
        if self.multi_objective_aggregation not in AGGREGATIONS:
            raise PlaitError(f"GRPOConfig: multi_objective_aggregation={self.multi_objective_aggregation!r} is not "
                             f"valid; use one of {list(AGGREGATIONS)}")
        if self.advantage_estimator is not None and self.multi_objective_aggregation != "sum_then_normalize":
            raise PlaitError("GRPOConfig: advantage_estimator names the estimator itself; drop "
                             "multi_objective_aggregation or advantage_estimator")

    def loss_specs(self) -> list[dict]:
        """The listed losses, plus the entropy bonus the entropy fields ask for."""
        specs = super().loss_specs()
        if self.use_adaptive_entropy:  # its parameters are the shared entropy fields
            specs.append({"name": "grpo.adaptive_entropy_bonus"})
        elif self.entropy_coef != 0.0:
            specs.append({"name": "grpo.entropy_bonus", "weight": self.entropy_coef})
        return specs

    def advantage_spec(self) -> str | dict:
        if self.advantage_estimator is not None:
            return self.advantage_estimator
        if self.multi_objective_aggregation == "normalize_then_sum":
            return "advantage.normalize_then_sum"
        return SCALE_REWARDS[self.scale_rewards]


GRPOConfig = method_config(
    "GRPOConfig", GRPOParams,
    defaults={"learning_rate": 1e-6, "logging_steps": 10, "remove_unused_columns": False},
)


class GRPOTrainer(OnlineTrainer):
    """Group Relative Policy Optimization with ``grpo.*`` losses and a registered advantage estimator."""

    method = "grpo"
    config_class = GRPOConfig
    loss_family = "grpo"
    shared_loss_fields = SHARED_LOSS_FIELDS
    prompt_collator = "collator.prompt_only"

    def advantages(self, rewards, *, batch, old_logps, ref_logps) -> torch.Tensor:
        return self.estimator(self.gather_rollout(rewards, batch))  # a turn-level one reads the batch's turns

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's helper of the same name: the counted tokens (``mask``) whose entropy is at least the
        ``threshold`` quantile of every counted token's on every process, as a bool ``[B, T]`` mask (the cut
        ``top_entropy_quantile`` ρ applies with threshold 1 − ρ; Wang et al. 2025, "Beyond the 80/20 Rule")."""
        counted = mask.bool()
        everyone = gather_ragged(self.accelerator, entropies.detach()[counted].float())
        if everyone.numel() == 0:
            return torch.zeros_like(counted)
        return (entropies.float() >= torch.quantile(everyone, threshold)) & counted

    def token_logprobs(self, model, input_ids, attention_mask=None, **kwargs):
        return super().token_logprobs(model, input_ids, attention_mask,
                                      cast_lm_head_to_fp32=self.args.params.cast_lm_head_to_fp32, **kwargs)

    def after_init(self) -> None:
        super().after_init()
        if self.args.params.cast_lm_head_to_fp32:  # refuse an output layer it cannot upcast before training
            fp32_projection(extract_model_from_parallel(self.model_wrapped).get_output_embeddings())

    # -- losses that keep state across optimizer steps (the adaptive entropy coefficient) --------
    # A loss's params may define end_optimizer_step(reduce) -> metrics, state_dict() and
    # load_state_dict(state): called after each optimizer step's last micro-batch, and saved and
    # restored with checkpoints.
    def _stateful_terms(self) -> dict[str, Any]:
        return {f"{i}:{term.name}": term.params for i, term in enumerate(self.objective.terms)
                if hasattr(term.params, "end_optimizer_step")}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.model.training and self.accelerator.sync_gradients:  # this optimizer step's last micro-batch
            for params in self._stateful_terms().values():
                self.record(params.end_optimizer_step(lambda stats: self.accelerator.reduce(stats, "sum")))
        return out

    def resume_state(self) -> dict:
        state = super().resume_state()
        losses = {key: params.state_dict() for key, params in self._stateful_terms().items()}
        return {**state, "loss_state": losses} if losses else state

    def load_resume_state(self, state: dict) -> None:
        super().load_resume_state(state)
        for key, params in self._stateful_terms().items():
            if key in state.get("loss_state", {}):
                params.load_state_dict(state["loss_state"][key])

    def clip_ratio(self, batch: PolicyTokens) -> torch.Tensor:
        level = self.args.params.importance_sampling_level or "token"
        delta = batch.logps.detach() - batch.old_logps
        if level == "sequence":
            mask = batch.mask.to(delta.dtype)
            delta = ((delta * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        return torch.exp(delta)


@hookimpl
def register_methods(register):
    register("method.grpo", Method(config=GRPOConfig, trainer=GRPOTrainer, loss_family="grpo",
                                   summary="Group Relative Policy Optimization with grpo.* losses and reward plugins"))
