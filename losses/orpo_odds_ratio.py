"""ORPO's odds-ratio term: prefer the chosen completion by the odds of its per-token likelihood.

Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", eqs. 4–7.
With ā = log π(y|x)/|y| the per-token average log-prob and odds(y|x) = P/(1 − P) for P = e^ā:

    log odds = ā − log(1 − e^ā),    ℓ_OR = −λ·log σ(log odds_c − log odds_r)

λ = beta (ORPOConfig.beta, default 0.1). ORPO's loss is ``orpo.nll`` + this term. ā is clamped
just below 0 (a completion of probability 1 has infinite odds), with zero gradient there.
"""

import math

import attrs
import torch
import torch.nn.functional as F

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import positive

from ._reference_free import policy_logps, reward_metrics


@attrs.frozen
class OddsRatioParams:
    beta: float = attrs.field(default=0.1, validator=positive)


def log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    a = mean_logps.clamp(max=-torch.finfo(mean_logps.dtype).eps)
    # log(1 − e^a), accurate both near 0 and far below it (Mächler 2012, "Accurately computing log(1 − exp(−|a|))")
    log1mexp = torch.where(a > -math.log(2), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))
    return a - log1mexp


def log_odds_ratio(batch: PreferenceLogps) -> torch.Tensor:
    chosen, rejected = policy_logps(batch, averaged=True)
    return log_odds(chosen) - log_odds(rejected)


def orpo_odds_ratio(batch: PreferenceLogps, p: OddsRatioParams):
    return -p.beta * F.logsigmoid(log_odds_ratio(batch))


def metrics(batch: PreferenceLogps, p: OddsRatioParams):
    ratio = log_odds_ratio(batch)
    return {**reward_metrics(batch, p, averaged=True),
            "log_odds_ratio": F.logsigmoid(ratio), "log_odds_chosen": ratio}


@hookimpl
def register_losses(register):
    register("orpo.odds_ratio", orpo_odds_ratio, params=OddsRatioParams, consumes=PreferenceLogps,
             monotone="non_increasing_in_margin", metrics=metrics)
