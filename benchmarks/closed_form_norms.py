"""An SFT step with transformers' RMSNorm and with plait's closed-form one, alternated in one process.

    .venv/bin/python benchmarks/closed_form_norms.py [--rounds 12] [--precision bf16|fp32]

Builds plait's SFT trainer as benchmarks/trl_side_by_side.py does (SmolLM2-135M-Instruct, batch 4, rows of
512 tokens, plait's defaults: gradient checkpointing, bf16 autocast where asked), trains two steps, then times
``training_step`` on one batch round after round, the model's norms switched between transformers' class and
:mod:`plait.engine.rms_norm`'s closed-form subclass before each step. A third variant, transformers' class again
under another name, is the control: its ratio to the first is the run's noise floor. Separate processes could
not resolve this change on a shared machine (steps of one variant moved 3.9–4.5 s between runs). Prints and
writes benchmarks/results/closed_form_norms.json: each variant's seconds per round, medians, and the median
per-round ratio to transformers' norms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from _timing import alternated_seconds, round_ratios  # benchmarks/ is on sys.path: these run as scripts

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "closed_form_norms.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    options = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    import plait
    import trl_side_by_side as sbs

    model = sbs.model_folder(None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = plait.SFTConfig(output_dir="/tmp/plait-closed-form-norms", max_steps=2, per_device_train_batch_size=sbs.BATCH,
                             save_strategy="no", report_to="none", learning_rate=1e-6, seed=0, max_length=512,
                             bf16=options.precision == "bf16")
    data = Dataset.from_list(sbs.rows("sft", 512, tokenizer, sbs.BATCH * 3))
    trainer = plait.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    norms = [module for module in trainer.model.modules() if getattr(module, "_plait_closed_form", False)]
    if not norms:
        raise SystemExit("no closed-form norms in the trained model: nothing to compare (is this run on a CPU?)")
    closed = type(norms[0])
    own = closed.__mro__[1]
    batch = next(iter(trainer.get_train_dataloader()))

    def step(norm_class: type) -> float:
        for norm in norms:
            norm.__class__ = norm_class
        start = time.perf_counter()
        trainer.training_step(trainer.model_wrapped, batch)
        return time.perf_counter() - start

    times = alternated_seconds({"transformers": own, "closed_form": closed, "transformers_again": own}, step,
                               options.rounds)
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": sbs.cpu_kind(), "cores": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0], "precision": options.precision,
              "rounds": options.rounds, "norms": len(norms), "seconds": times,
              "median_seconds": {name: statistics.median(seconds) for name, seconds in times.items()},
              "ratio_to_transformers": round_ratios(times, "transformers")}
    for name, seconds in result["median_seconds"].items():
        ratio = result["ratio_to_transformers"].get(name)
        print(f"{name:20s} median {seconds:.3f} s" + ("" if ratio is None else f"  per-round ratio {ratio:.4f}"))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
