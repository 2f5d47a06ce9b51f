"""A rollout's rows from sampling to micro-batches: how a generation batch divides, the sampler that
hands out its prompts, the packed rows, and the buffer that serves them ``passes`` times over.

One *generation batch* (a rollout) is ``per_device × processes × steps_per_generation`` completions,
``num_generations`` per prompt (one for PPO and distillation), groups kept together. The data loader
hands out the same prompts for every micro-step of a rollout (so the transformers Trainer counts
steps and epochs correctly); only the first of them is sampled from. Nothing here knows a method.
"""

from __future__ import annotations

import math
from typing import Callable

import attrs
import torch
from torch import Tensor
from torch.utils.data import Sampler

from plait.data import vision
from plait.engine.layout import padded_length
from plait.errors import PlaitError


def completion_columns(input_ids: Tensor, prompt_length: int) -> Tensor:
    """[B, T] mask of the completion columns (prompts are left-padded to ``prompt_length``): the only
    tokens whose log-probs the online losses read, so the only positions the output layer projects."""
    columns = torch.arange(input_ids.shape[1], device=input_ids.device) >= prompt_length
    return columns.expand_as(input_ids)


# ---------------------------------------------------------------------------------------------
# Sizes and the sampler
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class GenerationSizes:
    """How one generation batch divides: completions per process, micro-batches (each one
    micro-step), prompts (each ``num_generations`` times), and the ``passes`` made over it."""

    per_device: int
    processes: int
    steps_per_generation: int
    num_generations: int
    passes: int = 1

    @classmethod
    def one_per_prompt(cls, args, micro_steps: int, passes: int) -> "GenerationSizes":
        """A rollout of one completion per prompt (PPO, distillation): ``micro_steps`` micro-batches."""
        return cls(args.per_device_train_batch_size, args.world_size, micro_steps, 1, passes)

    @property
    def local(self) -> int:
        return self.per_device * self.steps_per_generation

    @property
    def total(self) -> int:
        return self.local * self.processes

    @property
    def prompts(self) -> int:
        return self.total // self.num_generations


def generation_sizes(args) -> GenerationSizes:
    """Resolve and check the generation batch of a config, before any model loads."""
    p = args.params
    per_device, processes, accumulation = args.per_device_train_batch_size, args.world_size, args.gradient_accumulation_steps
    step = per_device * processes
    if p.generation_batch_size is not None and p.steps_per_generation is not None:
        raise PlaitError(f"generation_batch_size={p.generation_batch_size} and steps_per_generation="
                         f"{p.steps_per_generation} both set the generation batch; give only one")
    if p.generation_batch_size is not None:
        if p.generation_batch_size % step:
            raise PlaitError(
                f"generation_batch_size={p.generation_batch_size} is not a multiple of per_device_train_batch_size "
                f"{per_device} × {processes} processes = {step}; use a multiple of {step}")
        spg = p.generation_batch_size // step
    else:
        spg = p.steps_per_generation or accumulation
    sizes = GenerationSizes(per_device, processes, spg, p.num_generations, p.num_iterations)
    if sizes.total % p.num_generations:
        g = p.num_generations
        divisors = [d for d in range(2, sizes.total + 1) if sizes.total % d == 0][:4]
        multiple = math.lcm(step, g)
        raise PlaitError(
            f"the generation batch of {sizes.total} completions (per_device_train_batch_size {per_device} × "
            f"{processes} processes × steps_per_generation {spg}) is not divisible by num_generations={g}; "
            f"set num_generations to a divisor of {sizes.total} (e.g. {', '.join(map(str, divisors)) or 'none ≥ 2'}) "
            f"or set generation_batch_size to a multiple of {multiple} (e.g. {multiple})")
    return sizes


class GroupSampler(Sampler[int]):
    """Dataset indices for generation batches: each prompt ``group_size`` times in a row.

    Prompts are drawn (shuffled per pass when ``shuffle``) ``prompts_per_batch`` at a time; each
    batch's index list is emitted ``repeat`` times, once per micro-step that re-uses it. Only
    whole generation batches are emitted.
    """

    def __init__(self, size: int, group_size: int, prompts_per_batch: int, repeat: int = 1,
                 shuffle: bool = True, seed: int = 0):
        if size < prompts_per_batch:
            raise PlaitError(f"the dataset has {size} prompts but one generation batch needs {prompts_per_batch}; "
                             "add prompts or make the generation batch smaller")
        self.size, self.group_size, self.prompts_per_batch = size, group_size, prompts_per_batch
        self.repeat, self.shuffle, self.seed, self.epoch = repeat, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(range(self.size))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
            self.epoch += 1  # a fresh order on the next pass even if nobody calls set_epoch
        for start in range(0, self.size - self.prompts_per_batch + 1, self.prompts_per_batch):
            rows = [i for i in order[start:start + self.prompts_per_batch] for _ in range(self.group_size)]
            for _ in range(self.repeat):
                yield from rows

    def __len__(self) -> int:
        return (self.size // self.prompts_per_batch) * self.prompts_per_batch * self.group_size * self.repeat


# ---------------------------------------------------------------------------------------------
# The rollout buffer
# ---------------------------------------------------------------------------------------------


class RolloutBuffer:
    """One rollout served as micro-batches, and where the run stands in it.

    A fresh rollout is sampled every ``micro_steps × passes`` micro-steps; each pass over it
    starts with a reshuffle, ``split(rollout, micro_steps, generator)``, into ``micro_steps``
    micro-batches. A checkpoint may fall anywhere in a rollout (``save_steps`` is the user's to
    choose), so :meth:`state_dict` holds the position, the shuffle generator and, mid-rollout,
    the rollout itself: resuming serves the same micro-batches an uninterrupted run would have.
    """

    def __init__(self, micro_steps: int, passes: int, split: Callable[[dict, int, torch.Generator], list[dict]],
                 seed: int):
        self.micro_steps, self.passes, self.split = micro_steps, passes, split
        self.step = 0  # micro-steps served so far
        self.rollout: dict | None = None
        self.chunks: list[dict] = []
        self.generator = torch.Generator().manual_seed(seed)
        self._pass_start = self.generator.get_state()  # the generator as this pass's shuffle found it

    @property
    def per_rollout(self) -> int:
        return self.micro_steps * self.passes

    def next(self, sample: Callable[[], dict]) -> dict:
        """The next micro-batch; ``sample()`` is called when a new rollout is due."""
        if self.step % self.per_rollout == 0:
            self.rollout = sample()
        if self.step % self.micro_steps == 0:  # a fresh shuffle for every pass over the rollout
            self._reshuffle()
        chunk = self.chunks[self.step % self.micro_steps]
        self.step += 1
        return chunk

    def _reshuffle(self) -> None:
        self._pass_start = self.generator.get_state()
        self.chunks = self.split(self.rollout, self.micro_steps, self.generator)

    def state_dict(self) -> dict:
        """The position, the generator and (mid-rollout) the rollout on the CPU; mid-pass the
        generator is saved as the pass found it, so the same shuffle is cut again on load."""
        mid_pass = self.step % self.micro_steps != 0
        state = {"step": self.step, "generator": self._pass_start if mid_pass else self.generator.get_state()}
        if self.step % self.per_rollout:
            state["rollout"] = {k: v.cpu() if torch.is_tensor(v) else v for k, v in self.rollout.items()}
        return state

    def load_state_dict(self, state: dict, device) -> None:
        self.step = state["step"]
        self.generator.set_state(state["generator"])
        rollout = state.get("rollout")
        self.rollout = None if rollout is None else {k: v.to(device) if torch.is_tensor(v) else v
                                                     for k, v in rollout.items()}
        self.chunks = []
        if self.step % self.micro_steps:
            self._reshuffle()

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def pack(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int, device,
         multiple: int | None = None) -> dict:
    """Left-padded prompts then right-padded completions: ``input_ids`` [N, P + C] and masks.

    ``completion_mask`` [N, C] marks the sampled tokens; ``prompt_length`` is P, where completions
    start. With ``multiple`` (``pad_to_multiple_of``) P and C are rounded up to multiples of it.
    """
    n = len(prompt_ids)
    width = padded_length(max(len(ids) for ids in prompt_ids), multiple)
    length = padded_length(max(1, max(len(ids) for ids in completion_ids)), multiple)
    input_ids = torch.full((n, width + length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width + length), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, width - len(prompt):width] = torch.tensor(prompt)
        attention[i, width - len(prompt):width + len(completion)] = 1
        if completion:
            input_ids[i, width:width + len(completion)] = torch.tensor(completion)
    return {"input_ids": input_ids.to(device), "attention_mask": attention.to(device),
            "completion_mask": attention[:, width:].to(device), "prompt_length": width}


def whole_groups(prompt_ids: list[list[int]], g: int) -> bool:
    """Do the rows come as whole groups of ``g`` equal prompts (then each prompt is sampled once with n = g)?"""
    return len(prompt_ids) % g == 0 and all(prompt_ids[i] == prompt_ids[i - i % g] for i in range(len(prompt_ids)))


def pad_floats(rows: list[list[float]], width: int, device) -> Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)


def split_rows(buffer: dict, parts: int, generator: torch.Generator, multiple: int | None = None) -> list[dict]:
    """Shuffle a rollout's rows and cut them into ``parts`` micro-batches, trimming the completion
    columns that are padding in every row of a micro-batch (to a multiple of ``multiple`` when set).

    Tensors of width P + C (``input_ids``, ``attention_mask``) and of width C (completion-aligned:
    masks, log-probs, weights) are trimmed alike; tensors that are not per-row (0-dim normalisers) are shared.
    """
    n = buffer["input_ids"].shape[0]
    if n % parts:
        raise PlaitError(f"a rollout of {n} rows does not split into {parts} micro-batches")
    full, prompt = buffer["input_ids"].shape[1], buffer["prompt_length"]
    order = torch.randperm(n, generator=generator).to(buffer["input_ids"].device)
    chunks = []
    for rows in order.chunk(parts):
        used = int(buffer["attention_mask"][rows].sum(0).nonzero().max()) + 1 - prompt
        keep = prompt + min(padded_length(max(used, 1), multiple), full - prompt)
        chunk = {}
        for key, value in buffer.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n:
                value = value[rows]
                if value.dim() > 1 and value.shape[1] == full:
                    value = value[:, :keep]
                elif value.dim() > 1 and value.shape[1] == full - prompt:
                    value = value[:, :keep - prompt]
            elif isinstance(value, vision.RowInputs):
                value = value.select(rows)
            chunk[key] = value
        chunks.append(chunk)
    return chunks
