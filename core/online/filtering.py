"""Dynamic sampling: rollout filters drop uninformative groups, and further prompts refill the batch.

A group of completions of one prompt whose rewards are all equal gets zero group-relative advantage:
it costs a rollout's compute and teaches nothing. DAPO (Yu et al. 2025, "DAPO", §3.2, "dynamic
sampling") drops such groups and samples further prompts until the batch holds only informative ones.
Here that is a plugin kind (``register_rollout_filters``): a filter sees one scored
:class:`RolloutGroup` and keeps or drops it; the online chassis (:class:`plait.online.chassis.OnlineTrainer`)
runs the configured filters after scoring and refills the batch from a :class:`PromptStream` it owns,
at most ``max_num_gen_batches`` generation rounds per rollout (DAPO's and verl's name; the first round counts).
When the bound is hit the batch is completed with the latest dropped groups (their rewards are all
equal for ``zero_variance``, so they carry no gradient, and every batch keeps its size).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from plait.errors import PlaitError
from plait.params import int_at_least
from plait.registry import Component

# The refill stream's shuffles are seeded apart from the train sampler's (seed + epoch).
REFILL_SEED_OFFSET = 0x5EED_F117


@attrs.frozen
class RolloutGroup:
    """One prompt's scored completions, as a filter sees them.

    ``rewards`` ``[G]``: each completion's total reward Σ_k w_k·r_k (NaN where no reward scored it);
    ``scores`` ``[G, K]``: each reward function's score (NaN for None); ``lengths`` ``[G]``: completion
    tokens; ``truncated`` ``[G]``: completions cut at ``max_completion_length`` before they ended.
    """

    prompt: Any
    rewards: Tensor
    scores: Tensor
    lengths: Tensor
    truncated: Tensor

    @property
    def size(self) -> int:
        return int(self.rewards.shape[0])


@attrs.frozen
class RolloutFilter:
    """A registered filter with its validated params: ``keeps(group)``."""

    component: Component
    params: Any

    @property
    def name(self) -> str:
        return self.component.name

    def keeps(self, group: RolloutGroup) -> bool:
        fn: Callable = self.component.obj
        verdict = fn(group) if self.params is None else fn(group, self.params)
        if not isinstance(verdict, (bool, torch.Tensor)) or (torch.is_tensor(verdict) and verdict.numel() != 1):
            raise PlaitError(f"rollout filter {self.name} returned {verdict!r:.60}; a filter returns True (keep) or "
                             "False (drop)")
        return bool(verdict)


def resolve_rollout_filters(specs: Sequence[str | Mapping[str, Any]] | None, plugins: Any = None,
                            *, field: str = "rollout_filters") -> list[RolloutFilter]:
    """``[zero_variance, {name: accuracy_band, low: 0.1, high: 0.9}]`` -> :class:`RolloutFilter` objects."""
    if not specs:
        return []
    if plugins is None:
        from plait.manager import default_plugins

        plugins = default_plugins()
    if isinstance(specs, (str, Mapping)):
        specs = [specs]
    filters = []
    for i, spec in enumerate(specs):
        values = dict(spec) if isinstance(spec, Mapping) else {"name": spec}
        if not isinstance(values.get("name"), str):
            raise PlaitError(f"{field}[{i}] needs a name, e.g. {field}: [zero_variance, {{name: accuracy_band, "
                             f"low: 0.1, high: 0.9}}]; got {spec!r}")
        component = plugins.rollout_filters.get(values.pop("name"), family="filter")
        filters.append(RolloutFilter(component, component.make_params(**values)))
    return filters


@attrs.define(slots=False)  # a mixin of OnlineParams, beside RewardChoice: two slotted bases cannot mix
class RolloutFilterChoice:
    """The dynamic-sampling knobs of the GRPO family (DAPO §3.2): filters by name, and the bound on rounds."""

    field_help: ClassVar[dict[str, str]] = {
        "rollout_filters": "filters that drop scored groups, by name or {name, ...params}; the batch is refilled "
                           "(plait list filters)",
        "max_num_gen_batches": "most generation rounds per rollout with rollout_filters (the first counts); then "
                               "dropped groups fill the batch",
    }

    rollout_filters: list | None = None
    max_num_gen_batches: int = attrs.field(default=10, validator=int_at_least(1))


class PromptStream:
    """Dataset indices for refill rounds: the prompts shuffled per pass (seeded apart from the train
    sampler's order), handed out in order across passes; its state is two integers, saved with checkpoints."""

    def __init__(self, size: int, shuffle: bool, seed: int):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.epoch = self.position = 0
        self._order: list[int] | None = None

    def order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + REFILL_SEED_OFFSET + self.epoch)
                self._order = torch.randperm(self.size, generator=generator).tolist()
            else:
                self._order = list(range(self.size))
        return self._order

    def take(self, count: int) -> list[int]:
        """The next ``count`` prompts' indices."""
        out: list[int] = []
        while len(out) < count:
            chunk = self.order()[self.position:self.position + count - len(out)]
            out += chunk
            self.position += len(chunk)
            if self.position >= self.size:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self._order = state["epoch"], state["position"], None


def rows_of(value: Any, rows: list[int], n: int) -> Any:
    """``value`` restricted to ``rows`` when it holds one entry per row (of ``n``): lists, tensors, and
    dicts of them (an episode's columns); anything else is shared by every row and kept as it is."""
    if isinstance(value, dict):
        return {k: rows_of(v, rows, n) for k, v in value.items()}
    if isinstance(value, list) and len(value) == n:
        return [value[i] for i in rows]
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n:
        return value[torch.tensor(rows, device=value.device)]
    return value


def joined(parts: list[Any]) -> Any:
    """Per-row values of several rounds (as :func:`rows_of` cut them) put end to end."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: joined([p[k] for p in parts]) for k in first}
    if isinstance(first, list):
        return [x for p in parts for x in p]
    if torch.is_tensor(first) and first.dim() > 0:
        return torch.cat(parts)
    return first
