"""SimPO: Simple Preference Optimization, a reference-free reward margin on per-token log-probs.

Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6.
With ā = log π(y|x)/|y| the length-normalised log-prob, γ = simpo_gamma the target reward
margin and ε the label smoothing (TRL 1.16's):

    z = β(ā_c − ā_r) − γ,    ℓ = −(1 − ε)·log σ(z) − ε·log σ(−z)

The paper trains it alone (CPOConfig.cpo_alpha=0); with cpo_alpha > 0 it is CPO-SimPO. SimPO's
β is large (2–10) and γ about β/4 (TRL's defaults: β = 0.1, γ = 0.5). AlphaPO's reward shape is
``cpo.alphapo`` (SimPO at alpha = 0).
"""

from functools import partial

import attrs

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import finite, in_range, positive

from ._reference_free import reward_metrics, shaped_logps, smoothed_sigmoid_loss


@attrs.frozen
class SimPOParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    simpo_gamma: float = attrs.field(default=0.5, validator=finite)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))


def cpo_simpo(batch: PreferenceLogps, p: SimPOParams):
    _, (u_c, u_r) = shaped_logps(batch, p, averaged=True)
    return smoothed_sigmoid_loss(p.beta * (u_c - u_r) - p.simpo_gamma, p.label_smoothing)


@hookimpl
def register_losses(register):
    register("cpo.simpo", cpo_simpo, params=SimPOParams, consumes=PreferenceLogps,
             metrics=partial(reward_metrics, averaged=True))
