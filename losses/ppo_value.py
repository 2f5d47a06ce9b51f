"""PPO's clipped value loss, per token.

The critic loss of PPO as used for language models (Ziegler et al. 2019, "Fine-Tuning Language
Models from Human Preferences"; Huang et al. 2022, "The 37 Implementation Details of PPO",
detail 9): with value estimates V_t, their rollout-time values V_old,t and targets R_t = A_t + V_old,t,

    L_t = ½ · max((V_t − R_t)², (clip(V_t, V_old,t − ε_v, V_old,t + ε_v) − R_t)²)

ε_v = cliprange_value (0.2). Like the policy clip, the max means the critic gains nothing from
moving further than ε_v from its rollout-time estimate. Input: a
:class:`~plait.engine.batches.ValueTokens`; returns ``[B, T]``, averaged by the method over completion tokens.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import ValueTokens
from plait.params import positive


@attrs.frozen
class PPOValueParams:
    cliprange_value: float = attrs.field(default=0.2, validator=positive)


def ppo_value(batch: ValueTokens, p: PPOValueParams) -> torch.Tensor:
    clipped = batch.old_values + torch.clamp(batch.values - batch.old_values, -p.cliprange_value, p.cliprange_value)
    return 0.5 * torch.maximum((batch.values - batch.returns) ** 2, (clipped - batch.returns) ** 2)


@hookimpl
def register_losses(register):
    register("ppo.value", ppo_value, params=PPOValueParams, consumes=ValueTokens, output="token",
             doc="PPO clipped value loss: ½·max((V−R)², (clip(V, V_old±ε)−R)²) per token")
