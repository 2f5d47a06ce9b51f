"""Causal attention's forward and backward: torch's SDPA kernel against plait's blocked backward.

One layer's attention on SmolLM2's heads (9 query heads over 3 key/value heads, 64 wide), differentiated
by torch's own SDPA backward (the CPU flash kernel) and by :class:`plait.engine.causal_attention.CausalAttention`
(the same forward, the blocked backward), for the shapes plait's packed batches call it with: sequences of one
length batched (``batch × length``) and branches over a shared prompt (``batch × length`` queries after a
``prefix``). Each variant is timed in turn for ``--repeats`` rounds under plait's heap settings (as a training
run has them); the median forward + backward is reported, with the speed-up, in bf16 and float32.

    .venv/bin/python benchmarks/attention_backward.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from _timing import alternated_seconds  # benchmarks/ is on sys.path: these run as scripts

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "attention_backward.json"
# (batch, query length, prefix): SFT's 4 × 512, short rows, long ones, a reward model's rejected branch
# after a 255-token prompt, DPO's short completions after a long prompt
SHAPES = [(4, 512, 0), (8, 128, 0), (2, 1024, 0), (1, 2048, 0), (4, 256, 255), (16, 64, 192)]
HEADS, KV_HEADS, DIM = 9, 3, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    options = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from plait.engine.causal_attention import CausalAttention
    from plait.engine.config import cpu_bf16_support
    from plait.engine.memory import keep_freed_heap

    keep_freed_heap()
    groups = HEADS // KV_HEADS

    def attend(query, key, value):  # as transformers' sdpa calls it: is_causal, or a branch's explicit mask
        queries, keys = query.shape[2], key.shape[2]
        if keys == queries:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        else:
            mask = torch.ones(queries, keys, dtype=torch.bool).tril(diagonal=keys - queries)
            out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                                 attn_mask=mask)
        return out.transpose(1, 2)

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for batch, queries, prefix in SHAPES:
            g = torch.Generator().manual_seed(0)
            query = torch.randn(batch, HEADS, queries, DIM, generator=g).to(dtype).requires_grad_()
            key, value = (torch.randn(batch, KV_HEADS, queries + prefix, DIM, generator=g).to(dtype).requires_grad_()
                          for _ in range(2))
            grad = torch.randn(batch, queries, HEADS, DIM, generator=g).to(dtype)
            variants = {"sdpa": lambda: attend(query, key, value),
                        "blocked": lambda: CausalAttention.apply(query, key, value, DIM ** -0.5, attend)}

            def step(run) -> float:
                start = time.perf_counter()
                torch.autograd.grad(run(), (query, key, value), grad)
                return time.perf_counter() - start

            times = alternated_seconds(variants, step, options.repeats)
            median = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            rows.append({"dtype": str(dtype).removeprefix("torch."), "batch": batch, "queries": queries, "prefix": prefix,
                         "sdpa_ms": median["sdpa"], "blocked_ms": median["blocked"],
                         "speedup": median["sdpa"] / median["blocked"]})
            print(f"{rows[-1]['dtype']:9s} {batch:3d} × {queries:5d} after {prefix:4d}: sdpa {median['sdpa']:7.1f} ms  "
                  f"blocked {median['blocked']:7.1f} ms  {rows[-1]['speedup']:5.2f}x")
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_bf16_support()[1], "cores": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0], "repeats": options.repeats,
              "heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM, "rows": rows}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
