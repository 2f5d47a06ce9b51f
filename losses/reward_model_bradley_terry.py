"""Reward-model training with the Bradley-Terry pairwise loss.

Bradley & Terry 1952; Ouyang et al. 2022, "Training language models to follow instructions
with human feedback", eq. 1. With r the scalar rewards of the chosen and rejected completions,
m an optional per-pair margin from the data and c = center_rewards_coefficient:

    ℓ = −log σ(r_c − r_r − m) + c·(r_c + r_r)²

The margin asks for a wider gap on pairs rated far apart (Llama 2); the centring term
(Eisenstein et al. 2023, "Helping or Herding? Reward Model Ensembles Mitigate but do not
Eliminate Reward Hacking") pins the rewards' mean near zero, which BT leaves free. c ≈ 0.01.
"""

import attrs
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PairwiseRewards
from plait.params import non_negative


@attrs.frozen
class BradleyTerryParams:
    center_rewards_coefficient: float = attrs.field(default=0.0, validator=non_negative)


def reward_model_bradley_terry(batch: PairwiseRewards, p: BradleyTerryParams):
    gap = batch.chosen_rewards - batch.rejected_rewards - batch.margin
    return -F.logsigmoid(gap) + p.center_rewards_coefficient * (batch.chosen_rewards + batch.rejected_rewards) ** 2


@hookimpl
def register_losses(register):
    register("reward_model.bradley_terry", reward_model_bradley_terry, params=BradleyTerryParams,
             consumes=PairwiseRewards)
