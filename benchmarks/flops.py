"""Model FLOPs of one optimizer step per method: the matmul work the step *needs*, counted alike for every library.

benchmarks/trl_side_by_side.py divides these by the measured seconds per step (achieved FLOP/s) and
by a matmul peak measured in the same run; a library that does more work than this count (a prompt
held twice, logits at positions no loss reads, attention recomputed, decoding without a KV cache)
shows a lower fraction, never a higher count.

The formula. With ``h`` hidden size, ``f`` intermediate size, ``n`` decoder layers, ``a`` attention
heads, ``k`` key/value heads, ``d`` head size and ``V`` vocabulary (a Llama-style decoder: q, k, v, o
projections, a gated MLP of gate, up and down):

* linears, forward, per token: ``W = n · 2 · (h·a·d + 2·h·k·d + a·d·h + 3·h·f)`` (2·in·out per linear);
* attention, forward, per token ``t``: ``n · 4 · a·d · c(t)`` (scores ``Q·Kᵀ`` and values ``P·V``,
  2·a·d each per context token), ``c(t)`` the causal context of ``t``: itself and every token before it
  in its sequence — the half of the square a causal kernel needs. A sequence of ``T`` tokens after
  ``p`` tokens it attends over (a shared prompt) costs ``n · 4·a·d · (T·p + T·(T+1)/2)``;
* LM head, forward: ``2·h·V`` per position whose next-token log-prob the method needs: SFT every
  trained token, the preference methods (DPO, KTO, ORPO, CPO), GRPO, online DPO and GKD the
  completion tokens only; a reward model none, its score head ``2·h`` per scored sequence (one
  position each). Tied embeddings change nothing: the head's matmuls are the same, and the input
  embedding is a lookup, not a matmul;
* LoRA of rank ``r`` on every decoder linear: ``2·r·(in + out)`` more per token and linear, forward.

A training pass (the policy's forward and backward) costs its forward plus a backward of twice the
forward for trainable weights (the input's gradient and the weight's), once the forward for frozen
weights (the input's gradient only: LoRA's base weights and a LoRA run's LM head), and twice the
forward for attention. Gradient checkpointing adds one more forward of the decoder layers' linears
(never the LM head, which sits outside the checkpointed layers); attention's forward is counted in
that recompute only with ``recompute_attention`` — plait's checkpointing keeps the attention kernels'
outputs (core/engine/checkpointing.py), TRL's recomputes them; the side-by-side counts the needed
work (no attention recompute) for both. A no-grad pass (a reference model, the KL pass of KTO, a
GKD teacher) costs its forward alone.

Each pass holds each distinct prompt once (the work a prefix-sharing batch does; a library that
repeats the prompt per completion does more): a pair is the prompt's ``P`` tokens, then each
completion's ``C`` tokens attending over them. Per method (``LAYOUTS``): SFT one pass; DPO the
policy's pass and the reference's no-grad pass over the same tokens (DPO + LoRA: the reference is
the base model, no adapters); ORPO and CPO the policy's pass alone; KTO the policy's pass over each
row, its no-grad pass over each row's prompt with the mismatched (KL) completion, and the
reference's pass over the prompt with both; the reward model the policy's pass with the score head.

Generation (GRPO, online DPO, GKD on-policy) is counted apart: each prompt's prefill once per group
(its last position through the LM head), then each completion's new tokens one decode forward each,
with a KV cache (attention over the context grown so far, LM head at the new position); the first
new token comes from the prefill's logits, so ``N`` new tokens take ``N − 1`` decode forwards per
completion. Completions are counted at their full ``max_new_tokens`` (an early end does less). GRPO
adds the reference's pass when ``beta`` is not 0; online DPO always (its DPO loss); GKD the
teacher's no-grad pass, and with ``lmbda`` > 0 the expected step: ``lmbda`` of them on sampled
completions (generation + passes), the rest on the dataset's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence


@dataclass(frozen=True)
class Model:
    """The sizes the formula reads from a transformers config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> "Model":
        """From a transformers config (``head_dim`` defaults to hidden / heads, ``num_key_value_heads`` to heads)."""
        heads = config.num_attention_heads
        return cls(hidden=config.hidden_size, intermediate=config.intermediate_size, layers=config.num_hidden_layers,
                   heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size)

    def linears(self) -> list[tuple[int, int, int]]:
        """Each decoder linear as (in, out, how many per layer): q, k and v, o, gate and up, down."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return [(h, q, 1), (h, kv, 2), (q, h, 1), (h, f, 2), (f, h, 1)]

    def linear_flops(self, lora: int = 0) -> int:
        """Forward FLOPs of every decoder layer's linears for one token (LoRA of rank ``lora`` included)."""
        return self.layers * sum(2 * count * (i * o + lora * (i + o)) for i, o, count in self.linears())

    def lora_flops(self, lora: int) -> int:
        return self.linear_flops(lora) - self.linear_flops()

    def attention_flops(self, tokens: int, past: int = 0) -> int:
        """Forward FLOPs of every layer's attention for ``tokens`` tokens after ``past`` tokens of their sequence."""
        return self.layers * 4 * self.heads * self.head_dim * (tokens * past + tokens * (tokens + 1) // 2)

    def head_flops(self, positions: int) -> int:
        return 2 * self.hidden * self.vocab * positions


@dataclass(frozen=True)
class Segment:
    """``tokens`` tokens of one sequence after ``past`` tokens of it (attended over, counted elsewhere);
    ``head``: how many of its positions go through the LM head."""

    tokens: int
    past: int = 0
    head: int = 0


@dataclass(frozen=True)
class Pass:
    """One model's pass over a batch: forward and backward (``train``) or a no-grad forward.

    ``lora``: LoRA rank on every decoder linear (0: none; with it only LoRA's weights train, the LM
    head is frozen); ``scores``: positions through a one-output score head (a reward model)."""

    segments: tuple[Segment, ...]
    train: bool = True
    lora: int = 0
    scores: int = 0


@dataclass(frozen=True)
class Generation:
    """``samples`` completions of ``new`` tokens sampled after one ``prompt``-token prompt (one group)."""

    prompt: int
    new: int
    samples: int


@dataclass
class Step:
    """What one optimizer step runs: its passes and its generation; ``weight`` scales all of it (GKD's lmbda)."""

    passes: list[Pass] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    weight: float = 1.0


def pass_flops(model: Model, pass_: Pass, checkpointing: bool, recompute_attention: bool = False) -> dict[str, float]:
    """FLOPs of one pass by part: forward, backward, recompute; ``lm_head`` (forward and backward) is part of those."""
    tokens = sum(s.tokens for s in pass_.segments)
    head = model.head_flops(sum(s.head for s in pass_.segments)) + 2 * model.hidden * pass_.scores
    base, lora = model.linear_flops() * tokens, model.lora_flops(pass_.lora) * tokens
    attention = sum(model.attention_flops(s.tokens, s.past) for s in pass_.segments)
    forward = base + lora + attention + head
    if not pass_.train:
        return {"forward": forward, "backward": 0, "recompute": 0, "lm_head": head}
    frozen = pass_.lora > 0  # under LoRA the base weights and the LM head take the input's gradient only
    backward = (1 if frozen else 2) * (base + head) + 2 * (lora + attention)
    recompute = (base + lora + (attention if recompute_attention else 0)) if checkpointing else 0
    return {"forward": forward, "backward": backward, "recompute": recompute, "lm_head": head * (2 if frozen else 3)}


def generation_flops(model: Model, generation: Generation) -> float:
    """A group's prefill (once) and each sample's ``new − 1`` cached decode forwards."""
    p, n = generation.prompt, generation.new
    prefill = model.linear_flops() * p + model.attention_flops(p) + model.head_flops(1)
    # the decode forward of new token j (1..n-1) reads token j's input at context p + j
    decode = sum(model.linear_flops() + model.attention_flops(1, p + j - 1) + model.head_flops(1) for j in range(1, n))
    return prefill + generation.samples * decode


def step_flops(model: Model, steps: Sequence[Step], checkpointing: bool, recompute_attention: bool = False) -> dict:
    """Total, training and generation FLOPs (and the training's parts) of the weighted sum of ``steps``."""
    out = dict.fromkeys(("forward", "backward", "recompute", "lm_head", "generation"), 0.0)
    for step in steps:
        for pass_ in step.passes:
            for part, value in pass_flops(model, pass_, checkpointing, recompute_attention).items():
                out[part] += step.weight * value
        out["generation"] += step.weight * sum(generation_flops(model, g) for g in step.generations)
    out["training"] = out["forward"] + out["backward"] + out["recompute"]
    out["total"] = out["training"] + out["generation"]
    return out


# -- per method: rows of token counts -> the step's passes --------------------------------------
# A row is (prompt tokens, [completion tokens, ...]): SFT's row is (1, [T - 1]) (every token but the
# first is trained), a pair's (P, [chosen, rejected]), KTO's (P, [completion, KL completion]), an
# online method's (P, [new tokens] * samples), GKD's (P, [completion]).

Row = tuple[int, Sequence[int]]


def shared(prompt: int, completions: Sequence[int], head: bool = True) -> list[Segment]:
    """The prompt once, then each completion over it (its tokens through the LM head when ``head``)."""
    return [Segment(prompt)] + [Segment(c, past=prompt, head=c if head else 0) for c in completions]


def segments(rows: Sequence[Row], head: bool = True) -> tuple[Segment, ...]:
    return tuple(s for prompt, completions in rows for s in shared(prompt, completions, head))


def policy_only(rows: Sequence[Row], options: Mapping) -> list[Step]:
    """SFT, ORPO, CPO: the policy's pass alone."""
    return [Step([Pass(segments(rows))])]


def with_reference(rows: Sequence[Row], options: Mapping) -> list[Step]:
    """DPO: the policy's pass and the reference's (the base model under LoRA) over the same tokens."""
    lora = options.get("lora", 0)
    return [Step([Pass(segments(rows), lora=lora), Pass(segments(rows), train=False)])]


def reward_model(rows: Sequence[Row], options: Mapping) -> list[Step]:
    return [Step([Pass(segments(rows, head=False), scores=sum(len(c) for _, c in rows))])]


def kto(rows: Sequence[Row], options: Mapping) -> list[Step]:
    """The policy trains on (prompt, completion) and scores (prompt, KL completion) without grad; the reference
    scores both."""
    policy = [(p, c[:1]) for p, c in rows]
    kl = [(p, c[1:]) for p, c in rows]
    return [Step([Pass(segments(policy)), Pass(segments(kl), train=False), Pass(segments(rows), train=False)])]


def online(rows: Sequence[Row], options: Mapping) -> list[Step]:
    """GRPO (reference when ``beta`` ≠ 0) and online DPO (``reference`` True): sample, then train on the samples."""
    passes = [Pass(segments(rows))]
    if options.get("reference") or options.get("beta", 0):
        passes.append(Pass(segments(rows), train=False))
    return [Step(passes, [Generation(p, max(c), len(c)) for p, c in rows])]


def gkd(rows: Sequence[Row], options: Mapping) -> list[Step]:
    """The student's pass and the teacher's no-grad pass; ``lmbda`` of steps on ``new``-token samples instead."""
    lmbda, new = options.get("lmbda", 0.0), options.get("max_new_tokens", 0)
    sampled = [(p, [new]) for p, _ in rows]
    steps = [Step([Pass(segments(rows)), Pass(segments(rows), train=False)], weight=1 - lmbda)]
    if lmbda:
        steps.append(Step([Pass(segments(sampled)), Pass(segments(sampled), train=False)],
                          [Generation(p, new, 1) for p, _ in rows], weight=lmbda))
    return steps


LAYOUTS: dict[str, Callable[[Sequence[Row], Mapping], list[Step]]] = {
    "sft": policy_only, "dpo": with_reference, "dpo_lora": with_reference, "kto": kto, "reward_model": reward_model,
    "orpo": policy_only, "cpo": policy_only, "grpo": online, "online_dpo": online, "gkd": gkd,
}


def method_flops(method: str, model: Model, rows: Sequence[Row], options: Mapping, checkpointing: bool,
                 recompute_attention: bool = False) -> dict:
    """:func:`step_flops` of ``method``'s layout of ``rows`` (one step's rows)."""
    return step_flops(model, LAYOUTS[method](rows, options), checkpointing, recompute_attention)


def gemm_shapes(model: Model, method: str, rows: Sequence[Row], options: Mapping) -> list[tuple[int, int, int, int]]:
    """The training forward's GEMMs as (M, in, out, how many): each distinct decoder linear shape with M
    the tokens of the step's first training pass, and the LM head with M its head positions."""
    first = next(p for step in LAYOUTS[method](rows, options) for p in step.passes if p.train)
    tokens, head = sum(s.tokens for s in first.segments), sum(s.head for s in first.segments)
    counts: dict[tuple[int, int], int] = {}
    for i, o, count in model.linears():
        counts[(i, o)] = counts.get((i, o), 0) + count * model.layers
    shapes = [(tokens, i, o, count) for (i, o), count in counts.items()]
    return shapes + ([(head, model.hidden, model.vocab, 1)] if head else [])
