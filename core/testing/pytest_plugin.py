"""pytest plugin shipped with plait (entry point ``pytest11``): fixtures for plugin authors' tests.

    def test_my_loss(plait_plugins):          # a fresh manager, every installed plugin loaded
        check_loss("dpo.my_loss", plait_plugins)

    def test_trains(tiny_model_path):         # a 2-layer chat model + tokenizer, built offline once
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)

Imports stay light at collection time: this module is loaded by every pytest run in an
environment where plait is installed, so torch and transformers are imported only by fixtures.
"""

import pytest

from plait.manager import make_plugins


@pytest.fixture
def plait_plugins():
    """A fresh plait plugin manager with every installed plugin loaded."""
    return make_plugins()


@pytest.fixture(scope="session", name="tiny_model_path")
def _tiny_model_path():
    """Folder of the tiny offline chat model (generation markers in its template), built once and cached."""
    from plait.testing.tiny_model import tiny_model_path

    return tiny_model_path(generation_markers=True)


@pytest.fixture(scope="session", name="tiny_vlm_path")
def _tiny_vlm_path():
    """Folder of the tiny offline vision-language model (Llava: CLIP tower + the tiny Llama) and its processor."""
    from plait.testing.tiny_vlm import tiny_vlm_path

    return tiny_vlm_path()
