"""AlphaPO: SimPO's reward margin on an α-shaped reward.

Gupta et al. 2025, "AlphaPO: Reward Shape Matters for LLM Alignment", eq. 7. With
ā = log π(y|x)/|y|, the reward u = (1 − π(y|x)^(−α/|y|))/α = (1 − e^(−αā))/α, γ = simpo_gamma
and ε the label smoothing:

    z = β(u_c − u_r) − γ,    ℓ = −(1 − ε)·log σ(z) − ε·log σ(−z)

α → 0 gives SimPO's u = ā; α > 0 flattens the reward of unlikely completions, so the rejected
likelihood is pushed down less steeply (the paper uses α around 0.1–0.25). TRL 1.16's
``loss_type='alphapo'`` is this loss with CPOConfig.cpo_alpha = 0 and ``alpha`` from the config
(default 0: SimPO itself).
"""

from functools import partial

import attrs

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import finite

from ._reference_free import reward_metrics
from .cpo_simpo import SimPOParams, cpo_simpo


@attrs.frozen
class AlphaPOParams(SimPOParams):
    alpha: float = attrs.field(default=0.0, validator=finite)


def cpo_alphapo(batch: PreferenceLogps, p: AlphaPOParams):
    return cpo_simpo(batch, p)  # SimPO's margin, on the rewards shaped by p.alpha


@hookimpl
def register_losses(register):
    # cpo_alpha=0.0: the weight CPOConfig gives its NLL term with this loss (as TRL 1.16 does)
    register("cpo.alphapo", cpo_alphapo, params=AlphaPOParams, consumes=PreferenceLogps,
             metrics=partial(reward_metrics, averaged=True), cpo_alpha=0.0)
