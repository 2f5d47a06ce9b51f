"""Turn-level credit from discounted per-turn returns, normalised per turn index within the group.

Multi-turn episodes whose environment rewards each model turn (``Step(reward=...)``,
:mod:`plait.online.rollouts`): the tokens of turn k are credited with what follows them, not with
the rewards of turns before them. Feng et al. 2025, "Group-in-Group Policy Optimization for LLM
Agent Training" (GiGPO): step-level advantages from discounted returns normalised within a
group of steps; here the group of turn k is turn k of the prompt's other episodes (as in verl's
RFC #7244 on multi-turn credit and Zeng et al. 2025, "Reinforcing Multi-Turn Reasoning in LLM
Agents via Turn-Level Credit Assignment", MT-GRPO). With r_{i,k} the reward of turn k of episode i
(0 where none; the episode reward R_i is added on its last turn K_i − 1):

    G_{i,k} = Σ_{j=k}^{K_i−1} γ^{j−k}·r_{i,j}
    A_{i,k} = (G_{i,k} − mean_g(G_{·,k})) / (std_g(G_{·,k}) + ε)

over the scored episodes of i's group that reach turn k (``scale=False``: centring only). Every
token of turn k gets A_{i,k}; tokens outside model turns (an environment's) get 0. An episode
without per-turn rewards keeps R_i on its last turn: with γ = 1 and groups whose episodes have as
many turns, this is ``advantage.group``. A turn that no other episode of the group reaches is its
own baseline (A = 0). Reads ``turn_rewards`` and ``turn_index`` (or ``mask``: one turn).
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import Rollout
from plait.online.scoring import per_token, turn_baselines
from plait.params import in_range, positive


@attrs.frozen
class TurnReturnParams:
    gamma: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    scale: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    epsilon: float = attrs.field(default=1e-4, validator=positive)


def turn_return_advantage(rollout: Rollout, p: TurnReturnParams) -> torch.Tensor:
    turns, returns, counted, mean, std = turn_baselines(rollout, p.gamma, "advantage.turn_return")
    advantage = returns - mean
    if p.scale:
        advantage = advantage / (std + p.epsilon)
    advantage = torch.where(counted, advantage, 0.0)  # unscored rows carry no signal
    return per_token(advantage, turns.index, rollout.mask)


@hookimpl
def register_advantage_estimators(register):
    register("advantage.turn_return", turn_return_advantage, params=TurnReturnParams, token_level=True, turn_level=True,
             doc="Per-turn discounted returns, normalised per turn within the group (multi-turn credit)")
