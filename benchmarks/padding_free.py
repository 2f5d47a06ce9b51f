"""Padded against padding-free DPO batches: seconds per step and peak memory.

    python benchmarks/padding_free.py [--batch 8 --max-length 128 512 --steps 5 --rounds 2]

DPO on the tiny model (plait.testing.tiny_model) with variable lengths: prompts, chosen and
rejected completions of random tokens, each length drawn uniformly (prompt 4..L/4, completions
1..3L/4 for ``--max-length`` L), so a padded batch pads every row to its longest. Each
(length, layout) runs in a fresh process, interleaved for ``--rounds`` rounds so machine load hits
both alike, on one thread; it reports the best s/step, the growth of the process's peak RSS over training (what
the step itself holds), the share of padding in the padded batch, and the padded/padding-free
ratios. Writes benchmarks/results/padding_free.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from _timing import seconds_per_step  # benchmarks/ is on sys.path: these run as scripts

RESULTS = Path(__file__).parent / "results" / "padding_free.json"
COLLATORS = {"padded": "collator.preference", "padding_free": "collator.preference_padding_free"}


def rows(batch: int, max_length: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(10, 1000) for _ in range(n)]  # noqa: E731  (the tiny vocab: ~1000)
    return [{"prompt_ids": ids(rng.randint(4, max_length // 4)), "chosen_ids": ids(rng.randint(1, 3 * max_length // 4)),
             "rejected_ids": ids(rng.randint(1, 3 * max_length // 4))} for _ in range(batch)]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def time_dpo(layout: str, batch: int, max_length: int, steps: int) -> dict:
    import torch

    from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
    from plait.testing.tiny_model import tiny_model_path

    torch.set_num_threads(1)  # one core each: timings on a shared machine compare like with like
    args = DPOConfig(output_dir="/tmp/plait-bench-padding-free", per_device_train_batch_size=batch,
                     max_steps=steps + 1, save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1,
                     learning_rate=1e-5, max_length=max_length, padding_free=layout == "padding_free")
    trainer = DPOTrainer(str(tiny_model_path()), args=args, train_dataset=None)
    data = rows(batch, max_length)
    fixed = trainer.data_collator(data)
    padded = trainer.plugins.collators.get(COLLATORS["padded"]).obj(trainer.processing_class)(data)
    before = peak_rss_mib()
    seconds = seconds_per_step(trainer, fixed, batch, steps)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"layout": layout, "max_length": max_length, "s_per_step": seconds, "peak_rss_growth_mib": peak_rss_mib() - before,
            "peak_rss_mib": peak_rss_mib(), "tokens_in_forward": fixed["input_ids"].numel(),
            "padding_share": 1 - padded["attention_mask"].float().mean().item(), "losses": losses,
            "load_1min": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=list(COLLATORS))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(time_dpo(args.one, args.batch, args.max_length[0], args.steps)))
        return
    runs = []
    for _ in range(args.rounds):
        for length in args.max_length:
            for layout in COLLATORS:
                out = subprocess.run([sys.executable, __file__, "--one", layout, "--batch", str(args.batch),
                                      "--max-length", str(length), "--steps", str(args.steps)],
                                     capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {"model": "plait tiny model (Llama, 2 layers, hidden 64, vocab ~1000), sdpa, fp32 on one CPU thread",
               "batch": args.batch, "by_max_length": {}}
    for length in args.max_length:
        best = {layout: min((r for r in runs if r["layout"] == layout and r["max_length"] == length),
                            key=lambda r: r["s_per_step"]) for layout in COLLATORS}
        padded, free = best["padded"], best["padding_free"]
        summary["by_max_length"][length] = {
            "padding_share": padded["padding_share"],
            "tokens_in_forward": {k: v["tokens_in_forward"] for k, v in best.items()},
            "s_per_step": {k: v["s_per_step"] for k, v in best.items()},
            "peak_rss_growth_mib": {k: v["peak_rss_growth_mib"] for k, v in best.items()},
            "speedup_padded_over_padding_free": padded["s_per_step"] / free["s_per_step"],
            "rss_growth_ratio_padded_over_padding_free": padded["peak_rss_growth_mib"] / max(free["peak_rss_growth_mib"], 1e-9),
            "first_loss_equal": abs(padded["losses"][0] - free["losses"][0]) < 1e-5,
        }
    print(json.dumps(summary, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
