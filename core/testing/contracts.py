"""Contract checks: one call proves a loss, reward or advantage estimator behaves like a plait part.

    check_loss("dpo.simpo")                           # by registry name (installed plugins)
    check_reward(component)                           # or a registry Component
    check_advantage_estimator("advantage.group", plugins)

Each check draws inputs with :mod:`plait.testing.strategies` (hypothesis, a fixed seed, a few
dozen examples) and raises :class:`ContractViolation` naming the property that failed and the
smallest input hypothesis found that breaks it, written as code you can paste into a test.

What is checked follows from what the component declared when it registered:

* losses: ``consumes=`` (the batch class), ``output=`` ("example" → ``[B]``, "token" →
  ``[B, T]``, "scalar" → ``[]``), ``batch_coupled=True`` (skip batch-mean independence),
  ``monotone="non_increasing_in_margin"`` (check it);
* rewards: ``completion_format=`` ("text", the default; "messages"; or "any") and
  ``columns=`` (dataset columns it reads; also found from required keyword parameters and from
  a ``column``/``*_column`` parameter);
* advantage estimators: ``token_level=True`` (advantages ``[N, T]`` from values and masks),
  ``zero_mean_per_group=True`` (check it), ``group_relative=False`` (skip all-equal → 0);
  :func:`check_turn_advantage_estimator` adds the turn-level properties of an estimator of
  multi-turn episodes (one advantage per turn, 0 outside turns, episode level without per-turn
  rewards), called by name since registration does not declare an estimator turn-level.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
import numbers
import pickle
from typing import Any, Callable, Sequence

import attrs
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import Tensor

from plait.data.chat import marks_generation
from plait.engine.objective import OUTPUTS
from plait.errors import PlaitError
from plait.manager import Plugins, make_plugins
from plait.registry import Component

from .strategies import HALF, WIDE_REWARDS, BatchKind, batch_kind, batch_size_of, reward_inputs, rollouts, take

__all__ = [
    "CHECKS", "ContractViolation", "check_advantage_estimator", "check_callbacks", "check_collator", "check_command",
    "check_component", "check_data_format", "check_generation_backend", "check_judge", "check_loss", "check_method",
    "check_packing_strategy", "check_params", "check_reward", "check_rollout_filter", "describe", "encoded_rows",
    "check_chat_template", "check_turn_advantage_estimator",
]

# The keyword arguments every reward function receives besides dataset columns.
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
DEFAULT_EXAMPLES = 25


class ContractViolation(AssertionError):
    """A component broke a contract: ``.component``, ``.property``, ``.detail``, ``.input``."""

    def __init__(self, component: str, prop: str, detail: str, input: str | None = None):
        self.component, self.property, self.detail, self.input = component, prop, detail, input
        message = f"{component} violates '{prop}': {detail}"
        if input is not None:
            message += f"\n  on input: {input}"
        super().__init__(message)


def describe(value: Any, indent: str | None = None) -> str:
    """``value`` as Python source: tensors with exact values and dtype, attrs batches by field.

    Fields left at their default are omitted. With ``indent`` an attrs batch is laid out one
    field per line.
    """
    if torch.is_tensor(value):
        return f"torch.tensor({value.tolist()!r}, dtype={value.dtype})"
    if attrs.has(type(value)):
        fields = [
            f"{f.alias}={describe(getattr(value, f.name))}" for f in attrs.fields(type(value))
            if f.default is attrs.NOTHING or isinstance(f.default, attrs.Factory)
            or getattr(value, f.name) is not f.default
        ]
        if indent is None:
            return f"{type(value).__name__}({', '.join(fields)})"
        inner = indent + "    "
        return f"{type(value).__name__}(\n" + "".join(f"{inner}{f},\n" for f in fields) + f"{indent})"
    if isinstance(value, dict):
        if indent is None:
            return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + "}"
        inner = indent + "    "
        return "{\n" + "".join(f"{inner}{k!r}: {describe(v)},\n" for k, v in value.items()) + indent + "}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return repr(value)


def _shown(value: Any) -> str:
    return describe(value, "  ")


def _settings(max_examples: int) -> settings:
    # Fixed seed and no example database: the same inputs on every machine, so CI cannot flake
    # and a failure reproduces from its message alone.
    return settings(
        max_examples=max_examples, deadline=None, database=None, derandomize=True,
        report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )


def _for_all(strategy, prop: Callable[[Any], None], max_examples: int) -> None:
    @_settings(max_examples)
    @given(strategy)
    def property_holds(value):
        prop(value)

    # The inputs are a handful of numbers: one thread. Intra-op threads only add barriers, which
    # cost milliseconds per op on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        property_holds()
    finally:
        torch.set_num_threads(threads)


def _component(component_or_name: Component | str, registry: str, plugins: Plugins | None) -> Component:
    if isinstance(component_or_name, Component):
        return component_or_name
    plugins = make_plugins() if plugins is None else plugins
    return plugins.registries[registry].get(component_or_name)


def _who(component: Component) -> str:
    where = f" ({component.distribution} {component.version})" if component.version not in ("-", "?") else ""
    return f"{component.kind} {component.name!r}{where}"


# Values tried, in order, for parameters that have no default (``soft_overlong``'s max_len).
FILL_CANDIDATES = (10, 100, 1, 1000, 0.5, 0.1, 0, "x")


def _base_values(component: Component, params: dict | None) -> dict:
    """``params`` plus a value for each required parameter left out: the first combination accepted."""
    values = dict(params or {})
    if component.params is None:
        return values
    missing = [f.alias for f in attrs.fields(component.params)
               if f.init and f.default is attrs.NOTHING and f.alias not in values]
    if not missing:
        return values
    for combination in itertools.islice(itertools.product(FILL_CANDIDATES, repeat=len(missing)), 1000):
        trial = {**values, **dict(zip(missing, combination))}
        try:
            component.make_params(**trial)
        except PlaitError:
            continue
        return trial
    raise ContractViolation(_who(component), "parameters validated", f"parameters {missing} have no default and "
                            "none of the values the kit tries is accepted; pass params={...} to the check")


def _make_params(component: Component, values: dict) -> Any:
    try:
        return component.make_params(**values)
    except PlaitError as err:
        raise ContractViolation(_who(component), "parameters validated",
                                f"cannot build its parameters {values}: {err}") from err


def _replace(obj: Any, **values: Any) -> Any:
    aliases = {f.name: f.alias for f in attrs.fields(type(obj))}
    return attrs.evolve(obj, **{aliases[name]: value for name, value in values.items()})


def _close(a: Tensor, b: Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol))


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------

NUMERIC_PROBES = (math.nan, math.inf, -math.inf, -1e9, -1.0, -1e-6, 0.0, 1e-6, 0.5, 1.0, 2.0, 1e9)
STRING_PROBES = ("__not_a_valid_value__",)


def _is_numeric(field: attrs.Attribute, default: Any) -> bool:
    if isinstance(default, bool):
        return False
    if isinstance(default, (int, float)):
        return True
    words = str(field.type).replace("|", " ").replace("[", " ").replace("]", " ").replace(",", " ").split()
    return default is None and bool({"float", "int"} & set(words))


def _validator_verdict(field: attrs.Attribute, value: Any, instance: Any) -> bool | None:
    """Whether ``field``'s converter and validator accept ``value``; None when that cannot be told."""
    converter = field.converter
    if converter is not None:
        if isinstance(converter, attrs.Converter):
            if converter.takes_self or converter.takes_field:
                return None
            converter = converter.converter
        try:
            value = converter(value)
        except Exception:  # noqa: BLE001 - a converter that raises rejects the value
            return False
    if field.validator is None:
        return True
    try:
        field.validator(instance, field, value)
    except Exception:  # noqa: BLE001 - any validator failure means "rejected"
        return False
    return True


def check_params(component: Component, params: dict | None = None) -> list[str]:
    """Bad parameter values raise at construction, with a PlaitError naming the parameter.

    The bad values come from each field's own validator: every probe value (NaN, ±inf, negative,
    zero, huge; a bogus string) that the validator rejects must make ``make_params`` raise.
    Numeric fields must have a validator, and it must reject NaN. Each probe replaces one value
    of ``params`` (default values, plus a value found for each parameter without a default).
    """
    if component.params is None:
        return []
    who, prop = _who(component), "parameters validated"
    base = _base_values(component, params)
    default = _make_params(component, base)
    for field in attrs.fields(component.params):
        if not field.init:
            continue
        value = getattr(default, field.name)
        numeric = _is_numeric(field, value)
        if numeric and field.validator is None:
            raise ContractViolation(who, prop, f"parameter {field.name!r} has no validator, so {field.name}=nan "
                                    "is accepted; add one from plait.params (positive, non_negative, in_range, finite)")
        if numeric and _validator_verdict(field, math.nan, default):
            raise ContractViolation(who, prop, f"{field.name}=nan passes its validator; reject non-finite values")
        probes = NUMERIC_PROBES if numeric else STRING_PROBES if isinstance(value, str) else ()
        for probe in probes:
            if _validator_verdict(field, probe, default) is not False:
                continue
            try:
                component.make_params(**{**base, field.alias: probe})
            except PlaitError as err:
                if field.name not in str(err):
                    raise ContractViolation(who, prop, f"{field.name}={probe!r} is rejected with {str(err)!r}, "
                                            "which does not name the parameter") from err
                continue
            except Exception as err:  # noqa: BLE001
                raise ContractViolation(who, prop, f"{field.name}={probe!r} raises {type(err).__name__}: {err} "
                                        "instead of a ValueError naming the parameter") from err
            raise ContractViolation(who, prop, f"{field.name}={probe!r} is accepted at construction although its "
                                    "validator rejects it")
    return [prop]


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


class _LossUnderTest:
    def __init__(self, component: Component, params: dict | None):
        self.component, self.who = component, _who(component)
        consumes = component.options.consumes
        if consumes is None:
            raise ContractViolation(self.who, "declared input", "registered without consumes=<batch class from "
                                    "plait.engine.batches>, so no method can tell what to hand it")
        self.kind: BatchKind = batch_kind(consumes)
        self.output = component.options.reduction
        if self.output not in OUTPUTS:
            raise ContractViolation(self.who, "declared input", f"output={self.output!r}; use one of {OUTPUTS}")
        if self.output == "token" and self.kind.token_shape is None:
            raise ContractViolation(self.who, "declared input", f"output='token' but {consumes.__name__} has no "
                                    "per-token field")
        self.params = _make_params(component, _base_values(component, params))

    def __call__(self, batch: Any, prop: str) -> Tensor:
        try:
            out = self.component.obj(batch, self.params)
        except Exception as err:  # noqa: BLE001 - any exception on a valid input is a violation
            raise ContractViolation(self.who, prop, f"raised {type(err).__name__}: {err}",
                                    _shown(batch)) from err
        if not torch.is_tensor(out):
            raise ContractViolation(self.who, "output shape", f"returned {type(out).__name__}, not a Tensor",
                                    _shown(batch))
        return out

    def expected_shape(self, batch: Any) -> tuple[int, ...]:
        if self.output == "example":
            return (batch_size_of(batch),)
        if self.output == "token":
            return tuple(getattr(batch, self.kind.token_shape).shape)
        return ()

    def checked(self, batch: Any, precision: str = "") -> Tensor:
        """Call the loss and check the output's shape and finiteness."""
        out = self(batch, f"finite output{precision}")
        if tuple(out.shape) != self.expected_shape(batch):
            raise ContractViolation(self.who, "output shape", f"output={self.output!r} means shape "
                                    f"{list(self.expected_shape(batch))}, got {list(out.shape)}", _shown(batch))
        if not torch.isfinite(out).all():
            bad = (~torch.isfinite(out)).nonzero().squeeze(-1).tolist()
            raise ContractViolation(self.who, f"finite output{precision}",
                                    f"returned {out.tolist()} (not finite at {bad})", _shown(batch))
        return out

    # -- the properties ----------------------------------------------------------------------
    def finite_with_gradients(self, batch: Any) -> None:
        names = tuple(n for n in self.kind.policy + self.kind.reference if getattr(batch, n) is not None)
        leaves = {n: getattr(batch, n).detach().clone().requires_grad_(True) for n in names}
        batch = _replace(batch, **leaves)
        out = self.checked(batch)
        if not out.requires_grad:
            raise ContractViolation(self.who, "gradient reaches the policy", "the output does not require grad: it "
                                    f"is detached from {', '.join(self.kind.policy)}", _shown(batch))
        grads = dict(zip(names, torch.autograd.grad(out.float().sum(), list(leaves.values()), allow_unused=True)))
        policy = {n: g for n, g in grads.items() if n in self.kind.policy and g is not None}
        if not policy:
            raise ContractViolation(self.who, "gradient reaches the policy",
                                    f"no gradient reaches {', '.join(self.kind.policy)}", _shown(batch))
        for name, grad in policy.items():
            if not torch.isfinite(grad).all():
                raise ContractViolation(self.who, "finite gradient", f"d loss / d {name} = {grad.tolist()}",
                                        _shown(batch))
        for name in self.kind.reference:
            grad = grads.get(name)
            if grad is not None and bool((grad != 0).any()):
                raise ContractViolation(self.who, "no gradient into the reference",
                                        f"d loss / d {name} = {grad.tolist()}; reference log-probs are constants, "
                                        "detach them", _shown(batch))

    def independent(self, drawn: tuple[Any, list[int]]) -> None:
        batch, perm = drawn
        with torch.no_grad():
            full = self(batch, "batch-mean independence")
            if self.output != "scalar":
                for i in range(batch_size_of(batch)):
                    alone = self(take(batch, [i]), "batch-mean independence")[0]
                    if not _close(alone, full[i]):
                        raise ContractViolation(
                            self.who, "batch-mean independence",
                            f"example {i} alone gives {alone.tolist()} but {full[i].tolist()} inside the batch; a "
                            "loss whose examples interact must register batch_coupled=True", _shown(batch))
            permuted = self(take(batch, perm), "permutation invariance")
        expected = full if self.output == "scalar" else full[torch.tensor(perm)]
        if not _close(permuted, expected):
            raise ContractViolation(self.who, "permutation invariance",
                                    f"reordering the examples as {perm} gives {permuted.tolist()}, expected "
                                    f"{expected.tolist()}", _shown(batch))

    def monotone(self, drawn: tuple[Any, float]) -> None:
        batch, delta = drawn
        prop = f"monotone: {self.component.options.monotone}"
        with torch.no_grad():
            before = self(batch, prop)
            after = self(self.kind.raise_margin(batch, delta), prop)
        worse = after.double() > before.double() + 1e-5 + 1e-5 * before.double().abs()
        if bool(worse.any()):
            raise ContractViolation(self.who, prop, f"raising every margin by {delta} changes the loss from "
                                    f"{before.tolist()} to {after.tolist()}", _shown(batch))

    def masked_ignored(self, batch: Any) -> None:
        mask = getattr(batch, self.kind.mask).bool()
        changed = _replace(batch, **{
            n: torch.where(mask, v, v - 1.0)
            for n in self.kind.policy if (v := getattr(batch, n)).shape == mask.shape
        })
        with torch.no_grad():
            out, out_changed = self(batch, "masked tokens ignored"), self(changed, "masked tokens ignored")
        if self.output == "token":
            out, out_changed = out[mask], out_changed[mask]
        if not _close(out, out_changed, rtol=1e-6, atol=1e-6):
            raise ContractViolation(self.who, "masked tokens ignored",
                                    f"changing log-probs where {self.kind.mask} is False changes the loss from "
                                    f"{out.tolist()} to {out_changed.tolist()}", _shown(batch))


def check_loss(
    component_or_name: Component | str,
    plugins: Plugins | None = None,
    *,
    params: dict | None = None,
    max_examples: int = DEFAULT_EXAMPLES,
) -> list[str]:
    """Check a loss plugin's contract; returns the names of the properties it satisfied.

    Properties: parameters validated; output shape; finite output over a wide range (summed
    log-probs of up to 4096 tokens, margins ~10⁵) and for float16 and bfloat16 inputs; a
    gradient reaches the policy log-probs and is finite; zero gradient into the reference;
    batch-mean independence and permutation invariance (unless ``batch_coupled=True``; a
    ``scalar`` loss gets only the latter); the declared monotonicity; masked tokens ignored
    (batches with a token mask). ``params`` overrides default parameter values.
    """
    loss = _LossUnderTest(_component(component_or_name, "losses", plugins), params)
    kind, options = loss.kind, loss.component.options
    checked = check_params(loss.component, params)

    _for_all(kind.strategy(), loss.finite_with_gradients, max_examples)
    checked += ["output shape", "finite output", "gradient reaches the policy", "finite gradient"]
    if kind.reference:
        checked.append("no gradient into the reference")
    for dtype in HALF:
        precision = f" ({str(dtype).removeprefix('torch.')} inputs)"
        _for_all(kind.strategy(dtype=dtype), lambda b, p=precision: loss.checked(b, p), max_examples)
        checked.append(f"finite output{precision}")

    if not options.batch_coupled:
        with_perm = kind.strategy(min_size=2).flatmap(
            lambda b: st.tuples(st.just(b), st.permutations(range(batch_size_of(b)))))
        _for_all(with_perm, loss.independent, max_examples)
        checked += ([] if loss.output == "scalar" else ["batch-mean independence"]) + ["permutation invariance"]

    declared = options.monotone  # LossOptions admits only the kinds of monotonicity the kit can check
    if declared is not None:
        if kind.raise_margin is None:
            raise ContractViolation(loss.who, "declared input", f"monotone={declared!r} but the kit cannot move the "
                                    f"margin of a {kind.cls.__name__}; register a BatchKind with raise_margin")
        _for_all(st.tuples(kind.strategy(), st.floats(1e-3, 1e3)), loss.monotone, max_examples)
        checked.append(f"monotone: {declared}")

    if kind.mask is not None:
        _for_all(kind.strategy(), loss.masked_ignored, max_examples)
        checked.append("masked tokens ignored")
    return checked


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------

_TRAINER_STATE: list[Any] = []


def _trainer_state() -> Any:
    if not _TRAINER_STATE:
        from transformers import TrainerState  # heavy import, paid once and only by reward checks

        _TRAINER_STATE.append(TrainerState(global_step=3, max_steps=10))
    return _TRAINER_STATE[0]


def _call_reward(fn: Callable, kwargs: dict[str, Any]) -> Any:
    result = fn(**kwargs)
    if inspect.isawaitable(result):

        async def wait():
            return await result

        result = asyncio.run(wait())
    return result


def _same_scores(a: Sequence, b: Sequence) -> bool:
    same = lambda x, y: x == y or (x is not None and y is not None and math.isnan(x) and math.isnan(y))  # noqa: E731
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def check_reward(
    component_or_name: Component | str,
    plugins: Plugins | None = None,
    *,
    params: dict | None = None,
    max_examples: int = 20,
) -> list[str]:
    """Check a reward plugin's contract; returns the names of the properties it satisfied.

    Properties: parameters validated; accepts ``**kwargs`` (plait passes every dataset column);
    one finite number or None per completion; picklable (the unpickled copy scores alike), so
    rewards can run in worker processes. A reward registered with ``params=`` is a factory and
    is checked as ``obj(params)``. Dataset columns it reads get random strings: those declared
    with ``columns=``, required keyword parameters beyond ``prompts``, ``completions``,
    ``completion_ids`` and ``trainer_state``, and the value of a ``column`` parameter.
    """
    component = _component(component_or_name, "rewards", plugins)
    who = _who(component)
    checked = check_params(component, params)
    if component.params is None:
        fn, built = component.obj, None
    else:
        built = _make_params(component, _base_values(component, params))
        try:
            fn = component.obj(built)
        except Exception as err:  # noqa: BLE001
            raise ContractViolation(who, "builds from its parameters", f"{describe(component.obj)}({built!r}) raised "
                                    f"{type(err).__name__}: {err}") from err
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: rely on the call below
        signature = None
    columns = set(component.options.columns)
    if built is not None:  # a parameter naming the dataset column it reads (``column="solution"``)
        columns |= {getattr(built, f.name) for f in attrs.fields(type(built))
                    if (f.name == "column" or f.name.endswith("_column")) and isinstance(getattr(built, f.name), str)}
    if signature is not None:
        kinds = {p.kind for p in signature.parameters.values()}
        if inspect.Parameter.VAR_KEYWORD not in kinds:
            raise ContractViolation(who, "accepts **kwargs", f"its signature is {signature}; plait calls it with "
                                    f"{', '.join(REWARD_ARGUMENTS)} and every dataset column, so end it with **kwargs")
        columns |= {
            name for name, p in signature.parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
            and name not in REWARD_ARGUMENTS
        }
    checked.append("accepts **kwargs")
    try:
        clone = pickle.loads(pickle.dumps(fn))
    except Exception as err:  # noqa: BLE001
        raise ContractViolation(who, "picklable", f"pickle fails with {type(err).__name__}: {err}; make it a "
                                "module-level function, a functools.partial of one, or an instance of a "
                                "module-level class (not a closure or lambda)") from err

    def scores(kwargs: dict[str, Any]) -> None:
        kwargs = {**kwargs, "trainer_state": _trainer_state(), "plait_contract_extra_column": kwargs["prompts"]}
        shown = describe({k: v for k, v in kwargs.items() if k != "trainer_state"}, "  ")
        try:
            result = _call_reward(fn, kwargs)
        except Exception as err:  # noqa: BLE001
            raise ContractViolation(who, "one value or None per completion", f"raised {type(err).__name__}: {err}",
                                    shown) from err
        n = len(kwargs["completions"])
        if isinstance(result, (str, bytes)) or not isinstance(result, Sequence) or len(result) != n:
            raise ContractViolation(who, "one value or None per completion",
                                    f"returned {result!r} for {n} completions", shown)
        for value in result:
            if value is not None and (not isinstance(value, numbers.Real) or not math.isfinite(value)):
                raise ContractViolation(who, "one value or None per completion",
                                        f"returned {result!r}: {value!r} is neither a finite number nor None", shown)
        again = _call_reward(clone, kwargs)
        if not _same_scores(list(result), list(again)):
            raise ContractViolation(who, "picklable", f"the unpickled copy returns {again!r}, the original "
                                    f"{result!r}", shown)

    completion_format = component.options.completion_format
    _for_all(reward_inputs(completion_format=completion_format, columns=sorted(columns)), scores, max_examples)
    return checked + ["one value or None per completion", "picklable"]


# ---------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------


def _regroup(rollout, order: list[int]):
    index = torch.tensor(order)
    per_row = {n: getattr(rollout, n)[index] for n in ("token_rewards", "values", "mask", "turn_index", "turn_rewards")
               if getattr(rollout, n) is not None}
    return _replace(rollout, rewards=rollout.rewards[index], **per_row)


def _check_equivariance(drawn_rollouts, estimate: Callable, who: str, max_examples: int) -> None:
    """Reordering groups, or rows within a group, reorders the advantages alike."""

    @st.composite
    def with_order(draw):
        rollout = draw(drawn_rollouts)
        g = rollout.group_size
        groups = draw(st.permutations(range(rollout.num_groups)))
        return rollout, [i * g + j for i in groups for j in draw(st.permutations(range(g)))]

    def equivariant(drawn) -> None:
        rollout, order = drawn
        out = estimate(rollout, "permutation equivariance")
        reordered = estimate(_regroup(rollout, order), "permutation equivariance")
        if not _close(reordered, out[torch.tensor(order)]):
            raise ContractViolation(who, "permutation equivariance", f"reordering rows as {order} gives "
                                    f"{reordered.tolist()}, expected {out[torch.tensor(order)].tolist()}",
                                    _shown(rollout))

    _for_all(with_order(), equivariant, max_examples)


def check_advantage_estimator(
    component_or_name: Component | str,
    plugins: Plugins | None = None,
    *,
    params: dict | None = None,
    max_examples: int = DEFAULT_EXAMPLES,
) -> list[str]:
    """Check an advantage estimator's contract; returns the names of the properties it satisfied.

    Properties: parameters validated; shape preserved (``[N]``, or ``[N, T]`` with
    ``token_level=True``) and finite, whatever the rewards (None included); permutation
    equivariance (reordering groups, or rows within a group, reorders the advantages alike —
    catches rows grouped by the wrong stride); an all-equal group gets zeros (group-relative
    estimators, the default for sequence level); zero mean per group (``zero_mean_per_group=True``);
    with ``turn_level=True``, those of :func:`check_turn_advantage_estimator` too.
    """
    component = _component(component_or_name, "advantage_estimators", plugins)
    who, options = _who(component), component.options
    token_level = options.token_level
    p = _make_params(component, _base_values(component, params))
    checked = check_params(component, params)

    def estimate(rollout, prop: str) -> Tensor:
        try:
            out = component.obj(rollout, p)
        except Exception as err:  # noqa: BLE001
            raise ContractViolation(who, prop, f"raised {type(err).__name__}: {err}", _shown(rollout)) from err
        expected = tuple(rollout.mask.shape) if token_level else (rollout.rewards.shape[0],)
        if not torch.is_tensor(out) or tuple(out.shape) != expected:
            got = list(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise ContractViolation(who, "shape preserved", f"expected advantages of shape {list(expected)}, got {got}",
                                    _shown(rollout))
        if not torch.isfinite(out).all():
            raise ContractViolation(who, "finite advantages", f"returned {out.tolist()}", _shown(rollout))
        return out.detach()

    wide = rollouts(rewards=WIDE_REWARDS, weights=st.floats(0.0, 2.0), token_level=token_level)
    _for_all(wide, lambda r: estimate(r, "finite advantages"), max_examples)
    checked += ["shape preserved", "finite advantages"]

    _check_equivariance(rollouts(token_level=token_level), estimate, who, max_examples)
    checked.append("permutation equivariance")

    if options.is_group_relative:
        def zeros(rollout) -> None:
            out = estimate(rollout, "all-equal group → zeros")
            if not bool((out.abs() <= 1e-6).all()):
                raise ContractViolation(who, "all-equal group → zeros", f"every group's rewards are equal, yet the "
                                        f"advantages are {out.tolist()}", _shown(rollout))

        _for_all(rollouts(all_equal=True, token_level=token_level), zeros, max_examples)
        checked.append("all-equal group → zeros")

    if options.zero_mean_per_group:
        def zero_mean(rollout) -> None:
            out = estimate(rollout, "zero mean per group").double()
            per_group = out.reshape(rollout.num_groups, -1)
            scale = per_group.abs().amax(dim=1).clamp(min=1.0)
            if not bool((per_group.mean(dim=1).abs() <= 1e-5 * scale).all()):
                raise ContractViolation(who, "zero mean per group", f"group means are {per_group.mean(dim=1).tolist()} "
                                        f"for advantages {out.tolist()}", _shown(rollout))

        _for_all(rollouts(token_level=token_level), zero_mean, max_examples)
        checked.append("zero mean per group")
    if options.turn_level:  # and the properties of advantages per turn (check_turn_advantage_estimator)
        checked += [c for c in check_turn_advantage_estimator(component, plugins, params=params, max_examples=max_examples)
                    if c not in checked]
    return checked


def check_turn_advantage_estimator(
    component_or_name: Component | str,
    plugins: Plugins | None = None,
    *,
    params: dict | None = None,
    reduces_with: dict | None = None,
    max_examples: int = DEFAULT_EXAMPLES,
) -> list[str]:
    """Check a turn-level advantage estimator (multi-turn episodes with per-turn rewards: a Rollout's
    ``turn_index`` and ``turn_rewards``); returns the properties it satisfied.

    Properties: advantages ``[N, T]`` like ``turn_index`` and finite; constant within a turn (every
    token of turn k of a row gets one value); 0 on tokens outside every model turn; permutation
    equivariance (groups, and rows within a group); and, with ``reduces_with`` (the parameters under
    which it must, e.g. ``{"gamma": 1.0}``), episode level: without per-turn rewards, where every
    episode of a group has as many turns, each token gets ``advantage.group``'s advantage of its row
    (with the estimator's ``scale`` and ``epsilon`` when it has them).
    """
    component = _component(component_or_name, "advantage_estimators", plugins)
    who = _who(component)
    p = _make_params(component, _base_values(component, params))
    checked = check_params(component, params)

    def estimate(rollout, prop: str, chosen=p) -> Tensor:
        try:
            out = component.obj(rollout, chosen)
        except Exception as err:  # noqa: BLE001
            raise ContractViolation(who, prop, f"raised {type(err).__name__}: {err}", _shown(rollout)) from err
        if not torch.is_tensor(out) or tuple(out.shape) != tuple(rollout.turn_index.shape):
            got = list(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise ContractViolation(who, "shape of turn_index", f"expected advantages of shape "
                                    f"{list(rollout.turn_index.shape)}, got {got}", _shown(rollout))
        if not torch.isfinite(out).all():
            raise ContractViolation(who, "finite advantages", f"returned {out.tolist()}", _shown(rollout))
        return out.detach()

    def per_turn(rollout) -> None:
        out, index = estimate(rollout, "constant within a turn"), rollout.turn_index
        if bool((out[index < 0] != 0).any()):
            raise ContractViolation(who, "0 outside model turns", f"tokens with turn_index -1 got {out.tolist()}",
                                    _shown(rollout))
        for k in range(int(index.max()) + 1):
            at = torch.where(index == k, out, math.nan)
            spread = (at.nan_to_num(-math.inf).amax(dim=1) - at.nan_to_num(math.inf).amin(dim=1))
            if bool((spread[(index == k).any(dim=1)] > 1e-6).any()):
                raise ContractViolation(who, "constant within a turn", f"turn {k}'s tokens differ: {out.tolist()}",
                                        _shown(rollout))

    wide = rollouts(rewards=WIDE_REWARDS, weights=st.floats(0.0, 2.0), turn_level=True)
    _for_all(wide, lambda r: estimate(r, "finite advantages"), max_examples)
    _for_all(rollouts(turn_level=True), per_turn, max_examples)
    checked += ["shape of turn_index", "finite advantages", "0 outside model turns", "constant within a turn"]

    _check_equivariance(rollouts(turn_level=True), estimate, who, max_examples)
    checked.append("permutation equivariance")

    if reduces_with is not None:
        reduced = _make_params(component, {**_base_values(component, params), **reduces_with})
        group = make_plugins().advantage_estimators.get("advantage.group") if plugins is None else \
            plugins.advantage_estimators.get("advantage.group")
        shared = {name: getattr(reduced, name) for name in ("scale", "epsilon") if hasattr(reduced, name)}
        group_params = group.make_params(**shared)

        def episode_level(rollout) -> None:
            out = estimate(rollout, "episode level without per-turn rewards", reduced)
            expected = group.obj(rollout, group_params).unsqueeze(1) * (rollout.turn_index >= 0)
            if not _close(out, expected.to(out.dtype)):
                raise ContractViolation(who, "episode level without per-turn rewards", f"with {reduces_with} gives "
                                        f"{out.tolist()}, advantage.group gives {expected.tolist()}", _shown(rollout))

        _for_all(rollouts(turn_level=True, turn_rewards=False, equal_turns=True), episode_level, max_examples)
        checked.append("episode level without per-turn rewards")
    return checked


# ---------------------------------------------------------------------------------------------
# Environments
# ---------------------------------------------------------------------------------------------


class _Recording:
    """A real generation backend that remembers every (prompt, completion) it produced."""

    def __init__(self, backend):
        self.backend, self.seen = backend, {}

    def generate(self, prompts, sampling):
        out = self.backend.generate(prompts, sampling)
        for prompt, completion in zip(out.prompt_ids, out.completion_ids):
            self.seen.setdefault(tuple(prompt), []).append(list(completion))
        return out

    def sleep(self):
        self.backend.sleep()


def check_environment(component: Any, rows: Sequence[dict] | None = None, plugins: Plugins | None = None, *,
                      params: dict | None = None, max_turns: int = 3, max_completion_length: int = 48,
                      model: Any = None, processing_class: Any = None, temperature: float = 1.0,
                      seed: int = 0) -> list[str]:
    """Drive episodes of an environment on ``rows`` through the transformers backend (the tiny model
    unless ``model`` and ``processing_class`` are given) and check them; returns the properties checked.

    ``component``: a registered name (``env.arithmetic``), a registry Component, or a factory
    returning a fresh :class:`plait.online.rollouts.Environment`. Properties: the trainable mask aligns with
    the token ids; every run of trainable tokens is exactly what the backend sampled from the
    conversation so far (the model's tokens are never altered); inserted tokens only follow a model
    turn that ended with EOS; episodes end within ``max_turns`` model turns and the length budget;
    the reward is None or a finite number.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.online.generation import SamplingParams
    from plait.online.rollouts import drive, encode_start
    from plait.online.tools import resolve_parser, resolve_tools
    from plait.testing.tiny_model import tiny_model_path

    plugins = plugins or make_plugins()
    if isinstance(component, str):
        component = plugins.environments.get(component, family="env")
    if isinstance(component, Component):
        who = _who(component)
        made = component.make_params(**(params or {})) if component.params is not None else None
        factory = (lambda: component.obj(made)) if made is not None else component.obj
    else:
        who, factory = f"environment {getattr(component, '__name__', component)!r}", component
    rows = list(rows or [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": 5}])
    if model is None:
        path = tiny_model_path()
        model, processing_class = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    torch.manual_seed(seed)
    backend = _Recording(plugins.generation_backends.get("generation.transformers").obj(model, processing_class))
    sampling = SamplingParams(max_completion_length=max_completion_length, temperature=temperature)
    envs = [factory() for _ in rows]
    for env in envs:
        env.tools = [t if hasattr(t, "schema") else resolve_tools([t])[0] for t in env.tools]
    starts = [env.reset(row) for env, row in zip(envs, rows)]
    prompt_ids = [encode_start(processing_class, start, env.tools) for start, env in zip(starts, envs)]
    parser = resolve_parser(None, processing_class, plugins)
    episodes = drive(lambda ids, g: backend.generate(ids, sampling), backend, processing_class, sampling, envs,
                     prompt_ids, starts, 1, parser, max_turns)
    eos = backend.backend.eos_ids
    for i, (ids, mask) in enumerate(zip(episodes.completion_ids, episodes.trainable)):
        where = f"row {i}: ids={ids}, trainable={mask}"
        if len(ids) != len(mask) or any(m not in (0, 1) for m in mask):
            raise ContractViolation(who, "masks align with ids", f"{len(ids)} ids but {len(mask)} mask values", where)
        if episodes.logprobs is not None and len(episodes.logprobs[i]) != len(ids):
            raise ContractViolation(who, "masks align with ids", "log-probs and ids differ in length", where)
        t = 0
        while t < len(ids):
            end = t
            while end < len(ids) and mask[end] == mask[t]:
                end += 1
            if mask[t] == 1:
                context = tuple(prompt_ids[i] + ids[:t])
                sampled = backend.seen.get(context, [])
                if not any(run[:end - t] == ids[t:end] and len(run) >= end - t for run in sampled):
                    raise ContractViolation(who, "the model's tokens are exactly what it generated",
                                            f"tokens {ids[t:end]} at {t} were not sampled from that context", where)
            elif t == 0 or ids[t - 1] not in eos:
                raise ContractViolation(who, "inserted tokens follow a finished model turn",
                                        f"inserted tokens at {t} follow {ids[t - 1] if t else 'the prompt'}, not EOS",
                                        where)
            t = end
        turns = episodes.stats["turns"][i]
        if turns > (envs[i].max_turns or max_turns) or len(ids) > max_completion_length:
            raise ContractViolation(who, "episodes end within the turn limit",
                                    f"{turns} turns (limit {max_turns}), {len(ids)} tokens (budget "
                                    f"{max_completion_length})", where)
    for i, reward in enumerate(episodes.rewards or []):
        if reward is not None and not (isinstance(reward, numbers.Real) and math.isfinite(reward)):
            raise ContractViolation(who, "reward is None or finite", f"row {i}: reward {reward!r}")
    return ["masks align with ids", "the model's tokens are exactly what it generated",
            "inserted tokens follow a finished model turn", "episodes end within the turn limit",
            "reward is None or finite"]


def _check_environment_component(component: Component, plugins: Plugins | None = None, **kwargs: Any) -> list[str]:
    return check_environment(component, plugins=plugins, **kwargs)  # its second positional parameter is rows


# ---------------------------------------------------------------------------------------------
# The kinds the chassis calls rather than differentiates: what it relies on, checked once
# ---------------------------------------------------------------------------------------------


def _built(component: Component, params: dict | None, *args: Any) -> Any:
    """The registered object, or with ``params=`` the one its factory builds from them (``obj(params, *args)``)."""
    if component.params is None:
        return component.obj
    return component.obj(_make_params(component, _base_values(component, params)), *args)


def check_method(component_or_name: Component | str, plugins: Plugins | None = None) -> list[str]:
    """A method's Config builds with its defaults, its Trainer subclasses the chassis
    (:class:`plait.engine.trainer.PlaitTrainer`), and its loss family has a registered loss."""
    from plait.engine.trainer import PlaitTrainer
    from plait.method import Method

    plugins = make_plugins() if plugins is None else plugins
    component = _component(component_or_name, "methods", plugins)
    who, method = _who(component), component.obj
    if not isinstance(method, Method):
        raise ContractViolation(who, "is a Method", f"registered {method!r}, not a plait.method.Method")
    try:
        method.config()
    except Exception as err:  # noqa: BLE001 - any failure to build is the violation
        raise ContractViolation(who, "Config builds with defaults", f"{method.config.__name__}() raised "
                                f"{type(err).__name__}: {err}") from err
    if not (isinstance(method.trainer, type) and issubclass(method.trainer, PlaitTrainer)):
        raise ContractViolation(who, "Trainer subclasses the chassis", f"{method.trainer!r} is no PlaitTrainer")
    if getattr(method.trainer, "method", None) != component.name.split(".", 1)[1]:
        raise ContractViolation(who, "Trainer knows its name", f"{method.trainer.__name__}.method is "
                                f"{getattr(method.trainer, 'method', None)!r}, not the name it is registered under")
    if method.loss_family and not plugins.losses.family(method.loss_family):
        raise ContractViolation(who, "its loss family has losses", f"no loss is registered as "
                                f"'{method.loss_family}.<name>'")
    return ["is a Method", "Config builds with defaults", "Trainer subclasses the chassis", "Trainer knows its name",
            "its loss family has losses"]


def check_generation_backend(component_or_name: Component | str, plugins: Plugins | None = None) -> list[str]:
    """A backend factory takes ``(model, processing_class, args)`` and declares that it returns a
    :class:`plait.online.generation.GenerationBackend` implementing every interface method; nothing is
    built (a vLLM backend needs vLLM and a GPU)."""
    import typing

    from plait.online.generation import GenerationBackend

    component = _component(component_or_name, "generation_backends", plugins)
    who, factory = _who(component), component.obj
    try:
        inspect.signature(factory).bind(None, None, None)
    except (TypeError, ValueError) as err:
        raise ContractViolation(who, "factory(model, processing_class, args)", str(err)) from err
    try:
        made = typing.get_type_hints(factory).get("return")
    except Exception:  # noqa: BLE001 - an annotation naming something not importable here
        made = None
    if not (isinstance(made, type) and issubclass(made, GenerationBackend)):
        raise ContractViolation(who, "returns a GenerationBackend", f"the factory's return annotation is {made!r}; "
                                "annotate it with the GenerationBackend subclass it builds")
    missing = sorted(getattr(made, "__abstractmethods__", ()))
    if missing:
        raise ContractViolation(who, "implements the interface", f"{made.__name__} leaves {missing} unimplemented")
    return ["factory(model, processing_class, args)", "returns a GenerationBackend", "implements the interface"]


def check_data_format(component_or_name: Component | str, plugins: Plugins | None = None) -> list[str]:
    """A format is a :class:`plait.data.prepare.DataFormat` registered under its own name that detects
    each of its shapes: a row with exactly those columns is recognised as this format."""
    from plait.data.prepare import DataFormat

    component = _component(component_or_name, "data_formats", plugins)
    who, fmt = _who(component), component.obj
    if not isinstance(fmt, DataFormat) or fmt.name != component.name:
        raise ContractViolation(who, "is its DataFormat", f"registered {fmt!r}, not a DataFormat named {component.name!r}")
    for shape in fmt.shapes:
        if fmt.detect(shape) != component.name:
            raise ContractViolation(who, "detects its own rows", f"columns {list(shape)} are not recognised")
    return ["is its DataFormat", "detects its own rows"]


def encoded_rows(size: int = 3) -> list[dict]:
    """Tokenised rows carrying every field plait's collators read (prompt/completion, chosen/rejected, labels)."""
    return [{"input_ids": [5, 6, 7 + i], "prompt_ids": [5, 6], "completion_ids": [7, 8 + i] * (i + 1),
             "chosen_ids": [9, 10], "rejected_ids": [11] * (i + 1), "labels": [0, 1, i % 2],
             "completion_mask": [0, 1, 1], "label": bool(i % 2), "prompt": "x", "ref_chosen_logps": -1.0,
             "ref_rejected_logps": -2.0} for i in range(size)]


def check_collator(component_or_name: Component | str, plugins: Plugins | None = None, *,
                   examples: Sequence[dict] | None = None, processing_class: Any = None,
                   options: dict | None = None) -> list[str]:
    """A collator factory builds from ``(processing_class, **options)`` and its collate function turns a
    tiny batch (``examples``, default :func:`encoded_rows`) into a dict holding tensors, leaves the rows
    as they were, answers alike twice, and pads ``input_ids`` to ``pad_to_multiple_of`` when it takes one."""
    import copy

    component = _component(component_or_name, "collators", plugins)
    who = _who(component)
    if processing_class is None:
        from transformers import AutoTokenizer

        from plait.testing.tiny_model import tiny_model_path

        processing_class = AutoTokenizer.from_pretrained(tiny_model_path())
    rows = list(examples or encoded_rows())
    options = dict(options or {})
    if "pad_to_multiple_of" in inspect.signature(component.obj).parameters:
        options.setdefault("pad_to_multiple_of", 8)
    collate = component.obj(processing_class, **options)
    before = copy.deepcopy(rows)
    batch = collate(rows)
    if rows != before:
        raise ContractViolation(who, "leaves the rows as they were", "collating changed the examples it was given")
    tensors = {k: v for k, v in batch.items() if isinstance(v, Tensor)} if isinstance(batch, dict) else {}
    if not tensors:
        raise ContractViolation(who, "returns tensors", f"collated {type(batch).__name__} with no tensor in it")
    again = collate(copy.deepcopy(before))
    if set(again) != set(batch) or not all(torch.equal(again[k], v) for k, v in tensors.items()):
        raise ContractViolation(who, "deterministic", "collating the same rows twice differs")
    multiple, ids = options.get("pad_to_multiple_of"), batch.get("input_ids")
    if multiple and isinstance(ids, Tensor) and "attention_mask" in batch and ids.shape[-1] % multiple:
        raise ContractViolation(who, "pads to pad_to_multiple_of", f"input_ids is {ids.shape[-1]} wide, "
                                f"pad_to_multiple_of={multiple}")
    return ["returns tensors", "leaves the rows as they were", "deterministic", "pads to pad_to_multiple_of"]


PACKING_LENGTHS = ([3, 5, 2, 7], [10], [1] * 9, [4, 12, 0, 6, 6], [8, 8, 8])


def check_packing_strategy(component_or_name: Component | str, plugins: Plugins | None = None, *,
                           max_length: int = 8) -> list[str]:
    """Bins of ``(example, start, end)`` slices: each bin at most ``max_length`` tokens, slices inside their
    example and never overlapping, and every non-empty example packed."""
    component = _component(component_or_name, "packing_strategies", plugins)
    who = _who(component)
    for lengths in PACKING_LENGTHS:
        where = f"lengths={lengths}, max_length={max_length}"
        bins = component.obj(list(lengths), max_length)
        taken: dict[int, list[tuple[int, int]]] = {}
        for packed in bins:
            if sum(end - start for _, start, end in packed) > max_length:
                raise ContractViolation(who, "bins fit max_length", f"bin {packed} holds more tokens", where)
            for i, start, end in packed:
                if not (0 <= i < len(lengths) and 0 <= start < end <= lengths[i]):
                    raise ContractViolation(who, "slices inside their example", f"slice {(i, start, end)}", where)
                taken.setdefault(i, []).append((start, end))
        for i, spans in taken.items():
            spans.sort()
            if any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
                raise ContractViolation(who, "slices never overlap", f"example {i}: {spans}", where)
        lost = [i for i, n in enumerate(lengths) if n and i not in taken]
        if lost:
            raise ContractViolation(who, "every example packed", f"examples {lost} are in no bin", where)
    return ["bins fit max_length", "slices inside their example", "slices never overlap", "every example packed"]


def check_rollout_filter(component_or_name: Component | str, plugins: Plugins | None = None, *,
                         params: dict | None = None) -> list[str]:
    """A rollout filter (built from ``params``) keeps or drops every scored group it is shown (2 to 8 completions,
    tied rewards, all equal, NaN for unscored ones, truncated completions): True or False, the same answer twice
    and for the group's completions in any order (a group is a set), leaving the group as it was."""
    from plait.online.filtering import RolloutFilter, RolloutGroup

    plugins = make_plugins() if plugins is None else plugins
    component = _component(component_or_name, "rollout_filters", plugins)
    who = _who(component)
    values = None if component.params is None else _make_params(component, _base_values(component, params))
    rollout_filter = RolloutFilter(component, values)
    generator = torch.Generator().manual_seed(0)

    def verdict(group: RolloutGroup) -> bool:
        try:
            return rollout_filter.keeps(group)
        except PlaitError as err:
            raise ContractViolation(who, "keeps or drops", f"{err} for {describe(group)}") from err

    for case in range(DEFAULT_EXAMPLES):
        g = 2 + case % 7
        rewards = torch.randint(0, 3, (g,), generator=generator).double()
        if case % 4 == 1:
            rewards[:] = rewards[0]  # every completion alike: the group DAPO drops
        if case % 3 == 0:
            rewards[0] = math.nan  # a completion no reward scored
        lengths = torch.randint(1, 9, (g,), generator=generator)
        group = RolloutGroup(f"prompt {case}", rewards, rewards.float()[:, None], lengths, lengths == 8)
        kept = verdict(group)
        if verdict(group) != kept:
            raise ContractViolation(who, "answers the same twice", describe(group))
        order = torch.randperm(g, generator=generator)
        shuffled = RolloutGroup(group.prompt, *(getattr(group, f)[order] for f in ("rewards", "scores", "lengths",
                                                                                    "truncated")))
        if verdict(shuffled) != kept:
            raise ContractViolation(who, "ignores the completions' order", f"{describe(group)} reordered {order.tolist()}")
        if not torch.equal(group.rewards.nan_to_num(-7), rewards.nan_to_num(-7)) or group.lengths.tolist() != \
                lengths.tolist():
            raise ContractViolation(who, "leaves the group unchanged", describe(group))
    return ["keeps or drops", "answers the same twice", "ignores the completions' order", "leaves the group unchanged"]


def check_judge(component_or_name: Component | str, plugins: Plugins | None = None, *,
                params: dict | None = None) -> list[str]:
    """A judge (built from ``params`` when it takes them) ranks pairs: one of -1, 0, 1 per pair; a judge
    offering ``scores`` gives one finite score per completion."""
    plugins = make_plugins() if plugins is None else plugins
    component = _component(component_or_name, "judges", plugins)
    who, judge = _who(component), _built(component, params, plugins)
    prompts = ["What is 2 + 3?", "Name a colour."]
    pairs = [["5", "6"], ["blue", "blue"]]
    ranks = judge(prompts, pairs)
    if len(ranks) != len(pairs) or any(rank not in (-1, 0, 1) for rank in ranks):
        raise ContractViolation(who, "ranks each pair", f"returned {ranks!r} for {len(pairs)} pairs")
    checked = ["ranks each pair"]
    if hasattr(judge, "scores"):
        scores = torch.as_tensor(judge.scores(prompts, [pair[0] for pair in pairs]), dtype=torch.float32)
        if scores.shape != (len(prompts),) or not bool(scores.isfinite().all()):
            raise ContractViolation(who, "scores each completion", f"returned {scores.tolist()} for {len(prompts)}")
        checked.append("scores each completion")
    return checked


# A conversation of two exchanges whose assistant turns carry reasoning (which some families' templates drop).
TEMPLATE_CONVERSATION = (
    {"role": "user", "content": "What is 7 plus 5?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nIt is 12."},
    {"role": "user", "content": "And 9 times 8?"},
    {"role": "assistant", "content": "<think>\nMultiply them.\n</think>\n\nIt is 72."},
)


def _render_template(template: str, messages: Sequence[dict], add_generation_prompt: bool = False):
    from transformers.utils.chat_template_utils import render_jinja_template

    (text,), indices = render_jinja_template([list(messages)], chat_template=template,
                                             return_assistant_tokens_mask=marks_generation(template),
                                             add_generation_prompt=add_generation_prompt, bos_token="", eos_token="")
    return text, [text[start:end] for start, end in (indices[0] if indices else ())]


def check_chat_template(component_or_name: Component | str, plugins: Plugins | None = None, *,
                        original: str | None = None) -> list[str]:
    """A training chat template carries ``{% generation %}`` markers and declares how its family's template is
    recognised; on a two-exchange conversation with reasoning its rendering extends that of every earlier part (and
    of the generation prompt before each assistant turn), and its generation spans hold each assistant turn's
    reasoning and answer and no user text. Given the family's ``original`` template, it recognises it and renders
    a one-exchange conversation and the generation prompt exactly as it does."""
    plugins = make_plugins() if plugins is None else plugins
    component = _component(component_or_name, "chat_templates", plugins)
    who, template, options = _who(component), component.obj, component.options
    if not marks_generation(template):
        raise ContractViolation(who, "has generation markers", "its object is not a Jinja string with {% generation %}")
    if not options.recognises and options.matches is None:
        raise ContractViolation(who, "is recognisable", "declares neither recognises= nor matches=")
    messages = list(TEMPLATE_CONVERSATION)
    full, spans = _render_template(template, messages)
    for k in range(1, len(messages)):
        upto, _ = _render_template(template, messages[:k], add_generation_prompt=messages[k]["role"] == "assistant")
        if not full.startswith(upto):
            raise ContractViolation(who, "is prefix-preserving", f"the first {k} messages render {upto!r}, not a "
                                    f"prefix of the conversation's {full!r}")
    # each assistant turn's reasoning and answer, without the <think> tags a template may rewrite around them
    answers = [[part.removeprefix("<think>").strip() for part in m["content"].split("</think>")]
               for m in messages if m["role"] == "assistant"]
    if len(spans) != len(answers) or any(
            not all(part in span for part in answer) for span, answer in zip(spans, answers)):
        raise ContractViolation(who, "marks the assistant turns", f"generation spans {spans!r} for {len(answers)} "
                                "assistant turns")
    if any(m["content"] in span for m in messages if m["role"] == "user" for span in spans):
        raise ContractViolation(who, "marks only the assistant turns", f"generation spans {spans!r} hold user text")
    checked = ["has generation markers", "is recognisable", "is prefix-preserving", "marks the assistant turns"]
    if original is not None:
        if not options.recognise(original):
            raise ContractViolation(who, "recognises its family's template", "options.recognise(original) is False")
        for part, prompt in ((messages[:1], True), ([messages[0], {"role": "assistant", "content": "It is 12."}], False)):
            ours, theirs = (_render_template(t, part, add_generation_prompt=prompt)[0] for t in (template, original))
            if ours != theirs:
                raise ContractViolation(who, "renders the last turn as the original", f"{ours!r} != {theirs!r}")
        checked += ["recognises its family's template", "renders the last turn as the original"]
    return checked


def check_command(component_or_name: Component | str, plugins: Plugins | None = None) -> list[str]:
    """A command is a :class:`plait.cli.Command` whose ``run`` is callable (or that names a registered
    method it is another name of) and whose ``add_arguments`` fills a fresh parser."""
    import argparse

    from plait.cli import Command

    plugins = make_plugins() if plugins is None else plugins
    component = _component(component_or_name, "commands", plugins)
    who, command = _who(component), component.obj
    if not isinstance(command, Command):
        raise ContractViolation(who, "is a Command", f"registered {command!r}, not a plait.cli.Command")
    if command.method is not None:
        if f"method.{command.method}" not in plugins.methods:
            raise ContractViolation(who, "names a method", f"method {command.method!r} is not registered")
        return ["is a Command", "names a method"]
    if not callable(command.run):
        raise ContractViolation(who, "run is callable", f"run is {command.run!r}")
    command.add_arguments(argparse.ArgumentParser(prog=f"plait {component.name.split('.', 1)[1]}"))
    return ["is a Command", "run is callable", "add_arguments fills a parser"]


def check_callbacks(plugin: Any, method: str, args: Any = None, plugins: Plugins | None = None) -> list[str]:
    """A plugin's ``trainer_callbacks`` answer for ``method`` (``args``: its Config with defaults) is a
    list of transformers ``TrainerCallback`` instances. ``plugin``: a plugin object or a loaded plugin's name."""
    from transformers import TrainerCallback

    plugins = make_plugins() if plugins is None else plugins
    if isinstance(plugin, str):
        plugin = plugins.pm.get_plugin(plugin)
    component = plugins.methods.get(method, family="method")
    args = component.obj.config() if args is None else args
    who = f"plugin {getattr(plugin, '__name__', plugin)!r}"
    given = {"method": component.name.split(".", 1)[1], "args": args}  # as the chassis calls it: the bare name
    answer = plugin.trainer_callbacks(**{k: v for k, v in given.items()
                                         if k in inspect.signature(plugin.trainer_callbacks).parameters})
    if not isinstance(answer, (list, tuple)) or not all(isinstance(c, TrainerCallback) for c in answer):
        raise ContractViolation(who, "returns TrainerCallbacks", f"trainer_callbacks for {method!r} returned {answer!r}")
    return ["returns TrainerCallbacks"]


# kind (as a registry calls one entry) -> its check(component, plugins, **kwargs)
CHECKS: dict[str, Callable[..., list[str]]] = {
    "loss": check_loss, "reward": check_reward, "advantage estimator": check_advantage_estimator,
    "environment": _check_environment_component, "method": check_method, "generation backend": check_generation_backend,
    "data format": check_data_format, "collator": check_collator, "packing strategy": check_packing_strategy,
    "judge": check_judge, "command": check_command, "chat template": check_chat_template,
    "rollout filter": check_rollout_filter,
}


def check_component(component: Component, plugins: Plugins | None = None, **kwargs: Any) -> list[str]:
    """Run the contract check for ``component``'s kind (see :data:`CHECKS`)."""
    if component.kind not in CHECKS:
        raise ValueError(f"no contract check for {component.kind!r} components; the kit checks {sorted(CHECKS)}")
    return CHECKS[component.kind](component, plugins, **kwargs)
