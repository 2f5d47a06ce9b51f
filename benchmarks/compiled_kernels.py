"""A training step with and without plait's compiled elementwise kernels, alternated in one process.

    .venv/bin/python benchmarks/compiled_kernels.py [--method sft] [--rounds 8] [--length 512]

Builds the method's trainer as benchmarks/trl_side_by_side.py does (SmolLM2-135M-Instruct, batch 4, rows of
``--length`` tokens, plait's defaults: bf16 autocast on a CPU with bf16 units, gradient checkpointing), trains two
steps, then times ``training_step`` on one batch round after round with ``PLAIT_COMPILED_KERNELS`` switched
between on and off before each (:mod:`plait.engine.compiled_kernels`: SwiGLU and RMSNorm as single compiled
loops). A third variant, eager again under another name, is the control: its ratio to the first is the run's
noise floor. Also times the first step that compiles (inductor's kernels built, or loaded from its C++ cache).
Prints and writes benchmarks/results/compiled_kernels_<method>.json.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="sft")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    options = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    import plait
    import trl_side_by_side as sbs
    from plait.engine.compiled_kernels import SWITCH

    model = sbs.model_folder(None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    os.environ[SWITCH] = "0"  # the warm-up steps run eager, so the first compiled step below is timed alone
    args = dict(output_dir="/tmp/plait-compiled-kernels", max_steps=2, per_device_train_batch_size=sbs.BATCH,
                save_strategy="no", report_to="none", learning_rate=1e-6, seed=0, max_length=options.length,
                disable_tqdm=True)
    args.update(sbs.method_args(options.method, options.length, groups=1))
    config = getattr(plait, f"{sbs.CONFIG[options.method]}Config")(**args)
    if not config.bf16:  # results/compiled_kernels_*_fp32.json: a trial build whose kernels took float32 too
        raise SystemExit("this CPU trains in float32 by default: the compiled kernels act under bf16 autocast only")
    data = Dataset.from_list(sbs.rows(options.method, options.length, tokenizer, sbs.BATCH * 3))
    trainer = getattr(plait, f"{sbs.CONFIG[options.method]}Trainer")(
        model=model, args=config, train_dataset=data, processing_class=tokenizer,
        **sbs.trainer_kwargs(options.method, model))
    trainer.train()
    batch = next(iter(trainer.get_train_dataloader()))

    def step(switch: str) -> float:
        os.environ[SWITCH] = switch
        start = time.perf_counter()
        trainer.training_step(trainer.model_wrapped, batch)
        return time.perf_counter() - start

    eager_step, first_compiled_step = step("0"), step("1")
    times = alternated_seconds({"eager": "0", "compiled": "1", "eager_again": "0"}, step, options.rounds)
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": sbs.cpu_kind(), "cores": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0], "method": options.method,
              "length": options.length, "rounds": options.rounds,
              "first_compiled_step_seconds": first_compiled_step, "eager_step_seconds": eager_step,
              "seconds": times, "median_seconds": {name: statistics.median(seconds) for name, seconds in times.items()},
              "ratio_to_eager": round_ratios(times, "eager")}
    print(f"first compiled step {first_compiled_step:.2f} s (an eager one {eager_step:.2f} s)")
    for name, seconds in result["median_seconds"].items():
        ratio = result["ratio_to_eager"].get(name)
        print(f"{name:12s} median {seconds:.3f} s" + ("" if ratio is None else f"  per-round ratio {ratio:.4f}"))
    out = HERE / "results" / f"compiled_kernels_{options.method}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
