"""Compose losses by name: total = Σ_k w_k · reduce(ℓ_k), each part logged under its own name.

A loss entry in a config is a name or a mapping ``{name, weight, **params}``. Parameters the
method shares with its losses (DPO's ``beta``, ``label_smoothing``) fill any parameter the
entry leaves unset, so ``DPOConfig(beta=0.2, loss_type="ipo")`` means what a TRL user expects.
Everything is resolved and validated when the objective is built, before any model loads.

Metrics follow one convention for every family: a metrics function maps the loss batch to named
tensors (one value per example, or already reduced), and :meth:`Objective.metrics` logs each one's
mean. The method gives its family's default when it builds the objective (DPO's rewards/* and
logps/*); a loss's ``metrics=`` adds names or replaces the default's (the first loss to give a name
wins), so a new loss of a family logs what the family logs without writing anything.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Mapping, Sequence

import attrs
import torch
from torch import Tensor

from plait.errors import PlaitError
from plait.registry import Component, Registry

from .batches import masked_mean

# How a loss's output is reduced to a scalar, by the shape it declares with output=...
OUTPUTS = ("example", "token", "scalar")


@attrs.define(eq=False)
class LossTerm:
    """One registered loss in an objective, with its weight and parameters.

    Every call checks what the plugin returned against the shape it declared with ``output=``
    and notes, without a device sync, whether the value was finite, so a trainer can name the
    part that went NaN/inf (:meth:`Objective.nonfinite_terms`) when a step's loss does.
    """

    component: Component
    weight: float
    params: Any
    _nonfinite: Tensor | None = attrs.field(default=None, init=False, repr=False)

    @property
    def name(self) -> str:
        return self.component.name

    @property
    def output(self) -> str:
        return declared_output(self.component)

    @property
    def origin(self) -> str:
        return provenance(self.component)

    def __call__(self, batch, mask: Tensor | None = None) -> Tensor:
        value = self.component.obj(batch, self.params)
        self._check(value, batch, mask)
        flag = ~torch.isfinite(value.detach()).all()
        self._nonfinite = flag if self._nonfinite is None else self._nonfinite | flag
        return value

    def _check(self, value: Any, batch, mask: Tensor | None) -> None:
        """Refuse a value the reduction would silently mis-average (or crash on), naming the plugin."""
        expected = {"example": "[B] (one value per example)", "token": "[B, T] like the mask",
                    "scalar": "a 0-dim tensor"}
        where = f"loss {self.name!r} ({self.origin}) declares output={self.output!r}"
        if not torch.is_tensor(value):
            raise PlaitError(f"{where} but returned a {type(value).__name__}, not a tensor; return "
                             f"{expected[self.output]} computed from the batch's tensors")
        wanted = _expected_shape(self.output, batch, mask)
        if wanted is not None and tuple(value.shape) != wanted:
            raise PlaitError(f"{where} and must return {expected[self.output]}, shape {wanted}, but returned shape "
                             f"{tuple(value.shape)}; fix its shape or register it with the output= it returns")
        if torch.is_grad_enabled() and not value.requires_grad and _needs_grad(batch):
            raise PlaitError(f"{where} but returned a tensor without gradient (detached, .item() or built anew), so "
                             "training could not move the model through it; compute it from the batch's tensors")

    def reset_watch(self) -> None:
        self._nonfinite = None

    def saw_nonfinite(self) -> bool:
        """Did any call since :meth:`reset_watch` return NaN/inf? (syncs with the device)"""
        return self._nonfinite is not None and bool(self._nonfinite)


def declared_output(component: Component) -> str:
    """The shape a loss declares: ``output=``, or ``reduces=True`` (the older spelling of a scalar)."""
    return component.options.reduction


def provenance(component: Component) -> str:
    """Where a loss comes from, for messages: its plugin and distribution."""
    return f"plugin {component.plugin}, distribution {component.distribution} {component.version}"


def _expected_shape(output: str, batch, mask: Tensor | None) -> tuple[int, ...] | None:
    if output == "scalar":
        return ()
    if output == "example":
        return (batch.batch_size,) if hasattr(batch, "batch_size") else None
    mask = mask if mask is not None else getattr(batch, "mask", None)
    return tuple(mask.shape) if mask is not None else None


def _needs_grad(batch) -> bool:
    """Does any tensor of the batch carry gradient (the policy's log-probs while training)?"""
    if not attrs.has(type(batch)):
        return False
    return any(torch.is_tensor(v) and v.requires_grad for v in attrs.astuple(batch, recurse=False))


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


@attrs.define
class LossChoice:
    """The loss fields every method's params share (inherit them): TRL's ``loss_type`` (a name or a
    list, with ``loss_weights`` for several) or plait's ``loss`` (``[{name, weight, **params}]``),
    not both; neither means the method's ``default_loss``. Malformed lists fail when the params are
    built; names are resolved against the registry when the trainer builds its objective.
    """

    field_help: ClassVar[dict[str, str]] = {
        "loss_type": "loss name, or a list of names summed with loss_weights (null: the method's default)",
        "loss_weights": "one weight per loss_type entry, in order (null: 1 each)",
        "loss": "plait's loss list [{name, weight, ...params}], instead of loss_type (plait list losses)",
    }

    default_loss: ClassVar[str]
    loss_type: str | list | None = None
    loss_weights: list | None = None
    loss: str | list | None = None

    def __attrs_post_init__(self) -> None:
        if self.loss is not None and self.loss_type is not None:
            raise PlaitError("give either loss (plait's list of {name, weight, ...}) or loss_type (TRL's names), "
                             "not both")
        self.loss_specs()

    @property
    def loss_field(self) -> str:
        """The field the losses came from, for error messages."""
        return "loss" if self.loss is not None else "loss_type"

    def loss_specs(self) -> list[dict]:
        if self.loss is not None:
            return normalise_loss_specs(self.loss, field="loss")
        return normalise_loss_specs(self.loss_type or self.default_loss, self.loss_weights, field="loss_type")


Metrics = Callable[[Any], Mapping[str, Tensor]]


class Objective:
    """A weighted sum of registered losses over one typed batch, and what it logs (``default_metrics``:
    the family's metrics of a batch, see the module's docstring)."""

    def __init__(self, terms: list[LossTerm], default_metrics: Metrics | None = None):
        self.terms = terms
        self.default_metrics = default_metrics

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
        metrics: Metrics | None = None,
    ) -> "Objective":
        terms = []
        for i, spec in enumerate(specs):
            spec = dict(spec)
            component = registry.get(spec.pop("name"), family=family)
            weight = spec.pop("weight", 1.0)
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise PlaitError(f"{field}[{i}].weight={weight!r} must be a finite number")
            wanted = component.options.consumes
            if wanted is not None and wanted is not consumes:
                raise PlaitError(
                    f"{field}[{i}]: loss {component.name!r} consumes {wanted.__name__} but this method "
                    f"provides {consumes.__name__}; pick a loss of the '{family}.' family"
                )
            if declared_output(component) not in OUTPUTS:
                raise PlaitError(f"{field}[{i}]: loss {component.name!r} ({provenance(component)}) is registered with "
                                 f"output={declared_output(component)!r}; the plugin must declare one of "
                                 f"{', '.join(OUTPUTS)}")
            if component.params is not None:
                accepted = {a.name for a in attrs.fields(component.params)}
                spec = {**{k: v for k, v in shared.items() if k in accepted}, **spec}
            terms.append(LossTerm(component, float(weight), component.make_params(**spec)))
        return cls(terms, metrics)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    def params_of(self, name: str):
        return next(t.params for t in self.terms if t.name == name)

    def reset_watch(self) -> None:
        for term in self.terms:
            term.reset_watch()

    def nonfinite_terms(self) -> list[LossTerm]:
        """The terms that returned NaN/inf since the last :meth:`reset_watch`."""
        return [term for term in self.terms if term.saw_nonfinite()]

    def __call__(
        self, batch, *, example_weights: Tensor | None = None, mask: Tensor | None = None,
        num_tokens: Tensor | float | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Return the total loss and each part's reduced (unweighted) value."""
        total, parts = 0.0, {}
        for term in self.terms:
            value = term(batch, mask)
            if term.output == "example":
                value = (value * example_weights).mean() if example_weights is not None else value.mean()
            elif term.output == "token":
                value = (value * mask).sum() / num_tokens if num_tokens is not None else masked_mean(value, mask)
            parts[term.name] = value
            total = total + term.weight * value
        if not torch.is_tensor(total):
            raise PlaitError("the objective has no terms")
        return total, parts

    def metrics(self, batch, parts: Mapping[str, Tensor] = {}) -> dict[str, Tensor]:
        """What a step logs from its loss batch, without gradient: the mean of each tensor the losses'
        ``metrics=`` give (the first loss to give a name wins), of the family's default under the names they
        leave, and ``loss/<name>`` for each of ``parts`` (:meth:`__call__`'s) when the objective composes several."""
        values: dict[str, Tensor] = {}
        with torch.no_grad():
            given = [t.component.options.metrics(batch, t.params) for t in self.terms
                     if t.component.options.metrics is not None]
            if self.default_metrics is not None:
                given.append(self.default_metrics(batch))
            for source in given:
                values.update({name: value.detach().mean() for name, value in source.items() if name not in values})
        if len(parts) > 1:
            values.update({f"loss/{name}": value.detach() for name, value in parts.items()})
        return values
