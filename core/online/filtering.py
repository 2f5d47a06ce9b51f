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

Refilling re-spends tokens on fresh prompts; it does not save any. GRESO (Zheng et al. 2025, "Act Only
When It Pays", Alg. 1) saves them before sampling: a prompt whose groups kept being dropped will likely be
dropped again (a solved or a hopeless prompt), so ``skip_dropped_prompts`` (:class:`PromptHistory`) samples
a prompt whose last k groups the filters dropped only with probability p**k, and takes the next prompt of
the stream in its place.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, ClassVar, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from plait.errors import PlaitError
from plait.params import in_range, int_at_least
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
        "skip_dropped_prompts": "GRESO: a prompt the rollout_filters dropped k times running is sampled with "
                                "probability p**k (the paper's p: 0.5); None: every prompt is sampled",
    }

    rollout_filters: list | None = None
    max_num_gen_batches: int = attrs.field(default=10, validator=int_at_least(1))
    skip_dropped_prompts: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(in_range(0.0, 1.0, low_open=True, high_open=True)))


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


class PromptHistory:
    """GRESO's record (Zheng et al. 2025, Alg. 1): for each prompt, how many of its latest groups in a row the
    rollout filters dropped. A prompt dropped k times running is sampled with probability ``p**k``; the draw
    is a hash of the seed, the prompt and where it is drawn (the caller's step, refill-stream place, process
    and slot), so a resumed run draws what the straight one did and no generator state is saved. Prompts are keyed by their token ids, so every process agrees on the key."""

    def __init__(self, p: float, seed: int):
        self.p, self.seed = p, seed
        self.dropped_in_a_row: dict[int, int] = {}

    @staticmethod
    def key(prompt_ids: Sequence[int]) -> int:
        digest = hashlib.blake2b(torch.tensor(list(prompt_ids), dtype=torch.int64).numpy().tobytes(), digest_size=8)
        return int.from_bytes(digest.digest(), "little", signed=True)  # fits an int64 tensor, to gather

    def keep_probability(self, key: int) -> float:
        return self.p ** self.dropped_in_a_row.get(key, 0)

    def samples(self, key: int, *where: int) -> bool:
        """Is this prompt sampled, at the draw ``where`` names (integers: the step, the stream's place, ...)?"""
        probability = self.keep_probability(key)
        if probability == 1.0:  # never dropped, or kept since: no draw
            return True
        words = torch.tensor([self.seed, key, *where], dtype=torch.int64).numpy().tobytes()
        uniform = int.from_bytes(hashlib.blake2b(words, digest_size=8).digest(), "little") / 2.0 ** 64
        return uniform < probability

    def update(self, key: int, dropped: bool) -> None:
        if dropped:
            self.dropped_in_a_row[key] = self.dropped_in_a_row.get(key, 0) + 1
        else:
            self.dropped_in_a_row.pop(key, None)

    def state_dict(self) -> dict:
        return {"dropped_in_a_row": dict(self.dropped_in_a_row)}

    def load_state_dict(self, state: dict) -> None:
        self.dropped_in_a_row = dict(state["dropped_in_a_row"])


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


def joined_prompt_batches(parts: list[dict], pad_id: int) -> dict:
    """Collated (left-padded) prompt batches put end to end: ``input_ids`` and ``attention_mask`` re-padded on
    the left to the widest part, every other column as :func:`joined` joins it."""
    width = max(part["input_ids"].shape[1] for part in parts)

    def padded(key: str, value: int) -> Tensor:
        return torch.cat([torch.nn.functional.pad(part[key], (width - part[key].shape[1], 0), value=value)
                          for part in parts])

    rest = joined([{k: v for k, v in part.items() if k not in ("input_ids", "attention_mask")} for part in parts])
    return {**rest, "input_ids": padded("input_ids", pad_id), "attention_mask": padded("attention_mask", 0)}
