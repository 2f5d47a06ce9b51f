"""fp32 against bf16 autocast: DPO seconds per step and the log-prob error bf16 makes.

    python benchmarks/precision.py [--vocab 8192 --seq 256 --batch 2 --layers 4 --steps 4 --rounds 2]

A Llama built offline (hidden 256, ``--layers`` layers, ``--vocab`` tokens, tied embeddings)
trains DPO through plait's Trainer with ``bf16=False`` and ``bf16=True``, each run in a fresh
process, the two interleaved for ``--rounds`` rounds so machine load hits both alike. It also
reports the largest per-token log-prob difference of bf16 autocast from fp32 on the same batch
(the chunked path, under autocast as accelerate applies it), and what plait's default picks here
and why. Writes benchmarks/results/precision.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _timing import seconds_per_step  # benchmarks/ is on sys.path: these run as scripts

RESULTS = Path(__file__).parent / "results" / "precision.json"


def build(vocab: int, seq: int, batch: int, layers: int):
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * seq,
                         pad_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    vocab_map = {f"t{i}": i for i in range(vocab)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab_map, unk_token="t2")),
                                        pad_token="t0", eos_token="t1")
    g = torch.Generator().manual_seed(0)
    half = seq // 2
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    rows = [{"prompt_ids": ids(half), "chosen_ids": ids(half - 1) + [1], "rejected_ids": ids(half - 1) + [1]}
            for _ in range(batch)]
    return model, tokenizer, rows


def time_dpo(bf16: bool, vocab: int, seq: int, batch: int, layers: int, steps: int) -> dict:
    import torch

    from plait.plugins.methods.dpo import DPOConfig, DPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer, rows = build(vocab, seq, batch, layers)
    args = DPOConfig(output_dir="/tmp/plait-bench-precision", per_device_train_batch_size=batch, max_steps=steps + 1,
                     save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1,
                     learning_rate=1e-5, max_length=seq, bf16=bf16)
    trainer = DPOTrainer(model, args=args, processing_class=tokenizer, train_dataset=None)
    fixed = trainer.plugins.collators.get("collator.preference").obj(tokenizer)(rows)
    seconds = seconds_per_step(trainer, fixed, batch, steps)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"bf16": bf16, "s_per_step": seconds, "losses": losses,
            "load_1min": os.getloadavg()[0]}


def logprob_error(vocab: int, seq: int, batch: int, layers: int) -> dict:
    """Max and mean |log p_bf16 - log p_fp32| per token, chunked path, accelerate-style autocast."""
    import torch
    from accelerate.utils import convert_outputs_to_fp32

    from plait.engine.logprobs import token_logprobs

    model, tokenizer, rows = build(vocab, seq, batch, layers)
    ids = torch.tensor([r["prompt_ids"] + r["chosen_ids"] for r in rows])
    with torch.no_grad():
        fp32 = token_logprobs(model, ids).logps[:, 1:]
        model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward))
        bf16 = token_logprobs(model, ids).logps[:, 1:]
    diff = (bf16 - fp32).abs()
    return {"max_abs_logprob_error": diff.max().item(), "mean_abs_logprob_error": diff.mean().item(),
            "max_abs_sequence_logprob_error": (bf16 - fp32).sum(-1).abs().max().item(),
            "tokens": ids.numel()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=["fp32", "bf16"])
    args = parser.parse_args()
    shape = (args.vocab, args.seq, args.batch, args.layers)
    if args.one:
        print(json.dumps(time_dpo(args.one == "bf16", *shape, args.steps)))
        return
    from plait.engine.config import cpu_bf16_support

    native, reason = cpu_bf16_support()
    runs = []
    for _ in range(args.rounds):
        for name in ("fp32", "bf16"):
            out = subprocess.run([sys.executable, __file__, "--one", name, "--vocab", str(args.vocab), "--seq",
                                  str(args.seq), "--batch", str(args.batch), "--layers", str(args.layers),
                                  "--steps", str(args.steps)], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = {name: min(r["s_per_step"] for r in runs if r["bf16"] == (name == "bf16")) for name in ("fp32", "bf16")}
    error = logprob_error(*shape)
    summary = {"shape": dict(zip(("vocab", "seq", "batch", "layers"), shape)), "cpu_native_bf16": native,
               "reason": reason, "best_s_per_step": best, "bf16_speedup": best["fp32"] / best["bf16"],
               "logprob_error": error, "runs": runs}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
