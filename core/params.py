"""Validators for component parameters: each error names the parameter, the value and the range."""

from __future__ import annotations

import math

import attrs


def _check(predicate, description: str):
    def validate(instance, attribute: attrs.Attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not predicate(value):
            raise ValueError(f"{attribute.name}={value!r} must be {description}")

    return validate


def positive(instance, attribute, value) -> None:
    _check(lambda v: v > 0, "a number > 0")(instance, attribute, value)


def non_negative(instance, attribute, value) -> None:
    _check(lambda v: v >= 0, "a number >= 0")(instance, attribute, value)


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """Closed interval [low, high] unless an end is declared open."""
    left, right = ("(" if low_open else "["), (")" if high_open else "]")

    def predicate(v: float) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    return _check(predicate, f"in {left}{low}, {high}{right}")


def finite(instance, attribute, value) -> None:
    _check(lambda v: True, "a finite number")(instance, attribute, value)


def int_at_least(low: int):
    def check(instance, attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{attribute.name}={value!r} must be an integer >= {low}")

    return check


def one_of(options):
    def check(instance, attribute, value) -> None:
        if value not in options:
            raise ValueError(f"{attribute.name}={value!r} must be one of {', '.join(map(str, options))}")

    return check
