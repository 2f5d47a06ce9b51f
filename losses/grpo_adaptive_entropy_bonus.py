"""Adaptive entropy bonus: the entropy bonus with its coefficient steered by the measured entropy.

He et al. 2025, "Skywork Open Reasoner 1 Technical Report", adaptive entropy control, as TRL 1.16
runs it (``use_adaptive_entropy``). With H̄ the mean token entropy of ``grpo.entropy_bonus``:

    loss = −c_applied·H̄ ÷ gradient-accumulation steps,   c_applied = c if Ĥ ≤ H_target else 0

Ĥ is the entropy measured over the previous optimizer step: Σ H·m′ / Σ m′ over every micro-batch
of that step on every process (∞ before the first step, so the first step has no bonus). After
each optimizer step the coefficient moves one step of Δ:

    c ← min(c + Δ, c_max) if Ĥ ≤ H_target else max(c − Δ, c_min)

so the bonus switches on only once entropy has fallen to the target, and grows while it stays
there. The coefficient and Ĥ are training state: the method saves them with each checkpoint. The
term's weight multiplies c (leave it at 1). Returns a scalar.
"""

from __future__ import annotations

import math
from typing import Callable

import attrs
import torch
from torch import Tensor

from plait import hookimpl
from plait.engine.batches import PolicyTokens
from plait.params import finite, non_negative

from ._grpo import entropy_sum, in_unit_interval


@attrs.define
class EntropyController:
    """The coefficient c, the last step's entropy Ĥ and this step's running [Σ H·m′, Σ m′]."""

    coef: float
    last_entropy: float = math.inf
    window: Tensor | None = None

    def observe(self, entropy_sum: Tensor, tokens: Tensor) -> None:
        stats = torch.stack([entropy_sum.detach().float(), tokens.detach().float()])
        self.window = stats if self.window is None else self.window + stats


@attrs.frozen
class AdaptiveEntropyParams:
    """TRL 1.16's names and defaults; ``entropy_coef`` is the starting coefficient."""

    entropy_coef: float = attrs.field(default=0.0, validator=finite)
    entropy_target: float = attrs.field(default=0.2, validator=finite)
    entropy_coef_delta: float = attrs.field(default=0.005, validator=non_negative)
    entropy_coef_min: float = attrs.field(default=0.0, validator=finite)
    entropy_coef_max: float = attrs.field(default=1.0, validator=finite)
    top_entropy_quantile: float = attrs.field(default=1.0, validator=in_unit_interval)
    controller: EntropyController = attrs.field(
        init=False, eq=False, repr=False,
        default=attrs.Factory(lambda self: EntropyController(coef=self.entropy_coef), takes_self=True))

    def __attrs_post_init__(self) -> None:
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"entropy_coef_min={self.entropy_coef_min} is above entropy_coef_max="
                             f"{self.entropy_coef_max}; the coefficient's range must not be empty")

    @property
    def applied_coef(self) -> float:
        c = self.controller
        return c.coef if c.last_entropy <= self.entropy_target else 0.0

    # -- called by the trainer: the state that lives across steps --------------------------------
    def end_optimizer_step(self, reduce: Callable[[Tensor], Tensor]) -> dict[str, float]:
        """Measure this step's entropy Ĥ (the window summed over processes by ``reduce``) and move c
        one Δ: up when Ĥ is at most the target, down otherwise; returns the metrics to log."""
        c = self.controller
        if c.window is not None:
            total, tokens = reduce(c.window).tolist()
            c.last_entropy = total / max(tokens, 1.0)
            if c.last_entropy <= self.entropy_target:
                c.coef = min(c.coef + self.entropy_coef_delta, self.entropy_coef_max)
            else:
                c.coef = max(c.coef - self.entropy_coef_delta, self.entropy_coef_min)
            c.window = None
        return {"entropy_coef": c.coef}

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.controller.coef, "last_entropy": self.controller.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.controller.coef, self.controller.last_entropy = state["entropy_coef"], state["last_entropy"]
        self.controller.window = None


def grpo_adaptive_entropy_bonus(batch: PolicyTokens, p: AdaptiveEntropyParams):
    total, tokens = entropy_sum(batch, p.top_entropy_quantile)
    if torch.is_grad_enabled():  # a step the policy learns from; evaluation (no gradient) never moves c
        p.controller.observe(total, tokens)
    return -p.applied_coef * (total / tokens.clamp(min=1.0)) / batch.gradient_accumulation_steps


@hookimpl
def register_losses(register):
    register("grpo.adaptive_entropy_bonus", grpo_adaptive_entropy_bonus, params=AdaptiveEntropyParams,
             consumes=PolicyTokens, output="scalar")
