"""``judge.rules``: a rule judge built from registered reward functions (or any ``reward_funcs`` entry).

Each completion's score is the weighted sum of the rewards (None left out); the higher score of a
pair wins and equal scores tie (-1). ``rewards`` takes what GRPO's ``reward_funcs`` takes: names
(``think_format``), ``{name, weight, **params}`` entries, callables, import paths::

    judge: {name: rules, rewards: [{name: soft_overlong, max_len: 16}]}
"""

from __future__ import annotations

from typing import Any

import attrs

from plait import PlaitError, hookimpl
from plait.online.scoring import ON_ERROR, resolve_reward_funcs

from ._scored import ScoredJudge


@attrs.define
class RulesParams:
    rewards: Any = attrs.field()
    weights: list | None = None  # one per reward (TRL's reward_weights); None: each entry's own weight
    on_error: str = attrs.field(default="fail", validator=attrs.validators.in_(ON_ERROR))
    timeout: float | None = None

    @rewards.validator
    def _some(self, attribute, value) -> None:
        if value is None or (isinstance(value, (list, tuple)) and not value):
            raise ValueError("rewards is empty; name at least one reward, e.g. rewards: [think_format]")


def rules_judge(params: RulesParams, plugins=None) -> ScoredJudge:
    funcs = resolve_reward_funcs(params.rewards, plugins, field="judge.rewards")
    if params.weights is not None and len(params.weights) != len(funcs):
        raise PlaitError(f"judge.rules: weights has {len(params.weights)} values for {len(funcs)} rewards "
                         f"{[f.name for f in funcs]}; give one weight per reward")
    return ScoredJudge(funcs, params.weights, params.on_error, params.timeout)


@hookimpl
def register_judges(register):
    register("judge.rules", rules_judge, params=RulesParams,
             doc="Prefers the completion with the higher sum of registered reward functions (tie: -1)")
