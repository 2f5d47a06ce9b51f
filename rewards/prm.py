"""A process reward model (a ``plait prm`` folder) as a reward, by name with its parameters.

``{name: prm, model: runs/prm-tiny, aggregation: min}`` in ``reward_funcs``: the PRM scores every
step of a completion (split at its ``step_separator``) with P(step is correct), and
``aggregation`` turns the step scores into one reward: ``min`` (the weakest step), ``last`` or
``mean``. Lightman et al. 2023, "Let's Verify Step by Step". The scoring itself is the PRM reward
source's (``plait.plugins.reward_sources.process_reward_models``); this module gives it a name and
validated parameters. The model's config is checked when the reward is resolved; its weights
load at the first score.
"""

from __future__ import annotations

import attrs

from plait import hookimpl

AGGREGATIONS = ("min", "last", "mean")


@attrs.frozen
class PRMReward:
    model: str = attrs.field(validator=attrs.validators.instance_of(str))
    aggregation: str = attrs.field(default="min", validator=attrs.validators.in_(AGGREGATIONS))
    step_separator: str | None = None  # None: the one the PRM was trained with (its config), else "\n"
    batch_size: int = attrs.field(default=8, validator=attrs.validators.ge(1))


def make_prm_reward(params: PRMReward):
    from plait.plugins.reward_sources.process_reward_models import process_reward_model  # torch on first use

    return process_reward_model(params.model, aggregation=params.aggregation, step_separator=params.step_separator,
                                batch_size=params.batch_size).fn


@hookimpl
def register_rewards(register):
    register("reward.prm", make_prm_reward, params=PRMReward,
             doc="A process reward model folder: per-step P(correct) aggregated by min, last or mean")
