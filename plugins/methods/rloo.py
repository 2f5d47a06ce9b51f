"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", §3.2).

Same sampling and scoring as GRPO (:class:`plait.online.chassis.OnlineTrainer`), with RLOO's own
choices: the reward is penalised by the sequence-level KL to the reference,

    R_i ← R_i − β·Σ_t (log π_old − log π_ref)        (β = beta, default 0.05),

optionally clipped (``reward_clip_range``), each completion's baseline is the mean penalised
reward of the other completions of its prompt (``advantage.rloo``, optionally z-scored over the
batch with ``normalize_advantages``), and the loss is the sequence-level PPO clip ``rloo.clip``.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from plait import Method, PlaitError, hookimpl
from plait.engine.batches import PolicyTokens, Rollout
from plait.engine.config import method_config
from plait.online.scoring import total_reward
from plait.online.chassis import OnlineParams, OnlineTrainer
from plait.params import non_negative

SHARED_LOSS_FIELDS = ("epsilon", "epsilon_high", "delta")


def _clip_range(instance, attribute, value) -> None:
    if value is None:
        return
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
            and value[0] < value[1]):
        raise ValueError(f"{attribute.name}={value!r} must be [low, high] with low < high, or None")


@attrs.define
class RLOOParams(OnlineParams):
    """RLOO's knobs (plus the shared online ones); names and defaults follow TRL's RLOOConfig."""
    field_help: ClassVar[dict[str, str]] = {
        "num_generations": "completions sampled per prompt (the leave-one-out baseline needs 2 or more)",
        "beta": "weight of the KL penalty to the reference, folded into the reward",
        "normalize_advantages": "z-score the advantages over the batch",
        "reward_clip_range": "[low, high] clip of each KL-penalised reward, before the baseline (null: none)",
    }

    default_loss = "rloo.clip"
    num_generations: int = attrs.field(default=2, validator=OnlineParams.__attrs_attrs__.num_generations.validator)
    beta: float = attrs.field(default=0.05, validator=non_negative)
    normalize_advantages: bool = False
    reward_clip_range: list | tuple | None = attrs.field(default=None, validator=_clip_range)

    def advantage_spec(self) -> dict:
        return {"name": "advantage.rloo", "normalize": self.normalize_advantages}


RLOOConfig = method_config(
    "RLOOConfig", RLOOParams,
    defaults={"learning_rate": 1e-6, "logging_steps": 10, "remove_unused_columns": False},
)


class RLOOTrainer(OnlineTrainer):
    """REINFORCE Leave-One-Out with a KL-penalised reward and a sequence-level clipped loss."""

    method = "rloo"
    config_class = RLOOConfig
    loss_family = "rloo"
    shared_loss_fields = SHARED_LOSS_FIELDS
    prompt_collator = "collator.prompt_only"

    def needs_old_logps(self) -> bool:
        return self.args.params.beta > 0 or super().needs_old_logps()  # the KL penalty uses log π_old

    def advantages(self, rewards, *, batch, old_logps, ref_logps) -> torch.Tensor:
        p = self.args.params
        reward = total_reward(self.gather_rollout(rewards))
        if p.reward_clip_range is not None:
            reward = reward.clamp(*p.reward_clip_range)
        if p.beta > 0:
            if ref_logps is None:
                raise PlaitError("RLOO with beta > 0 needs reference log-probs; none were computed")
            mask = batch["completion_mask"].to(old_logps.dtype)
            kl = ((old_logps - ref_logps) * mask).sum(-1)
            kl = self.accelerator.gather(kl).float().cpu()
            reward = reward - p.beta * kl
            self.record({"kl_penalty": kl.mean(), "reward_penalised": reward.nanmean()})
        rollout = Rollout(rewards=reward.unsqueeze(-1), weights=torch.ones(1), group_size=self.group_size)
        return self.estimator(rollout)

    def clip_ratio(self, batch: PolicyTokens) -> torch.Tensor:
        mask = batch.mask.to(batch.logps.dtype)
        return torch.exp(((batch.logps.detach() - batch.old_logps) * mask).sum(-1, keepdim=True))


@hookimpl
def register_methods(register):
    register("method.rloo", Method(config=RLOOConfig, trainer=RLOOTrainer, loss_family="rloo",
                                   summary="REINFORCE Leave-One-Out with a KL-penalised reward"))
