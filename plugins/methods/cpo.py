"""CPO: Contrastive Preference Optimization (Xu et al. 2024), with SimPO and AlphaPO as loss types.

A preference loss on the policy's own log-probs (``cpo.sigmoid``, ``cpo.hinge``, ``cpo.ipo``,
``cpo.simpo``, ``cpo.alphapo``, or any loss composed by name) plus ``cpo_alpha`` times the NLL
of the chosen completions (``dpo.sft``, CPO's behaviour-cloning term). No reference model.
Data, collation and the policy's log-probs are the reference-free preference methods'
(:mod:`plait.plugins.methods._preference`); TRL 1.16's experimental CPOConfig fields.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from plait import Method, PlaitError, hookimpl
from plait.engine.config import method_config
from plait.params import finite, in_range, non_negative

from ._preference import CONFIG_DEFAULTS, PreferenceParams, PreferenceTrainer


def _optional(validator):
    return attrs.validators.optional(validator)


@attrs.define
class CPOParams(PreferenceParams):
    """CPO's knobs, TRL 1.16's names. ``cpo_alpha`` None means TRL's weight: 1.0, or 0.0 with a loss
    registered with ``cpo_alpha=0.0`` (``cpo.alphapo``, as TRL sets it for loss_type='alphapo').
    ``alpha`` shapes the rewards of every CPO loss that takes it (AlphaPO's u = (1 − e^(−αℓ))/α)."""

    field_help: ClassVar[dict[str, str]] = {
        "label_smoothing": "probability that a pair's preference label is flipped (0 to 0.5; losses that take it)",
        "cpo_alpha": "weight of the NLL term on chosen completions (null: 1.0, or 0 with alphapo; 0: no NLL)",
        "simpo_gamma": "SimPO's target reward margin gamma (simpo, alphapo)",
        "alpha": "AlphaPO's reward shape: u = (1 - e^(-alpha * logp)) / alpha (0: the log-prob itself)",
    }

    default_loss = "sigmoid"
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5))
    cpo_alpha: float | None = attrs.field(default=None, validator=_optional(non_negative))
    simpo_gamma: float = attrs.field(default=0.5, validator=finite)
    alpha: float = attrs.field(default=0.0, validator=finite)


CPOConfig = method_config("CPOConfig", CPOParams, defaults=CONFIG_DEFAULTS)


class CPOTrainer(PreferenceTrainer):
    """Contrastive preference optimisation: the policy alone, no reference model."""

    method = "cpo"
    config_class = CPOConfig
    nll_loss = "dpo.sft"
    shared = ("beta", "label_smoothing", "simpo_gamma", "alpha")

    def loss_specs(self, p) -> list[dict]:
        specs = p.loss_specs()
        first = self.plugins.losses.get(specs[0]["name"], family=self.method)
        declared = first.options.cpo_alpha  # AlphaPO declares 0: no NLL term unless the config asks
        self.cpo_alpha = p.cpo_alpha if p.cpo_alpha is not None else 1.0 if declared is None else declared
        return specs + ([{"name": self.nll_loss, "weight": self.cpo_alpha}] if self.cpo_alpha else [])

    def validate(self, args) -> None:
        super().validate(args)
        if args.params.alpha:
            unshaped = [t.name for t in self.objective.terms
                        if t.name != self.nll_loss
                        and (t.component.params is None or "alpha" not in attrs.fields_dict(t.component.params))]
            if unshaped:
                raise PlaitError(f"alpha={args.params.alpha} shapes the rewards of the CPO losses that take it, not "
                                 f"of {unshaped}; for SimPO with AlphaPO's reward use loss_type='alphapo' "
                                 "(cpo_alpha=1.0 keeps the NLL term), or set alpha=0")


@hookimpl
def register_methods(register):
    register("method.cpo", Method(config=CPOConfig, trainer=CPOTrainer, loss_family="cpo",
                                  summary="CPO / SimPO / AlphaPO: reference-free preference losses + cpo_alpha x NLL"))
