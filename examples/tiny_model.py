"""Put the tiny offline test model (2 layers, ~140k parameters) where the *_tiny recipes look for it.

    python examples/tiny_model.py            # -> runs/tiny-model (seconds; no download)
    plait dpo --config examples/recipes/dpo_tiny.yaml

It is plait.testing's fixture model: random weights and a byte-level BPE tokenizer trained on a
bundled text, so its answers are gibberish; it is there to check that a recipe runs end to end.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from plait.testing.tiny_model import tiny_model_path


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    target = Path(argv[0] if argv else "runs/tiny-model")
    if not (target / "config.json").exists():
        shutil.copytree(tiny_model_path(), target, dirs_exist_ok=True)
    print(target)
    return target


if __name__ == "__main__":
    main()
