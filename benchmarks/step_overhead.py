"""plait's SFT and DPO steps against a bare torch loop on the same model and batch (ratios).

    python benchmarks/step_overhead.py [--vocab 32768 --seq 512 --batch 2 --steps 6]

For each method it times optimizer steps of (a) a bare loop — full logits, log_softmax,
gather, the loss written inline, AdamW — and (b) plait's Trainer step, with the chunked
log-prob path (default) and with the plain path (``chunked_logprobs=False``), and reports
seconds per step, the ratio to the bare loop, and the peak RSS rise of each variant (each run
in a fresh process so peaks do not mix). Writes benchmarks/results/step_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _timing import seconds_per_step  # benchmarks/ is on sys.path: these run as scripts

RESULTS = Path(__file__).parent / "results" / "step_overhead.json"


def build(vocab: int, seq: int, batch: int):
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * seq,
                         pad_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2")),
                                        pad_token="t0", eos_token="t1")
    g = torch.Generator().manual_seed(0)
    half = seq // 2
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    rows = [{"prompt_ids": ids(half), "chosen_ids": ids(half - 1) + [1], "rejected_ids": ids(half - 1) + [1]} for _ in range(batch)]
    return model, tokenizer, rows


def bare_step_fn(method: str, model, batch):
    """One bare optimizer step: the same math written inline, full logits."""
    import copy

    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    reference = copy.deepcopy(model).eval() if method == "dpo" else None

    def logps(m, ids, attn, mask):
        logits = m(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        token = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (token * mask[:, 1:]).sum(-1), mask[:, 1:].sum()

    def step():
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"].float()
        if method == "sft":
            total, count = logps(model, ids, attn, mask)
            loss = -total.sum() / count
        else:
            policy, _ = logps(model, ids, attn, mask)
            with torch.no_grad():
                ref, _ = logps(reference, ids, attn, mask)
            ratio = policy - ref
            loss = -F.logsigmoid(0.1 * (ratio.chunk(2)[0] - ratio.chunk(2)[1])).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def run_variant(method: str, variant: str, vocab: int, seq: int, batch: int, steps: int) -> dict:
    import torch

    from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
    from plait.plugins.methods.sft import SFTConfig, SFTTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer, rows = build(vocab, seq, batch)
    common = dict(output_dir="/tmp/plait-bench", per_device_train_batch_size=batch, max_steps=steps + 1,
                  save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1000,
                  learning_rate=1e-5, max_length=seq, chunked_logprobs=variant != "plait_plain", dataloader_pin_memory=False)
    if method == "sft":
        data = [{"input_ids": r["prompt_ids"] + r["chosen_ids"], "completion_mask": [0] * len(r["prompt_ids"]) + [1] * len(r["chosen_ids"])} for r in rows]
        trainer = SFTTrainer(model, args=SFTConfig(**common), processing_class=tokenizer, train_dataset=None)
        collator = trainer.plugins.collators.get("collator.language_modeling").obj(tokenizer)
    else:
        data = rows
        trainer = DPOTrainer(model, args=DPOConfig(**common), processing_class=tokenizer, train_dataset=None)
        collator = trainer.plugins.collators.get("collator.preference").obj(tokenizer)
    fixed = collator(data)

    rss0 = _reset_peak()
    if variant == "bare":
        step = bare_step_fn(method, model, fixed)
        step()  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = (time.perf_counter() - start) / steps
    else:
        seconds = seconds_per_step(trainer, fixed, batch, steps)
    return {"method": method, "variant": variant, "s_per_step": seconds, "peak_rss_rise_mib": (_peak() - rss0) / 2**20}


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return _peak()


def _peak() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "VARIANT"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_variant(*args.one, args.vocab, args.seq, args.batch, args.steps)))
        return
    results = []
    for method in ("sft", "dpo"):
        for variant in ("bare", "plait_chunked", "plait_plain"):
            out = subprocess.run([sys.executable, __file__, "--one", method, variant, "--vocab", str(args.vocab),
                                  "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"vocab {args.vocab}, seq {args.seq}, batch {args.batch} (DPO runs 2B rows)")
    print(f"{'method':6} {'variant':14} {'s/step':>8} {'x bare':>7} {'peak MiB':>9} {'x bare':>7}")
    for r in results:
        bare = next(b for b in results if b["method"] == r["method"] and b["variant"] == "bare")
        r["time_ratio"] = r["s_per_step"] / bare["s_per_step"]
        r["memory_ratio"] = r["peak_rss_rise_mib"] / bare["peak_rss_rise_mib"]
        print(f"{r['method']:6} {r['variant']:14} {r['s_per_step']:8.3f} {r['time_ratio']:7.2f} "
              f"{r['peak_rss_rise_mib']:9.0f} {r['memory_ratio']:7.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"vocab": args.vocab, "seq": args.seq, "batch": args.batch, "results": results}, indent=2))


if __name__ == "__main__":
    main()
