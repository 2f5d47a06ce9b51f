"""ORPO: Monolithic Preference Optimization without Reference Model (Hong et al. 2024).

One objective, no reference and no SFT stage before it: the NLL of the chosen sequence plus λ
times an odds-ratio term on the per-token log-probs (``orpo.nll`` + ``orpo.odds_ratio``, λ =
``beta``). Data, collation and the policy's log-probs are the reference-free preference
methods' (:mod:`plait.plugins.methods._preference`); TRL 1.16's experimental ORPOConfig fields.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from plait import Method, hookimpl
from plait.engine.config import method_config

from ._preference import CONFIG_DEFAULTS, PreferenceParams, PreferenceTrainer


@attrs.define
class ORPOParams(PreferenceParams):
    """ORPO's knobs: ``beta`` is the paper's λ, the weight of the odds-ratio term (TRL's default 0.1).
    plait's ``loss``/``loss_type`` may compose other losses by name; the default is ORPO's two."""

    field_help: ClassVar[dict[str, str]] = {
        "beta": "ORPO's lambda: weight of the odds-ratio term added to the chosen completion's NLL",
    }

    default_loss = ("nll", "odds_ratio")


ORPOConfig = method_config("ORPOConfig", ORPOParams, defaults=CONFIG_DEFAULTS)


class ORPOTrainer(PreferenceTrainer):
    """Odds-ratio preference optimisation: the policy alone, no reference model."""

    method = "orpo"
    config_class = ORPOConfig
    nll_loss = "orpo.nll"
    trains_on_prompt = True


@hookimpl
def register_methods(register):
    register("method.orpo", Method(config=ORPOConfig, trainer=ORPOTrainer, loss_family="orpo",
                                   summary="ORPO: chosen NLL + odds-ratio preference term, no reference model"))
