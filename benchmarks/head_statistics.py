"""The output layer's log-probs: autograd's chain against :class:`plait.engine.head_statistics.HeadStatistics`.

A one-layer Llama with SmolLM2-135M's widths (hidden 576, vocabulary 49,152), so the output layer is most of
the work, runs ``token_logprobs`` forward and backward as each method calls it: SFT (every position, with the
argmax for token accuracy), DPO (the completion half of each row, with the logit mean) and GRPO (a 128-token
completion, with the entropy, temperature 0.9). "autograd chain" is the same call with a no-op hook on the
output layer, which keeps the generic path (projection, upcast, log-softmax, gather; each chunk but the last
checkpointed). Variants are timed in turn for ``--repeats`` rounds under plait's heap settings (as a training
run has them); the median is reported, in bf16 (autocast) and float32.

    .venv/bin/python benchmarks/head_statistics.py [--repeats 7]
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
RESULTS = HERE / "results" / "head_statistics.json"
BATCH, LENGTH, HIDDEN, VOCAB = 4, 512, 576, 49_152


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    options = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.engine.config import cpu_bf16_support
    from plait.engine.logprobs import token_logprobs
    from plait.engine.memory import keep_freed_heap

    keep_freed_heap()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    models = {"head statistics": LlamaForCausalLM(config), "autograd chain": LlamaForCausalLM(config)}
    models["autograd chain"].load_state_dict(models["head statistics"].state_dict())
    models["autograd chain"].lm_head.register_forward_pre_hook(lambda module, args: None)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    completion = torch.zeros_like(ids, dtype=torch.bool)
    cases = {
        "sft": {"with_argmax": True},
        "dpo": {"with_logit_mean": True, "select": completion.clone().index_fill_(1, torch.arange(LENGTH // 2, LENGTH), True)},
        "grpo": {"with_entropy": True, "temperature": 0.9,
                 "select": completion.clone().index_fill_(1, torch.arange(LENGTH - 128, LENGTH), True)},
    }

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for case, kwargs in cases.items():
            def step(model) -> float:
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                    out = token_logprobs(model, ids, **kwargs)
                loss = -out.logps.mean() + (out.entropy.mean() * 0.01 if out.entropy is not None else 0)
                loss.backward()
                return time.perf_counter() - start

            times = alternated_seconds(models, step, options.repeats)
            median = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            rows.append({"dtype": str(dtype).removeprefix("torch."), "case": case, **{f"{k} ms": v for k, v in median.items()},
                         "speedup": median["autograd chain"] / median["head statistics"]})
            print(f"{rows[-1]['dtype']:9s} {case:5s}: autograd chain {median['autograd chain']:7.1f} ms  "
                  f"head statistics {median['head statistics']:7.1f} ms  {rows[-1]['speedup']:5.2f}x")
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_bf16_support()[1], "cores": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0], "repeats": options.repeats,
              "batch": BATCH, "length": LENGTH, "hidden": HIDDEN, "vocab": VOCAB, "rows": rows}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
