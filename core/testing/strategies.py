"""Hypothesis strategies for the typed inputs plait components consume.

Each strategy draws what a real run can hand a component, edge cases included: empty
completions (length 0, log-prob 0), a reference equal to the policy, summed log-probs of
thousands of tokens (so log-ratio margins of 10⁵), float16/bfloat16 tensors, reward functions
that return None, groups whose rewards are all equal, token masks with empty rows.

Loss batches (:mod:`plait.engine.batches`)::

    preference_logps()     PreferenceLogps     DPO family: summed log-probs of B pairs, [B]
    unpaired_logps()       UnpairedLogps       KTO family: [B] plus a 0-dim KL estimate
    token_logps()          TokenLogps          SFT family: per-token log-probs and mask, [B, T]
    pairwise_rewards()     PairwiseRewards     reward models: scalar rewards of B pairs, [B]
    policy_tokens()        PolicyTokens        GRPO/RLOO/PPO policy: policy, sampler, reference [B, T]
    value_tokens()         ValueTokens         PPO critic: values, old values, returns [B, T]
    token_distributions()  TokenDistributions  distillation: student and teacher log-softmax [N, V]

Online RL::

    rollouts()          Rollout           rewards [N, K] with NaN for None, N = groups × G
    reward_inputs()     dict              keyword arguments of one reward-function call

:data:`BATCH_KINDS` records, per batch class, how the contract checks build, slice and perturb
it; a plugin that brings its own batch class adds it with :func:`register_batch_kind`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import attrs
import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch import Tensor

from plait.engine.batches import (
    PairwiseRewards,
    PolicyTokens,
    PreferenceLogps,
    Rollout,
    TokenDistributions,
    TokenLogps,
    UnpairedLogps,
    ValueTokens,
)

__all__ = [
    "BATCH_KINDS", "BatchKind", "batch_kind", "batches", "pairwise_rewards", "policy_tokens", "preference_logps",
    "register_batch_kind", "reward_inputs", "rollouts", "take", "token_distributions", "token_logps",
    "unpaired_logps", "value_tokens",
]

HALF = (torch.float16, torch.bfloat16)


def _is_half(dtype: torch.dtype) -> bool:
    return dtype in HALF


def _default_max_length(dtype: torch.dtype) -> int:
    # float16 overflows at 65504: keep summed log-probs (and their squares) representable.
    # bfloat16 has float32's range, so it gets float32's huge margins at a coarser precision.
    return 6 if dtype == torch.float16 else 4096


# ---------------------------------------------------------------------------------------------
# Loss batches
# ---------------------------------------------------------------------------------------------


@st.composite
def _summed_logps(draw, size: int, max_length: int, max_token_nll: float):
    """(policy, reference, length) per completion: log π = length × mean token log-prob.

    The reference is drawn equal to, close to, or independent of the policy, so log-ratios
    range from exactly 0 to ±length × max_token_nll.
    """
    relation = draw(st.sampled_from(["independent", "equal", "close"]))
    per_token = st.floats(-max_token_nll, 0.0)
    rows = []
    for _ in range(size):
        length = draw(st.integers(0, max_length))
        policy = length * draw(per_token)
        if relation == "equal":
            reference = policy
        elif relation == "close":
            reference = min(0.0, policy + length * draw(st.floats(-0.5, 0.5)))
        else:
            reference = length * draw(per_token)
        rows.append((policy, reference, float(length)))
    return rows


def _tensor(values: Iterable[float], dtype: torch.dtype) -> Tensor:
    return torch.tensor(list(values), dtype=torch.float64).to(dtype)


@st.composite
def preference_logps(
    draw,
    *,
    min_size: int = 1,
    max_size: int = 6,
    dtype: torch.dtype = torch.float32,
    max_length: int | None = None,
    max_token_nll: float = 30.0,
    divergence: Callable[[Tensor], Tensor] | None = None,
) -> PreferenceLogps:
    """A :class:`~plait.engine.batches.PreferenceLogps` of ``min_size``–``max_size`` pairs.

    Summed log-probs are ``length × (mean token log-prob in [−max_token_nll, 0])`` with lengths
    in ``[0, max_length]`` (default 4096, or 6 for float16 so sums stay far from its overflow).
    Lengths are in the log-probs' dtype, as the DPO method builds them from the mask.
    """
    size = draw(st.integers(min_size, max_size))
    max_length = _default_max_length(dtype) if max_length is None else max_length
    chosen = draw(_summed_logps(size, max_length, max_token_nll))
    rejected = draw(_summed_logps(size, max_length, max_token_nll))
    column = lambda rows, i: _tensor((row[i] for row in rows), dtype)  # noqa: E731
    extra = {} if divergence is None else {"divergence": divergence}
    return PreferenceLogps(
        chosen_logps=column(chosen, 0), rejected_logps=column(rejected, 0),
        ref_chosen_logps=column(chosen, 1), ref_rejected_logps=column(rejected, 1),
        chosen_lengths=column(chosen, 2), rejected_lengths=column(rejected, 2), **extra,
    )


@st.composite
def unpaired_logps(
    draw,
    *,
    min_size: int = 1,
    max_size: int = 6,
    dtype: torch.dtype = torch.float32,
    max_length: int | None = None,
    max_token_nll: float = 30.0,
) -> UnpairedLogps:
    """An :class:`~plait.engine.batches.UnpairedLogps`: desirable flags and a 0-dim KL estimate z ≥ 0."""
    size = draw(st.integers(min_size, max_size))
    max_length = _default_max_length(dtype) if max_length is None else max_length
    rows = draw(_summed_logps(size, max_length, max_token_nll))
    desirable = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    # z = clamp(mean log-ratio on mismatched pairs, min=0): up to a few hundred nats in float32.
    kl = draw(st.floats(0.0, 50.0 if _is_half(dtype) else 500.0))
    return UnpairedLogps(
        logps=_tensor((r[0] for r in rows), dtype), ref_logps=_tensor((r[1] for r in rows), dtype),
        desirable=torch.tensor(desirable, dtype=torch.bool), kl_logratio=_tensor([kl], dtype)[0],
    )


@st.composite
def token_logps(
    draw,
    *,
    min_size: int = 1,
    max_size: int = 4,
    max_tokens: int = 8,
    dtype: torch.dtype = torch.float32,
    max_token_nll: float | None = None,
    mask_dtype: torch.dtype = torch.bool,
) -> TokenLogps:
    """A :class:`~plait.engine.batches.TokenLogps` ``[B, T]``: rows may be fully masked, the batch never is.

    Token log-probs lie in ``[−max_token_nll, 0]`` (default 100, or 30 in half precision).
    """
    size = draw(st.integers(min_size, max_size))
    tokens = draw(st.integers(1, max_tokens))
    bound = (30.0 if _is_half(dtype) else 100.0) if max_token_nll is None else max_token_nll
    values = draw(st.lists(st.floats(-bound, 0.0), min_size=size * tokens, max_size=size * tokens))
    mask = draw(st.lists(st.booleans(), min_size=size * tokens, max_size=size * tokens))
    mask[draw(st.integers(0, size * tokens - 1))] = True
    return TokenLogps(
        logps=_tensor(values, dtype).view(size, tokens),
        mask=torch.tensor(mask, dtype=torch.bool).view(size, tokens).to(mask_dtype),
    )


@st.composite
def pairwise_rewards(
    draw, *, min_size: int = 1, max_size: int = 6, dtype: torch.dtype = torch.float32, max_reward: float | None = None
) -> PairwiseRewards:
    """A :class:`~plait.engine.batches.PairwiseRewards`: scalar-head rewards and an optional margin column."""
    size = draw(st.integers(min_size, max_size))
    bound = (100.0 if _is_half(dtype) else 1e4) if max_reward is None else max_reward
    reward = st.floats(-bound, bound)
    chosen = draw(st.lists(reward, min_size=size, max_size=size))
    rejected = draw(st.lists(reward, min_size=size, max_size=size))
    extra = {}
    if draw(st.booleans()):
        extra["margin"] = _tensor(draw(st.lists(st.floats(0.0, 10.0), min_size=size, max_size=size)), dtype)
    return PairwiseRewards(chosen_rewards=_tensor(chosen, dtype), rejected_rewards=_tensor(rejected, dtype), **extra)


@st.composite
def policy_tokens(
    draw,
    *,
    min_size: int = 1,
    max_size: int = 4,
    max_tokens: int = 8,
    dtype: torch.dtype = torch.float32,
    max_token_nll: float | None = None,
) -> PolicyTokens:
    """A :class:`~plait.engine.batches.PolicyTokens` as a GRPO/RLOO step sees it.

    The sampling policy's log-probs equal the policy's (on-policy) or differ by up to 2 nats per
    token (0.5 in half precision, where exp overflows at 11); the reference's differ by up to
    5 nats (1 in half). Advantages are per sequence ``[B]`` or per token ``[B, T]``; optional
    parts (reference, importance weights, normalisers) are present or None; token entropies always are.
    """
    size, tokens = draw(st.integers(min_size, max_size)), draw(st.integers(1, max_tokens))
    half = _is_half(dtype)
    bound = (30.0 if half else 100.0) if max_token_nll is None else max_token_nll
    n = size * tokens

    def grid(values):
        return _tensor(values, dtype).view(size, tokens)

    def near(base: list[float], spread: float) -> list[float]:
        shifts = draw(st.lists(st.floats(-spread, spread), min_size=n, max_size=n))
        return [min(0.0, b + s) for b, s in zip(base, shifts)]

    logps = draw(st.lists(st.floats(-bound, 0.0), min_size=n, max_size=n))
    old = logps if draw(st.booleans()) else near(logps, 0.5 if half else 2.0)
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    mask[draw(st.integers(0, n - 1))] = True
    advantage = st.floats(-10.0, 10.0) if half else st.floats(-100.0, 100.0)
    per_token = draw(st.booleans())
    advantages = draw(st.lists(advantage, min_size=n if per_token else size, max_size=n if per_token else size))
    mask_tensor = torch.tensor(mask).view(size, tokens)
    extra: dict[str, Any] = {}
    if draw(st.booleans()):
        extra["ref_logps"] = grid(near(logps, 1.0 if half else 5.0))
    if draw(st.booleans()):
        extra["importance_weights"] = grid(draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n)))
    if draw(st.booleans()):  # the generation batch's active tokens per process: at least this batch's
        extra["num_items_in_batch"] = torch.tensor(float(sum(mask) * draw(st.integers(1, 4))))
    if draw(st.booleans()):
        extra["max_completion_length"] = tokens + draw(st.integers(0, 8))
    # entropies of the sampling distributions: 0 (one-hot) up to ln(vocabulary) of a large model
    extra["entropy"] = grid(draw(st.lists(st.floats(0.0, 12.0), min_size=n, max_size=n)))
    return PolicyTokens(
        logps=grid(logps), old_logps=grid(old), mask=mask_tensor,
        advantages=_tensor(advantages, dtype).view(size, tokens) if per_token else _tensor(advantages, dtype),
        gradient_accumulation_steps=draw(st.integers(1, 4)), **extra,
    )


@st.composite
def value_tokens(
    draw, *, min_size: int = 1, max_size: int = 4, max_tokens: int = 8, dtype: torch.dtype = torch.float32,
    max_value: float | None = None,
) -> ValueTokens:
    """A :class:`~plait.engine.batches.ValueTokens`: old values equal to, near or far from the current ones."""
    size, tokens = draw(st.integers(min_size, max_size)), draw(st.integers(1, max_tokens))
    n, bound = size * tokens, (50.0 if _is_half(dtype) else 1e3) if max_value is None else max_value
    value = st.floats(-bound, bound)
    values = draw(st.lists(value, min_size=n, max_size=n))
    relation = draw(st.sampled_from(["equal", "close", "independent"]))
    if relation == "equal":
        old = values
    elif relation == "close":
        old = [v + d for v, d in zip(values, draw(st.lists(st.floats(-1.0, 1.0), min_size=n, max_size=n)))]
    else:
        old = draw(st.lists(value, min_size=n, max_size=n))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    mask[draw(st.integers(0, n - 1))] = True
    grid = lambda v: _tensor(v, dtype).view(size, tokens)  # noqa: E731
    return ValueTokens(values=grid(values), old_values=grid(old),
                       returns=grid(draw(st.lists(value, min_size=n, max_size=n))),
                       mask=torch.tensor(mask).view(size, tokens))


@st.composite
def token_distributions(
    draw, *, min_size: int = 1, max_size: int = 4, max_vocab: int = 8, dtype: torch.dtype = torch.float32,
    max_logit: float | None = None,
) -> TokenDistributions:
    """A :class:`~plait.engine.batches.TokenDistributions`: log-softmax of student and teacher logits ``[N, V]``.

    Logits span ±50 (±10 in half precision), so some probabilities underflow to 0.
    """
    size, vocab = draw(st.integers(min_size, max_size)), draw(st.integers(2, max_vocab))
    bound = (10.0 if _is_half(dtype) else 50.0) if max_logit is None else max_logit
    logits = lambda: _tensor(draw(st.lists(st.floats(-bound, bound), min_size=size * vocab,  # noqa: E731
                                           max_size=size * vocab)), torch.float64).view(size, vocab)
    student, teacher = logits(), logits()
    if draw(st.booleans()):
        teacher = student.clone()  # a student that already matches its teacher: divergence 0
    return TokenDistributions(logps=student.log_softmax(-1).to(dtype), teacher_logps=teacher.log_softmax(-1).to(dtype))


# ---------------------------------------------------------------------------------------------
# What the contract checks need to know about each batch class
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class BatchKind:
    """How the contract checks build, differentiate, slice and perturb one batch class.

    ``strategy(dtype=...)`` draws batches. ``policy`` names the fields a loss must
    differentiate (at least one gets a gradient, all gradients finite); ``reference`` names
    fields that must receive exactly zero gradient. ``raise_margin(batch, delta)`` returns the
    batch with every example moved by ``delta > 0`` in the direction the loss should reward
    (for ``monotone="non_increasing_in_margin"``). ``mask`` names a token mask whose zeros the
    loss must ignore; ``token_shape`` the field whose shape an ``output="token"`` loss returns.
    """

    cls: type
    strategy: Callable[..., SearchStrategy]
    policy: tuple[str, ...]
    reference: tuple[str, ...] = ()
    raise_margin: Callable[[Any, float], Any] | None = None
    mask: str | None = None
    token_shape: str | None = None


def _raise_preference(batch: PreferenceLogps, delta: float) -> PreferenceLogps:
    # Every f-divergence transform is increasing, so this raises Δ = f(r_c) − f(r_r).
    return attrs.evolve(batch, chosen_logps=batch.chosen_logps + delta / 2,
                        rejected_logps=batch.rejected_logps - delta / 2)


def _raise_unpaired(batch: UnpairedLogps, delta: float) -> UnpairedLogps:
    direction = batch.desirable.to(batch.logps.dtype) * 2 - 1
    return attrs.evolve(batch, logps=batch.logps + delta * direction)


def _raise_tokens(batch: TokenLogps, delta: float) -> TokenLogps:
    return attrs.evolve(batch, logps=batch.logps + delta)


def _raise_pairwise(batch: PairwiseRewards, delta: float) -> PairwiseRewards:
    return attrs.evolve(batch, chosen_rewards=batch.chosen_rewards + delta / 2,
                        rejected_rewards=batch.rejected_rewards - delta / 2)


BATCH_KINDS: dict[type, BatchKind] = {}


def register_batch_kind(kind: BatchKind) -> None:
    """Teach the kit a batch class (for a third-party method with its own loss inputs)."""
    BATCH_KINDS[kind.cls] = kind


for _kind in (
    BatchKind(PreferenceLogps, preference_logps, policy=("chosen_logps", "rejected_logps"),
              reference=("ref_chosen_logps", "ref_rejected_logps"), raise_margin=_raise_preference),
    # kl_logratio arrives detached from the method; it is neither policy nor reference here.
    BatchKind(UnpairedLogps, unpaired_logps, policy=("logps",), reference=("ref_logps",),
              raise_margin=_raise_unpaired),
    BatchKind(TokenLogps, token_logps, policy=("logps",), raise_margin=_raise_tokens, mask="mask",
              token_shape="logps"),
    BatchKind(PairwiseRewards, pairwise_rewards, policy=("chosen_rewards", "rejected_rewards"),
              raise_margin=_raise_pairwise),
    # old_logps (the sampler's) are constants too, but a ratio to them is the point of the loss.
    BatchKind(PolicyTokens, policy_tokens, policy=("logps", "entropy"), reference=("ref_logps",), mask="mask",
              token_shape="logps"),
    BatchKind(ValueTokens, value_tokens, policy=("values",), mask="mask", token_shape="values"),
    # The teacher is a constant to the student exactly as a reference policy is.
    BatchKind(TokenDistributions, token_distributions, policy=("logps",), reference=("teacher_logps",)),
):
    register_batch_kind(_kind)


def batch_kind(cls: type) -> BatchKind:
    """The :class:`BatchKind` of ``cls``; an unknown attrs class gets a generic one."""
    if cls in BATCH_KINDS:
        return BATCH_KINDS[cls]
    if not attrs.has(cls):
        raise TypeError(f"{cls!r} is not an attrs batch class; register it with plait.testing.register_batch_kind")
    tensors = [f for f in attrs.fields(cls) if "Tensor" in str(f.type) and f.default is attrs.NOTHING]
    floats = [f.name for f in tensors if not _is_flag(f.name)]
    return BatchKind(
        cls, lambda **kw: _generic_batch(cls, **kw),
        policy=tuple(n for n in floats if not n.startswith("ref")),
        reference=tuple(n for n in floats if n.startswith("ref")),
    )


def _is_flag(name: str) -> bool:
    return "mask" in name or name in ("desirable", "valid")


@st.composite
def _generic_batch(draw, cls: type, *, dtype: torch.dtype = torch.float32, min_size: int = 1, max_size: int = 6):
    """Required tensor fields of an unknown batch class, guessed from their names, all ``[B]``."""
    size = draw(st.integers(min_size, max_size))
    values = {}
    for field in attrs.fields(cls):
        if "Tensor" not in str(field.type) or field.default is not attrs.NOTHING:
            continue
        if _is_flag(field.name):
            values[field.name] = torch.tensor(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
            continue
        low, high = (-1e3, 0.0) if "logp" in field.name else (0.0, 1e3) if "length" in field.name else (-1e3, 1e3)
        values[field.name] = _tensor(draw(st.lists(st.floats(low, high), min_size=size, max_size=size)), dtype)
    return cls(**values)


def batches(cls: type, **kwargs: Any) -> SearchStrategy:
    """The strategy for batches of class ``cls`` (keyword arguments go to its strategy)."""
    return batch_kind(cls).strategy(**kwargs)


def batch_size_of(batch: Any) -> int:
    size = getattr(batch, "batch_size", None)
    if isinstance(size, int):
        return size
    return next(v.shape[0] for v in attrs.asdict(batch, recurse=False).values() if torch.is_tensor(v) and v.dim())


def take(batch: Any, index: Tensor | list[int]) -> Any:
    """The sub-batch of examples ``index`` (in that order); 0-dim batch statistics are kept."""
    size = batch_size_of(batch)
    index = torch.as_tensor(index, dtype=torch.long)
    changes = {
        field.alias: value[index]
        for field in attrs.fields(type(batch))
        if torch.is_tensor(value := getattr(batch, field.name)) and value.dim() and value.shape[0] == size
    }
    return attrs.evolve(batch, **changes)


# ---------------------------------------------------------------------------------------------
# Online RL
# ---------------------------------------------------------------------------------------------

# Rewards on a 1/8 grid: what reward functions return (0, 1, ½, −1, ...), and sums and group
# means of them are exact in float32, so order-independence can be checked to the last bit.
GRID_REWARDS = st.integers(-80, 80).map(lambda k: k / 8)
WIDE_REWARDS = st.floats(-1e4, 1e4)


@st.composite
def rollouts(
    draw,
    *,
    min_groups: int = 1,
    max_groups: int = 4,
    min_group_size: int = 2,
    max_group_size: int = 6,
    max_rewards: int = 3,
    rewards: SearchStrategy[float] = GRID_REWARDS,
    weights: SearchStrategy[float] = st.sampled_from([0.5, 1.0, 2.0]),
    none: bool = True,
    all_equal: bool = False,
    token_level: bool = False,
    max_tokens: int = 6,
    dtype: torch.dtype = torch.float32,
    turn_level: bool = False,
    max_turns: int = 3,
    turn_rewards: bool = True,
    equal_turns: bool = False,
) -> Rollout:
    """A :class:`~plait.engine.batches.Rollout`: ``groups × G`` completions scored by K reward functions.

    With ``none`` a reward may be None (NaN), up to whole rows and whole groups. With
    ``all_equal`` every row of a group has the same rewards (or, with ``none``, no reward at
    all). With ``token_level`` it also carries ``token_rewards``, ``values`` and a ``mask``
    ``[N, T]`` whose rows keep a prefix of at least one token.

    With ``turn_level`` it carries multi-turn episodes instead: ``turn_index`` ``[N, T]`` (1 to
    ``max_turns`` turns per row of one or two tokens each, each maybe followed by an inserted token,
    −1), ``mask`` (its tokens in a turn) and ``turn_rewards`` ``[N, max_turns]`` (each turn's reward or
    None as NaN; all NaN without ``turn_rewards``); ``equal_turns`` gives every row of a group as
    many turns.
    """
    groups = draw(st.integers(min_groups, max_groups))
    size = draw(st.integers(min_group_size, max_group_size))
    k = draw(st.integers(1, max_rewards))
    value = st.one_of(st.none(), rewards) if none else rewards
    row = st.lists(value, min_size=k, max_size=k)
    rows: list[list[float | None]] = []
    for _ in range(groups):
        if all_equal:
            shared = draw(row)
            rows += [shared if not none or draw(st.booleans()) else [None] * k for _ in range(size)]
        else:
            rows += [draw(row) for _ in range(size)]
    scores = _tensor((math.nan if v is None else v for r in rows for v in r), dtype).view(groups * size, k)
    extra = {}
    if token_level:
        n, t = groups * size, draw(st.integers(1, max_tokens))
        lengths = draw(st.lists(st.integers(1, t), min_size=n, max_size=n))
        grid = lambda: _tensor(draw(st.lists(rewards, min_size=n * t, max_size=n * t)), dtype).view(n, t)  # noqa: E731
        extra = dict(token_rewards=grid(), values=grid(),
                     mask=torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1))
    if turn_level:
        extra = _turns(draw, groups, size, max_turns, value if turn_rewards else st.none(), equal_turns, dtype)
    return Rollout(rewards=scores, weights=_tensor(draw(st.lists(weights, min_size=k, max_size=k)), dtype),
                   group_size=size, **extra)


def _turns(draw, groups: int, size: int, max_turns: int, value, equal_turns: bool, dtype) -> dict:
    """turn_index, mask and turn_rewards of ``groups × size`` multi-turn episodes (see :func:`rollouts`)."""
    counts: list[int] = []
    for _ in range(groups):
        shared = draw(st.integers(1, max_turns))
        counts += [shared if equal_turns else draw(st.integers(1, max_turns)) for _ in range(size)]
    rows = []
    for count in counts:
        row: list[int] = []
        for k in range(count):
            row += [k] * draw(st.integers(1, 2)) + [-1] * draw(st.integers(0, 1))
        rows.append(row)
    width = max(len(row) for row in rows)
    index = torch.tensor([row + [-1] * (width - len(row)) for row in rows])
    given = [[draw(value) if k < count else None for k in range(max_turns)] for count in counts]
    turn_rewards = _tensor((math.nan if v is None else v for row in given for v in row), dtype).view(-1, max_turns)
    return dict(turn_index=index, mask=index >= 0, turn_rewards=turn_rewards)


SAMPLE_COMPLETIONS = (
    "", " ", "42", "The answer is $\\boxed{4}$.", "<think>2 + 2 = 4</think>The answer is 4.",
    "<think>unfinished", "</think>4", "the the the the the the", "Ответ: 4 ✓", "\n\n\t",
)


@st.composite
def reward_inputs(
    draw,
    *,
    min_size: int = 1,
    max_size: int = 4,
    completion_format: str = "text",
    columns: Iterable[str] = (),
) -> dict[str, Any]:
    """Keyword arguments of one reward-function call: prompts, completions, completion_ids, columns.

    ``completion_format`` is ``"text"`` (strings), ``"messages"`` (conversational: a list of
    ``{"role", "content"}`` dicts per completion) or ``"any"`` (either, per call). Each name in
    ``columns`` becomes an extra dataset column of strings (``solution``, ...).
    """
    size = draw(st.integers(min_size, max_size))
    text = st.one_of(st.sampled_from(SAMPLE_COMPLETIONS), st.text(max_size=40))
    prompts = draw(st.lists(text, min_size=size, max_size=size))
    completions = draw(st.lists(text, min_size=size, max_size=size))
    if completion_format == "any":
        completion_format = draw(st.sampled_from(["text", "messages"]))
    ids = [list(c.encode("utf-8")) for c in completions]  # a byte-level "tokenizer"
    if completion_format == "messages":
        prompts = [[{"role": "user", "content": p}] for p in prompts]
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    elif completion_format != "text":
        raise ValueError(f"completion_format={completion_format!r}; use 'text', 'messages' or 'any'")
    values = {"prompts": prompts, "completions": completions, "completion_ids": ids}
    for column in columns:
        values[column] = draw(st.lists(text, min_size=size, max_size=size))
    return values
