"""Generalised advantage estimation over the turns of multi-turn episodes, with a group baseline.

Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", eq. 16, with turns as the time steps (verl RFC #7244; Zhou et al. 2024, "ArCHer",
turn-level critics) and, without a critic, a Monte-Carlo value: V_{g,k} is the mean discounted
return from turn k over the scored episodes of the group g that reach turn k (GiGPO's step-level
baseline, Feng et al. 2025). With r_{i,k} as in ``advantage.turn_return`` (per-turn rewards, the
episode reward on the last turn K_i − 1):

    δ_{i,k} = r_{i,k} + γ·V_{g,k+1} − V_{g,k}        V_{g,K_i} = 0: nothing follows the last turn
    A_{i,k} = Σ_{l=0}^{K_i−1−k} (γλ)^l·δ_{i,k+l}

``scale`` divides A_{i,k} by std_g(G_{·,k}) + ε, the spread of the returns at turn k, so λ = 1 (where
the sum telescopes to G_{i,k} − V_{g,k}) is ``advantage.turn_return`` exactly; λ < 1 trades the
variance of later rewards for the bias of the group's values. Every token of turn k gets A_{i,k}.
"""

import attrs
import torch

from plait import hookimpl
from plait.engine.batches import Rollout
from plait.online.scoring import per_token, turn_baselines
from plait.params import in_range, positive


@attrs.frozen
class TurnGAEParams:
    gamma: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    lam: float = attrs.field(default=0.95, validator=in_range(0.0, 1.0))
    scale: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    epsilon: float = attrs.field(default=1e-4, validator=positive)


def turn_gae_advantage(rollout: Rollout, p: TurnGAEParams) -> torch.Tensor:
    turns, _, counted, value, std = turn_baselines(rollout, p.gamma, "advantage.turn_gae")
    value = torch.where(counted, value, 0.0)
    # The next turn's value, 0 past each row's last turn (the group's later turns are other episodes').
    next_value = torch.cat([value[:, 1:] * turns.present[:, 1:], value.new_zeros(value.shape[0], 1)], dim=1)
    deltas = turns.rewards + p.gamma * next_value - value
    advantage = torch.zeros_like(deltas)
    running = deltas.new_zeros(deltas.shape[0])
    for k in reversed(range(deltas.shape[1])):
        running = (deltas[:, k] + p.gamma * p.lam * running) * counted[:, k]
        advantage[:, k] = running
    if p.scale:
        advantage = advantage / (std + p.epsilon)
    return per_token(advantage, turns.index, rollout.mask)


@hookimpl
def register_advantage_estimators(register):
    register("advantage.turn_gae", turn_gae_advantage, params=TurnGAEParams, token_level=True, turn_level=True,
             doc="GAE over turns with the group's mean return per turn as the value (multi-turn credit)")
