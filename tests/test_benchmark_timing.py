"""benchmarks/_timing.py: variants alternated round by round, and their ratios to a baseline per round."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("_timing", Path(__file__).parents[1] / "benchmarks" / "_timing.py")
timing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timing)


def test_variants_take_turns_after_one_warm_up_each_each_round_starting_one_further_on():
    order = []
    times = timing.alternated_seconds({"a": 1.0, "b": 2.0, "c": 3.0}, lambda v: order.append(v) or v, repeats=4)
    assert order == [1.0, 2.0, 3.0] + [1.0, 2.0, 3.0] + [2.0, 3.0, 1.0] + [3.0, 1.0, 2.0] + [1.0, 2.0, 3.0]
    assert times == {"a": [1.0] * 4, "b": [2.0] * 4, "c": [3.0] * 4}


def test_round_ratios_are_medians_of_same_round_ratios_not_ratios_of_medians():
    # a machine that slows down round by round: per-round ratios see through it
    times = {"base": [1.0, 2.0, 4.0], "faster": [0.9, 1.8, 3.6], "twin": [1.1, 2.0, 3.6]}
    ratios = timing.round_ratios(times, "base")
    assert set(ratios) == {"faster", "twin"}
    assert ratios["faster"] == pytest.approx(0.9)
    assert ratios["twin"] == pytest.approx(1.0)  # median of 1.1, 1.0, 0.9
