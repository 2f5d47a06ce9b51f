"""Every recipe in examples/recipes/ stays valid: it parses, its method is installed, its Config
builds, its component names resolve, its data files exist, and its header shows how to run it.
No model is loaded (the tiny recipes also run end to end in test_run.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plait import make_plugins
from plait.recipes.run import check_recipe, load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"
ALL = sorted(RECIPES.glob("*.yaml"))
SMOLLM2 = Path("~/.cache/plait/SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def plugins():
    return make_plugins()


@pytest.fixture(scope="module", autouse=True)
def demo_model_at_its_cache_path(tmp_path_factory):
    """The SmolLM2 recipes name ~/.cache/plait/SmolLM2-135M-Instruct, where examples/smollm2.py
    puts it; components that check their model folder up front (a judge) see one there. On a
    machine without it (a fresh CI box), a home whose cache links that name to the tiny model."""
    if SMOLLM2.expanduser().is_dir():
        yield
        return
    from plait.testing.tiny_model import tiny_model_path

    tiny = tiny_model_path()  # built under the real home before HOME moves
    home = tmp_path_factory.mktemp("home")
    (home / SMOLLM2.parent.relative_to("~")).mkdir(parents=True)
    (home / SMOLLM2.relative_to("~")).symlink_to(tiny, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        yield


def test_each_method_has_a_tiny_and_a_smollm2_recipe(plugins):
    names = {p.stem for p in ALL}
    installed = {c.name.split(".", 1)[1] for c in plugins.methods}
    assert {"sft", "dpo", "kto", "reward_model", "grpo", "rloo", "ppo", "distill"} <= installed
    for method in installed | {name.rsplit("_", 1)[0] for name in names}:
        assert {f"{method}_tiny", f"{method}_smollm2"} <= names, method


@pytest.mark.parametrize("path", ALL, ids=[p.name for p in ALL])
def test_recipe_is_valid(path, plugins):
    method = path.stem.rsplit("_", 1)[0]
    assert method in {c.name.split(".", 1)[1] for c in plugins.methods}, f"{path.name}: method {method!r} not installed"
    config = load_recipe(path, method=method)
    args = check_recipe(config, plugins)
    assert args.output_dir.startswith("runs/")  # runs/ is git-ignored
    assert re.search(rf"plait {method} --config examples/recipes/{path.name}\b", path.read_text()), \
        "the header should show the command that runs it"
