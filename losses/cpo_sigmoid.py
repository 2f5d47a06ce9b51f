"""CPO's sigmoid loss: DPO's logistic loss on the policy's own log-probs, no reference.

Xu et al. 2024, "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance
in Machine Translation", eq. 3 (the preference term; the NLL term is ``dpo.sft``, weighted by
CPOConfig.cpo_alpha). With ℓ = log π(y|x) summed over the completion, u = ℓ (or AlphaPO's
(1 − e^(−αℓ))/α when α ≠ 0: TRL 1.16 applies ``alpha`` to every CPO loss) and ε the label
smoothing:

    ℓ = −(1 − ε)·log σ(β(u_c − u_r)) − ε·log σ(−β(u_c − u_r))

β (default 0.1) scales the margin; with ε > 0 the loss is least at σ(βΔ) = 1 − ε, not monotone.
"""

from functools import partial

import attrs

from plait import hookimpl
from plait.engine.batches import PreferenceLogps
from plait.params import finite, in_range, positive

from ._reference_free import reward_metrics, shaped_logps, smoothed_sigmoid_loss


@attrs.frozen
class CPOSigmoidParams:
    beta: float = attrs.field(default=0.1, validator=positive)
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))
    alpha: float = attrs.field(default=0.0, validator=finite)


def cpo_sigmoid(batch: PreferenceLogps, p: CPOSigmoidParams):
    _, (u_c, u_r) = shaped_logps(batch, p, averaged=False)
    return smoothed_sigmoid_loss(p.beta * (u_c - u_r), p.label_smoothing)


@hookimpl
def register_losses(register):
    register("cpo.sigmoid", cpo_sigmoid, params=CPOSigmoidParams, consumes=PreferenceLogps,
             metrics=partial(reward_metrics, averaged=False))
