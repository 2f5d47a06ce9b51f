"""The *_vlm-tiny recipes train the tiny VLM through the installed ``plait`` command, 2 steps each,
in a working tree set up as their headers say (``python examples/tiny_vlm.py``: runs/tiny-vlm and
runs/shapes). tests/test_cli_recipes.py runs only ``<method>_tiny.yaml``; these are run here."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLAIT = Path(sys.executable).parent / "plait"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory, tiny_vlm_path):
    """A working directory as the recipe headers set it up: the recipes and their data beside
    examples/tiny_vlm.py, which was run there (the model and the images under runs/)."""
    root = tmp_path_factory.mktemp("vlm-recipes")
    for folder, pattern in (("recipes", "*_vlm-tiny.yaml"), ("data", "shapes_*.jsonl"), (".", "tiny_vlm.py")):
        (root / "examples" / folder).mkdir(parents=True, exist_ok=True)
        for path in (ROOT / "examples" / folder).glob(pattern):
            shutil.copy(path, root / "examples" / folder / path.name)
    done = subprocess.run([sys.executable, "examples/tiny_vlm.py"], cwd=root, capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(list((root / "runs" / "shapes" / "images").glob("*.png"))) == 64 + 64 + 32
    return root


@pytest.mark.parametrize("method", ["sft", "dpo", "grpo"])
def test_vlm_recipe_trains_through_the_plait_command(tree, method):
    done = subprocess.run([str(PLAIT), method, "--config", f"examples/recipes/{method}_vlm-tiny.yaml", "--max_steps", "2"],
                          cwd=tree, capture_output=True, text=True, timeout=300, env=ENV)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert f"saved the {method} model to runs/{method}-vlm-tiny" in out
    saved = tree / "runs" / f"{method}-vlm-tiny"
    assert (saved / "processor_config.json").exists() and (saved / "model.safetensors").exists()
    if method == "grpo":
        assert "image 32x32" in out  # log_completions shows the prompt's image
