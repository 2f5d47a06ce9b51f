"""What bf16 rotary tables buy a training step: :func:`plait.engine.autocast.rotary_in_compute_dtype` on and off.

Under bf16 autocast, the rotary tables in the autocast's dtype against transformers' float32 tables
(fp32 runs are unchanged by it). One forward and backward of SmolLM2-135M-Instruct
(``examples/smollm2.py`` converts it once) over a padding-free row of 4 sequences × 512 tokens, with
plait's default gradient checkpointing and chunked log-probs, as an SFT step computes it (no
optimizer). The two variants are separate copies of the model in one process, stepped in turn for
``--repeats`` rounds so other load hits them alike; the median is reported.

results/step_parts.json also records a variant measured on 2026-12-04 and then removed: a fused
output layer + log-softmax (one autograd Function keeping only each chunk's logsumexp, commit
3ad138f). It saved nothing in bf16 (8.53 vs 8.54 s) and 2% in fp32 (15.83 vs 15.47 s), so the
simpler checkpointed chunks stayed.

    .venv/bin/python benchmarks/step_parts.py [--repeats 5] [--tokens 512] [--sequences 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _timing import alternated_seconds  # benchmarks/ is on sys.path: these run as scripts

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "step_parts.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=4)
    options = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import plait.engine.logprobs as logprobs
    from plait.engine.autocast import rotary_in_compute_dtype
    from plait.engine.checkpointing import checkpointing_kwargs
    from plait.engine.config import cpu_bf16_support

    sys.path.insert(0, str(HERE.parent / "examples"))
    from smollm2 import smollm2_path

    n = options.tokens * options.sequences
    ids = torch.randint(0, 49_152, (1, n), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(options.tokens).repeat(options.sequences)[None]

    def model(rotary_bf16: bool):
        m = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32, attn_implementation="sdpa")
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(None))
        m.config.use_cache = False
        m.train()
        if rotary_bf16:
            rotary_in_compute_dtype(m)
        return m

    variants = {"bf16": False, "bf16 + rotary_bf16": True}  # name: rotary tables in bf16
    models = {rotary: model(rotary) for rotary in (False, True)}

    def step(rotary_bf16: bool) -> float:
        m = models[rotary_bf16]
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = logprobs.token_logprobs(m, ids, position_ids=positions, with_argmax=True)
        out.logps.sum().backward()
        seconds = time.perf_counter() - start
        m.zero_grad(set_to_none=True)
        return seconds

    times = alternated_seconds(variants, step, options.repeats)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = {"rotary_bf16": median["bf16"] / median["bf16 + rotary_bf16"]}
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_bf16_support()[1], "cores": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0],
              "tokens": n, "command": " ".join(sys.argv[1:]), "median_s": median, "speedup": ratios, "times_s": times}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    for name, value in median.items():
        print(f"{name:22s} {value:6.2f} s")
    for name, value in ratios.items():
        print(f"{name:22s} {value:5.2f}x")


if __name__ == "__main__":
    main()
