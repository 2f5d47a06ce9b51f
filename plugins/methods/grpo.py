"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", §4).

For each prompt the policy samples ``num_generations`` completions; reward functions score
them; an advantage estimator turns the scores into advantages relative to the group (no value
network); a clipped policy-gradient loss of the ``grpo.*`` family (``dapo`` by default, or any
registered one, composed by name) takes the step. The sampling, scoring and buffer re-use live
in :class:`plait.online.OnlineTrainer`; this module only says which estimator and which losses.
"""

from __future__ import annotations

import attrs
import torch

from plait import Method, PlaitError, hookimpl
from plait.batches import PolicyTokens
from plait.config import method_config
from plait.online import OnlineParams, OnlineTrainer
from plait.params import non_negative, positive

# TRL's scale_rewards values -> the registered estimator that implements each
SCALE_REWARDS = {"group": "advantage.group", True: "advantage.group", "batch": "advantage.batch",
                 "none": "advantage.none", False: "advantage.none"}
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
# Method knobs handed to every loss term that accepts them (like DPO's beta)
SHARED_LOSS_FIELDS = ("epsilon", "epsilon_high", "delta", "beta", "importance_sampling_level", "use_bias_correction_kl",
                      "sapo_temperature_pos", "sapo_temperature_neg",
                      "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


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
    ``importance_sampling_level`` None lets each loss type use its own (token for every built-in one, as
    in TRL 1.16). ``use_bias_correction_kl`` weights the β·KL term by the importance ratio (TRL 1.16's default).
    """

    default_loss = "dapo"
    scale_rewards: str | bool = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    advantage_estimator: str | dict | None = None
    importance_sampling_level: str | None = attrs.field(default=None, validator=_optional_level)
    use_bias_correction_kl: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    sapo_temperature_pos: float = attrs.field(default=1.0, validator=positive)
    sapo_temperature_neg: float = attrs.field(default=1.05, validator=positive)
    vespo_k_pos: float = attrs.field(default=2.0, validator=non_negative)
    vespo_lambda_pos: float = attrs.field(default=3.0, validator=positive)
    vespo_k_neg: float = attrs.field(default=3.0, validator=non_negative)
    vespo_lambda_neg: float = attrs.field(default=2.0, validator=positive)

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

    def advantages(self, rewards, *, batch, old_logps, ref_logps) -> torch.Tensor:
        return self.estimator(self.gather_rollout(rewards))

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
