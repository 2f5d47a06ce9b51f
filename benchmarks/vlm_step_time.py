"""Text-only against image batches on the same tiny VLM: SFT seconds per optimizer step.

    python benchmarks/vlm_step_time.py [--batch 8 --steps 20]

For each architecture (plait.testing.tiny_vlm: Llava with a CLIP tower, Qwen2-VL) the same
shapes rows are prepared twice, once with their image (16 image tokens each) and once without
(the question alone), and one collated batch of each is trained on ``--steps`` times (one
thread; benchmarks/_timing.seconds_per_step, so no data loading in the step). The collation of
a batch (for images: the image processor per row) is timed on its own. Writes
benchmarks/results/vlm_step_time.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _timing import seconds_per_step  # benchmarks/ is on sys.path: these run as scripts

RESULTS = Path(__file__).parent / "results" / "vlm_step_time.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    a = parser.parse_args()

    import tempfile

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from plait import SFTConfig, SFTTrainer
    from plait.testing.tiny_vlm import shapes_dataset, tiny_qwen2_vl, tiny_vlm_path

    torch.set_num_threads(1)
    builders = {
        "llava": lambda: (AutoModelForImageTextToText.from_pretrained(tiny_vlm_path()),
                          AutoProcessor.from_pretrained(tiny_vlm_path())),
        "qwen2_vl": tiny_qwen2_vl,
    }
    rows = shapes_dataset(a.batch, seed=0)
    text_rows = [{"prompt": [{"role": "user", "content": r["prompt"][0]["content"][1]["text"]}],
                  "completion": [{"role": "assistant", "content": r["colour"]}]} for r in rows]
    results = {}
    for arch, build in builders.items():
        for name, data in (("image", rows), ("text", text_rows)):
            model, processor = build()
            with tempfile.TemporaryDirectory() as out:
                args = SFTConfig(output_dir=out, max_steps=a.steps + 1, per_device_train_batch_size=a.batch,
                                 report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=10**6)
                trainer = SFTTrainer(model, args=args, processing_class=processor, train_dataset=data)
                examples = [trainer.train_dataset[i] for i in range(a.batch)]
                start = time.perf_counter()
                batch = trainer.data_collator(examples)
                collate = time.perf_counter() - start
                step = seconds_per_step(trainer, batch, a.batch, a.steps)
            results[f"{arch}/{name}"] = {"s_per_step": round(step, 4), "collate_s": round(collate, 4),
                                         "tokens_per_row": batch["input_ids"].shape[1]}
            print(arch, name, results[f"{arch}/{name}"], flush=True)
    for arch in builders:
        results[f"{arch}/image_over_text"] = round(results[f"{arch}/image"]["s_per_step"] / results[f"{arch}/text"]["s_per_step"], 2)
    RESULTS.write_text(json.dumps({"batch": a.batch, "steps": a.steps, "threads": 1, **results}, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
