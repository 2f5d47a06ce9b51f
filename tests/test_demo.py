"""The demo's data is what its generator writes, and the demo (on the tiny model) writes a PNG
whose plotted series, read back from the file, are the run's logged metrics."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make_data():
    return load(EXAMPLES / "data" / "make_demo_data.py", "make_demo_data")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shipped_data_is_what_the_generator_writes(make_data):
    rows = make_data.pairs()
    assert rows == make_data.pairs()  # deterministic
    assert read_jsonl(EXAMPLES / "data" / "demo_preferences.jsonl") == rows
    sft = read_jsonl(EXAMPLES / "data" / "demo_sft.jsonl")
    assert sft == [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows[:-make_data.HELD_OUT]]


def test_pairs_differ_only_in_style_and_held_out_questions_are_new(make_data):
    rows = make_data.pairs()
    held_out, train = rows[-make_data.HELD_OUT:], rows[:-make_data.HELD_OUT]
    question = lambda row: row["prompt"][0]["content"]  # noqa: E731
    assert not {question(r) for r in held_out} & {question(r) for r in train}
    assert len(rows) >= 300
    for row in rows:
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        opener = next(o for o in make_data.POLITE_OPENERS if chosen.startswith(o))
        fact = chosen[len(opener):]
        assert fact.lower().rstrip(".") in rejected.lower()  # the same fact, said differently
        assert len(rejected.split()) > len(chosen.split())
        styles = make_data.RUDE_OPENERS + make_data.RUDE_CLOSERS + make_data.RAMBLE_OPENERS + make_data.RAMBLE_CLOSERS
        assert not any(text.strip() in chosen for text in styles)
        assert any(text.strip() in rejected for text in styles)


@pytest.mark.slow
def test_demo_on_the_tiny_model_writes_a_plot_of_its_logged_metrics(tmp_path, capsys):
    from PIL import Image

    demo = load(EXAMPLES / "demo.py", "plait_demo")
    summary = demo.main(["--tiny", "--output", str(tmp_path), "--max_steps", "6"])
    out = capsys.readouterr().out
    assert "model prefers the polite, short answer" in out and "Q: How can I learn to play the guitar?" in out

    png = tmp_path / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 1000 and image.size[1] > 300
        plotted = json.loads(image.text["Description"])
    series, held_out = plotted["series"], plotted["held_out"]
    logged = [h for h in json.loads((tmp_path / "log_history.json").read_text()) if "loss" in h]
    assert series["step"] == [h["step"] for h in logged]
    for key in ("loss", "rewards/margins", "rewards/accuracies"):
        assert series[key] == [h[key] for h in logged] and len(series[key]) >= 1

    assert held_out["rewards/accuracies"] == [summary["before"]["reward_accuracy"], summary["after"]["reward_accuracy"]]
    # Bounded by steps alone: every asked step runs and is logged, however long each took.
    assert summary["steps"] == 6 and json.loads((tmp_path / "summary.json").read_text())["steps"] == 6
    assert [h["step"] for h in logged] == [5]  # the tiny recipe logs every 5 steps
    # both rounded (train_seconds to 0.1, seconds_per_step to 0.01): within 0.05 / 6 + 0.005
    assert summary["seconds_per_step"] == pytest.approx(summary["train_seconds"] / 6, abs=0.014)
    before, after = summary["before"], summary["after"]
    assert before["reward_margin"] == 0.0 and before["pairs"] == after["pairs"] > 0  # policy = reference at start
    assert after["reward_margin"] > 0.1 and after["reward_accuracy"] > 0.8  # it learned the held-out preference
    assert (tmp_path / "adapter_model.safetensors").is_file()
