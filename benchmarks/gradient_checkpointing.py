"""Gradient checkpointing on and off: seconds per step and peak memory, DPO and SFT.

    python benchmarks/gradient_checkpointing.py [--layers 6 --seq 512 --batch 2 --steps 2 --rounds 2]

A Llama shaped like SmolLM2-135M (hidden 576, 9 heads, 3 KV heads, vocab 49152, tied embeddings),
built offline with ``--layers`` layers, trains through plait's Trainer at the precision plait's
default picks on this machine, with ``gradient_checkpointing`` off and on; each run in a fresh
process (peak RSS is the process's), the settings interleaved for ``--rounds`` rounds so machine
load hits both alike. Checkpointing trades one extra forward per layer for not keeping the layer's
activations; the ratios say what that trade is worth here. Writes
benchmarks/results/gradient_checkpointing.json.
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

RESULTS = Path(__file__).parent / "results" / "gradient_checkpointing.json"
METHODS = ("dpo", "sft")


def build(layers: int, seq: int, batch: int):
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = 49152
    config = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2 * seq,
                         pad_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2")),
        pad_token="t0", eos_token="t1")
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    half = seq // 2
    rows = [{"prompt_ids": ids(half), "chosen_ids": ids(half - 1) + [1], "rejected_ids": ids(half - 1) + [1]}
            for _ in range(batch)]
    return model, tokenizer, rows


def time_one(method: str, checkpointing: bool, layers: int, seq: int, batch: int, steps: int) -> dict:
    import torch

    from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
    from plait.plugins.methods.sft import SFTConfig, SFTTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer, rows = build(layers, seq, batch)
    common = dict(output_dir="/tmp/plait-bench-ckpt", per_device_train_batch_size=batch, max_steps=steps + 1,
                  save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1, learning_rate=1e-5,
                  max_length=seq, gradient_checkpointing=checkpointing)
    if method == "dpo":
        trainer = DPOTrainer(model, args=DPOConfig(**common), processing_class=tokenizer, train_dataset=None)
        fixed = trainer.plugins.collators.get("collator.preference").obj(tokenizer)(rows)
    else:
        trainer = SFTTrainer(model, args=SFTConfig(**common), processing_class=tokenizer, train_dataset=None)
        lm_rows = [{"input_ids": r["prompt_ids"] + r["chosen_ids"], "completion_mask": [0] * len(r["prompt_ids"])
                    + [1] * len(r["chosen_ids"])} for r in rows]
        fixed = trainer.data_collator(lm_rows)
    seconds = seconds_per_step(trainer, fixed, batch, steps)
    return {"method": method, "gradient_checkpointing": checkpointing, "bf16": bool(trainer.args.bf16),
            "s_per_step": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "load_1min": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "ON"))
    args = parser.parse_args()
    shape = (args.layers, args.seq, args.batch)
    if args.one:
        print(json.dumps(time_one(args.one[0], args.one[1] == "on", *shape, args.steps)))
        return
    runs = []
    for _ in range(args.rounds):
        for method in args.methods:
            for setting in ("off", "on"):
                out = subprocess.run([sys.executable, __file__, "--one", method, setting, "--layers", str(args.layers),
                                      "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps)],
                                     capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {"shape": dict(zip(("layers", "seq", "batch"), shape)), "methods": {}}
    for method in args.methods:
        best = {on: min((r for r in runs if r["method"] == method and r["gradient_checkpointing"] == on),
                        key=lambda r: r["s_per_step"]) for on in (False, True)}
        summary["methods"][method] = {
            "s_per_step_off": best[False]["s_per_step"], "s_per_step_on": best[True]["s_per_step"],
            "slowdown_on": best[True]["s_per_step"] / best[False]["s_per_step"],
            "peak_rss_mib_off": best[False]["peak_rss_mib"], "peak_rss_mib_on": best[True]["peak_rss_mib"],
            "memory_ratio_on": best[True]["peak_rss_mib"] / best[False]["peak_rss_mib"]}
    summary["runs"] = runs
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
