"""``judge.reward_model``: a sequence classifier scores both completions, the higher score wins.

``model`` is a folder saved by ``plait reward_model`` (or any ``…ForSequenceClassification`` with
one label: a folder, a hub id, or a loaded model). It reads prompt + completion as the reward
model was trained to (:mod:`plait.plugins.reward_sources.reward_models`, reached through the
``resolve_reward`` hook): the config is checked when the judge is built, the weights load at the
first call. Equal scores tie (-1)::

    judge: {name: reward_model, model: runs/reward_model-tiny}
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from plait import PlaitError, hookimpl
from plait.online.scoring import resolve_reward_funcs

from ._scored import ScoredJudge


@attrs.define
class RewardModelJudgeParams:
    model: Any  # a folder, a hub id, or a loaded sequence classifier
    processing_class: Any = None  # its tokenizer (None: the one saved with it)


def reward_model_judge(params: RewardModelJudgeParams, plugins=None) -> ScoredJudge:
    model = os.fspath(params.model) if isinstance(params.model, os.PathLike) else params.model
    if isinstance(model, str) and model.startswith("~"):
        model = os.path.expanduser(model)
    if isinstance(model, str) and plugins is not None and (model in plugins.rewards or f"reward.{model}" in plugins.rewards):
        raise PlaitError(f"judge.reward_model: model={model!r} is a reward function's name; use judge.rules for "
                         "reward functions, or give a reward-model folder")
    funcs = resolve_reward_funcs([model], plugins, params.processing_class, field="judge.model")
    return ScoredJudge(funcs)


@hookimpl
def register_judges(register):
    register("judge.reward_model", reward_model_judge, params=RewardModelJudgeParams,
             doc="Prefers the completion a sequence-classification reward model scores higher (tie: -1)")
