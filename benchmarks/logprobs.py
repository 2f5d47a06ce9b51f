"""Peak memory and time of the log-prob path, chunked vs plain (forward + backward).

A random LlamaForCausalLM with a 32k vocabulary and a tiny body (hidden 64, 2 layers), so the
[B, T, V] logits dominate and the numbers isolate the log-prob part. Each variant runs in its
own process; peak memory is the rise of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs just before the measured step) over the resident set at that moment, which
counts every CPU tensor torch allocates. Times are the best of REPEATS steps with the variants
interleaved in one process, so other load on the machine hits them alike. "body" is the same step with the loss taken on the
final hidden states, so "log-prob part" = variant − body.

    .venv/bin/python benchmarks/logprobs.py        # prints a table, writes results/logprobs.json
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

BATCH, SEQ, VOCAB, HIDDEN, LAYERS = 4, 512, 32_768, 64, 2
REPEATS = 5
VARIANTS = {  # name: token_logprobs options (None: the body alone)
    "body": None,
    "plain": {"chunked": False},
    "chunked": {},
    "chunked-256": {"chunk_size": 256},
    "plain+entropy": {"chunked": False, "with_entropy": True},
    "chunked+entropy": {"with_entropy": True},
}


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", pathlib.Path("/proc/self/status").read_text()).group(1))


def _setup():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.engine.logprobs import token_logprobs

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    mask = torch.ones_like(ids)

    def step(name: str) -> None:
        options = VARIANTS[name]
        model.zero_grad(set_to_none=False)  # parameter gradients stay allocated between steps
        if options is None:
            hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            loss = hidden.float().pow(2).mean()
        else:
            out = token_logprobs(model, ids, mask, **options)
            loss = -out.logps[:, 1:].mean() - (out.entropy.mean() if out.entropy is not None else 0)
        loss.backward()

    return step


def measure_memory(name: str) -> float:
    """In a fresh process: peak MiB of one step after a warm-up step."""
    step = _setup()
    step(name)  # warm-up: allocates parameter gradients, which later steps reuse
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    step(name)
    return (_status_kib("VmHWM") - before) / 1024


def measure_time() -> dict:
    """In one process, variants interleaved round by round so machine load hits all alike."""
    step = _setup()
    times = {name: [] for name in VARIANTS}
    for name in VARIANTS:
        step(name)
    for _ in range(REPEATS):
        for name in VARIANTS:
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    from plait.engine.logprobs import default_chunk_size

    def child(*args: str):
        done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    seconds = child("--time")
    rows = {}
    for name, options in VARIANTS.items():
        chunked = options is not None and options.get("chunked", True)
        rows[name] = {
            "variant": name,
            "chunk_size": options.get("chunk_size", default_chunk_size(VOCAB)) if chunked else None,
            "peak_mib": child("--memory", name),
            "seconds": seconds[name],
        }

    body = rows["body"]
    logits_mib = BATCH * SEQ * VOCAB * 4 / 2**20
    print(f"B={BATCH} T={SEQ} V={VOCAB} hidden={HIDDEN} layers={LAYERS}; fp32 logits [B,T,V] = {logits_mib:.0f} MiB")
    print(f"{'variant':<18}{'chunk':>7}{'peak MiB':>11}{'log-prob MiB':>14}{'fwd+bwd s':>11}")
    for r in rows.values():
        part = r["peak_mib"] - body["peak_mib"] if r["variant"] != "body" else float("nan")
        r["logprob_part_mib"] = part
        print(f"{r['variant']:<18}{str(r['chunk_size'] or '-'):>7}{r['peak_mib']:>11.1f}{part:>14.1f}{r['seconds']:>11.3f}")

    ratios = {}
    for chunked, plain in [("chunked", "plain"), ("chunked-256", "plain"), ("chunked+entropy", "plain+entropy")]:
        c, p = rows[chunked], rows[plain]
        ratios[f"{chunked} / {plain}"] = {
            "logprob_peak_ratio": c["logprob_part_mib"] / p["logprob_part_mib"],
            "logprob_peak_reduction": 1 - c["logprob_part_mib"] / p["logprob_part_mib"],
            "total_peak_ratio": c["peak_mib"] / p["peak_mib"],
            "time_ratio": c["seconds"] / p["seconds"],
        }
    print()
    for label, r in ratios.items():
        print(f"{label:<32} log-prob peak x{r['logprob_peak_ratio']:.3f} ({r['logprob_peak_reduction']:.0%} less), "
              f"total peak x{r['total_peak_ratio']:.3f}, time x{r['time_ratio']:.2f}")

    out = pathlib.Path(__file__).parent / "results" / "logprobs.json"
    out.parent.mkdir(exist_ok=True)
    setup = {"batch": BATCH, "seq": SEQ, "vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "threads": 2,
             "memory": "VmHWM rise over VmRSS after /proc/self/clear_refs reset", "time": f"best of {REPEATS} steps, variants interleaved in one process"}
    out.write_text(json.dumps({"setup": setup, "rows": list(rows.values()), "ratios": ratios}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory"]:
        print(json.dumps(measure_memory(sys.argv[2])))
    elif sys.argv[1:2] == ["--time"]:
        print(json.dumps(measure_time()))
    else:
        main()
