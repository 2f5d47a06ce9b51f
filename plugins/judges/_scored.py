"""The judge both scoring judges are: each completion scored by reward functions, the higher wins."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from plait.online.scoring import RewardFunction, compute_rewards, reward_weights


def prefer(first: Tensor, second: Tensor) -> Tensor:
    """Per pair: 0 when ``first`` scores higher, 1 when ``second`` does, -1 for equal (or NaN) scores."""
    return torch.where(first > second, 0, torch.where(second > first, 1, -1))


@attrs.define(eq=False)
class ScoredJudge:
    """Scores each completion with ``reward_funcs`` (weighted, summed over functions ignoring None,
    as TRL's online DPO sums rewards) and prefers the higher score of each pair."""

    reward_funcs: list[RewardFunction]
    weights: Sequence[float] | None = None
    on_error: str = "fail"
    timeout: float | None = None

    def scores(self, prompts: Sequence[Any], completions: Sequence[Any], *,
               completion_ids: Sequence[Sequence[int]] | None = None, columns: Mapping[str, Sequence] | None = None,
               trainer_state: Any = None) -> Tensor:
        """One float per completion, ``[N]`` (rewards that read ``completion_ids`` need them given)."""
        ids = completion_ids if completion_ids is not None else [None] * len(completions)
        raw = compute_rewards(self.reward_funcs, prompts=list(prompts), completions=list(completions),
                              completion_ids=ids, columns=columns, trainer_state=trainer_state,
                              on_error=self.on_error, timeout=self.timeout)
        return (raw * reward_weights(self.reward_funcs, self.weights)).nansum(-1)

    def __call__(self, prompts: Sequence[Any], completion_pairs: Sequence[Sequence[Any]]) -> list[int]:
        flat = [completion for pair in completion_pairs for completion in pair]
        scores = self.scores([p for p in prompts for _ in range(2)], flat).view(-1, 2)
        return prefer(scores[:, 0], scores[:, 1]).tolist()
