"""Every registered method's tiny recipe runs through the installed ``plait`` command, as a user
would run it: ``plait <method> --config examples/recipes/<method>_tiny.yaml --check``, then two
real optimizer steps in a subprocess of the console script. The check calls the console script's
entry point (``plait.cli.main``) in this process: the same code path without paying an interpreter
start-up per method (the training run pays it). The methods come from the registry, so a method added
later is covered too, and fails here until it has ``examples/recipes/<method>_tiny.yaml``.

The runs share one working directory, set up as the recipe headers say (``python
examples/tiny_model.py`` puts the model in ``runs/tiny-model``); a recipe that reads another tiny
recipe's output (distill's teacher is ``runs/sft-tiny``) gets that recipe run first.

The model there is then stored in bfloat16, as most hub checkpoints are, and every run uses a fine-tuning
learning rate (2e-5): trained as bf16 weights, most updates would fall below bf16's resolution and
tensors would come out unchanged; plait trains float32 master weights, so every trained tensor moves.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import yaml
from safetensors.torch import load_file

from transformers import AutoModelForCausalLM

from plait.cli import main
from plait.manager import default_plugins

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
PLAIT = Path(sys.executable).parent / "plait"  # the console script installed beside this python
METHODS = sorted(component.name.split(".", 1)[1] for component in default_plugins().methods)
STEPS = 2
LEARNING_RATE = "2e-5"  # a fine-tuning rate, at which updates to bf16 weights are lost


def tiny_recipe(method: str) -> Path:
    recipe = RECIPES / f"{method}_tiny.yaml"
    if not recipe.is_file():
        pytest.fail(f"method {method!r} has no tiny recipe; add examples/recipes/{method}_tiny.yaml "
                    "(and a SmolLM2 one) like the others")
    return recipe


def output_dir(recipe: Path) -> str:
    return yaml.safe_load(recipe.read_text())["training"]["output_dir"]


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def inputs(recipe: Path) -> set[str]:
    """The runs/ folders a recipe reads (models, teachers, reward models): another recipe's output."""
    return {s for s in strings(yaml.safe_load(recipe.read_text())) if s.startswith("runs/")} - {output_dir(recipe)}


def plait(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PLAIT), *args], cwd=workdir, capture_output=True, text=True, timeout=900)


def plait_check(workdir: Path, method: str, recipe: Path) -> tuple[int, str, str]:
    """``plait <method> --config recipe --check`` through the console script's entry point, in ``workdir``."""
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main([method, "--config", str(recipe), "--check"])
    finally:
        os.chdir(here)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """A working directory with the tiny model where the recipes look for it, made as their headers say."""
    workdir = tmp_path_factory.mktemp("recipes")
    made = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_model.py")], cwd=workdir,
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    model_dir = workdir / "runs" / "tiny-model"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(model_dir)  # stored as most hub checkpoints are
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    return workdir


@pytest.fixture(scope="session")
def trained(workdir):
    """``trained(method)``: check, then train the method's tiny recipe for STEPS steps (once per session);
    returns the output folder."""
    done: dict[Path, Path] = {}

    def train(recipe: Path) -> Path:
        if recipe in done:
            return done[recipe]
        for needed in sorted(inputs(recipe)):
            if not (workdir / needed).exists():
                producers = [r for r in RECIPES.glob("*_tiny.yaml") if output_dir(r) == needed]
                assert producers, f"{recipe.name} reads {needed}, which no tiny recipe writes"
                train(producers[0])
        method = recipe.stem.removesuffix("_tiny")
        status, out, err = plait_check(workdir, method, recipe)
        assert (status, out) == (0, f"plait: {recipe} is a valid {method} recipe\n"), err
        run = plait(workdir, method, "--config", str(recipe), "--max_steps", str(STEPS), "--logging_steps", "1",
                    "--learning_rate", LEARNING_RATE,
                    "--save_strategy", "steps", "--save_steps", str(STEPS), "--disable_tqdm", "true")
        assert run.returncode == 0, f"plait {method} exited {run.returncode}:\n{run.stderr[-4000:]}"
        done[recipe] = workdir / output_dir(recipe)
        return done[recipe]

    return lambda method: train(tiny_recipe(method))


@pytest.mark.parametrize("method", METHODS)
def test_tiny_recipe_checks_and_trains_through_the_plait_command(method, trained, workdir):
    out = trained(method)
    metadata = json.loads((out / "plait_run.json").read_text())
    assert metadata["method"] == method and metadata["config"]["max_steps"] == STEPS

    weights = [out / name for name in ("model.safetensors", "adapter_model.safetensors") if (out / name).is_file()]
    assert weights, f"no model or adapter weights in {out}: {sorted(p.name for p in out.iterdir())}"
    for name, tensor in load_file(weights[0]).items():
        assert torch.isfinite(tensor).all(), f"{weights[0].name}: {name} holds NaN/inf"

    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), state["log_history"]

    initial = load_file(workdir / "runs" / "tiny-model" / "model.safetensors")
    if weights[0].name == "model.safetensors":  # (an adapter run leaves the base as loaded, by design)
        trained_weights = load_file(weights[0])
        assert all(t.dtype == torch.float32 for t in trained_weights.values())  # float32 master weights, saved as such
        same = [name for name, t in trained_weights.items()
                if name in initial and torch.equal(t, initial[name].float())]
        assert not same, f"{method}: trained from a bf16 checkpoint at lr {LEARNING_RATE}, these never changed: {same}"
