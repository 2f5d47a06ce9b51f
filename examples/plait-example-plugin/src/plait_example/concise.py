"""reward.concise: 1 for an answer within a word budget, decaying as budget/words beyond it.

A length-shaping reward in the spirit of DAPO's overlong penalty (Yu et al. 2025, "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", §3.4), counted in words so it needs no
tokenizer. An empty completion gets None: there is nothing to judge, and None is left out of
the weighted reward sum instead of counting as 0.
"""

import attrs

from plait import hookimpl
from plait.params import positive


@attrs.frozen
class ConciseParams:
    max_words: int = attrs.field(default=50, validator=positive)


@attrs.frozen
class Concise:
    """The reward function built from its params: a module-level class, so it pickles."""

    params: ConciseParams

    def __call__(self, completions, **kwargs):
        scores = []
        for completion in completions:
            text = completion if isinstance(completion, str) else completion[-1]["content"]
            words = len(text.split())
            scores.append(None if words == 0 else min(1.0, self.params.max_words / words))
        return scores


@hookimpl
def register_rewards(register):
    register("reward.concise", Concise, params=ConciseParams, completion_format="any")
