"""Put the tiny offline vision-language model and the shapes images where the *_vlm-tiny recipes look.

    python examples/tiny_vlm.py              # -> runs/tiny-vlm (model + processor), runs/shapes/images/*.png
    plait sft --config examples/recipes/sft_vlm-tiny.yaml

The model is plait.testing's tiny Llava (a 1-layer CLIP vision tower on 32x32 images, 16 image
tokens each, and the 2-layer tiny Llama), randomly initialised. The rows ship as
examples/data/shapes_{sft,dpo,grpo}.jsonl (an image path, "What colour is the shape?", the
answer or a chosen/rejected pair, and the shape, colour and position seed); the images are drawn
here from those columns, at the paths the rows name (relative to where plait runs).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from plait.testing.tiny_vlm import draw_images, tiny_vlm_path

DATA = Path(__file__).resolve().parent / "data"


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    target = Path(argv[0] if argv else "runs/tiny-vlm")
    if not (target / "config.json").exists():
        shutil.copytree(tiny_vlm_path(), target, dirs_exist_ok=True)
    drawn = sum(draw_images(jsonl) for jsonl in sorted(DATA.glob("shapes_*.jsonl")))
    print(f"{target} ({drawn} images drawn under runs/shapes/images)")
    return target


if __name__ == "__main__":
    main()
