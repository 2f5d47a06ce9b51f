"""Compose losses by name: total = Σ_k w_k · reduce(ℓ_k), each part logged under its own name.

A loss entry in a config is a name or a mapping ``{name, weight, **params}``. Parameters the
method shares with its losses (DPO's ``beta``, ``label_smoothing``) fill any parameter the
entry leaves unset, so ``DPOConfig(beta=0.2, loss_type="ipo")`` means what a TRL user expects.
Everything is resolved and validated when the objective is built, before any model loads.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from .batches import masked_mean
from .errors import PlaitError
from .registry import Component, Registry

# How a loss's output is reduced to a scalar, by the shape it declares with output=...
OUTPUTS = ("example", "token", "scalar")


@attrs.frozen
class LossTerm:
    component: Component
    weight: float
    params: Any

    @property
    def name(self) -> str:
        return self.component.name

    @property
    def output(self) -> str:
        return self.component.options.get("output", "example")

    def __call__(self, batch) -> Tensor:
        return self.component.obj(batch, self.params)


def normalise_loss_specs(loss: Any, loss_weights: Sequence[float] | None = None, field: str = "loss") -> list[dict]:
    """Accept ``"sigmoid"``, ``["sigmoid", "sft"]`` (+ TRL's ``loss_weights``) or ``[{name, weight, …}]``."""
    entries = [loss] if isinstance(loss, (str, Mapping)) else list(loss or [])
    if not entries:
        raise PlaitError(f"{field} is empty; name at least one loss, e.g. {field}: [sigmoid]")
    if loss_weights is not None and len(loss_weights) != len(entries):
        raise PlaitError(
            f"loss_weights has {len(loss_weights)} values for {len(entries)} losses {entries!r}; "
            "give one weight per loss"
        )
    specs = []
    for i, entry in enumerate(entries):
        spec = {"name": entry} if isinstance(entry, str) else dict(entry)
        if "name" not in spec:
            raise PlaitError(f"{field}[{i}] has no 'name'; write e.g. {{name: sigmoid, weight: 1.0}}")
        if loss_weights is not None:
            spec.setdefault("weight", loss_weights[i])
        specs.append(spec)
    return specs


class Objective:
    """A weighted sum of registered losses over one typed batch."""

    def __init__(self, terms: list[LossTerm]):
        self.terms = terms

    @classmethod
    def build(
        cls,
        specs: list[dict],
        registry: Registry,
        *,
        family: str,
        consumes: type,
        shared: Mapping[str, Any] = {},
        field: str = "loss",
    ) -> "Objective":
        terms = []
        for i, spec in enumerate(specs):
            spec = dict(spec)
            component = registry.get(spec.pop("name"), family=family)
            weight = spec.pop("weight", 1.0)
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise PlaitError(f"{field}[{i}].weight={weight!r} must be a finite number")
            wanted = component.options.get("consumes")
            if wanted is not None and wanted is not consumes:
                raise PlaitError(
                    f"{field}[{i}]: loss {component.name!r} consumes {wanted.__name__} but this method "
                    f"provides {consumes.__name__}; pick a loss of the '{family}.' family"
                )
            if component.params is not None:
                accepted = {a.name for a in attrs.fields(component.params)}
                spec = {**{k: v for k, v in shared.items() if k in accepted}, **spec}
            terms.append(LossTerm(component, float(weight), component.make_params(**spec)))
        return cls(terms)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    def params_of(self, name: str):
        return next(t.params for t in self.terms if t.name == name)

    def __call__(
        self, batch, *, example_weights: Tensor | None = None, mask: Tensor | None = None,
        num_tokens: Tensor | float | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Return the total loss and each part's reduced (unweighted) value."""
        total, parts = 0.0, {}
        for term in self.terms:
            value = term(batch)
            if term.output == "example":
                value = (value * example_weights).mean() if example_weights is not None else value.mean()
            elif term.output == "token":
                value = (value * mask).sum() / num_tokens if num_tokens is not None else masked_mean(value, mask)
            parts[term.name] = value
            total = total + term.weight * value
        if not torch.is_tensor(total):
            raise PlaitError("the objective has no terms")
        return total, parts
