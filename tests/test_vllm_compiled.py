"""A long CPU run's colocated vLLM engine runs its model compiled (vllm_enforce_eager unset), and the
compiled engine samples from the trainer's own distribution, as the eager one does
(tests/test_vllm_colocate.py). Skipped where vLLM is not installed."""

import time

import plait
import pytest
import torch
from plait.engine.logprobs import token_logprobs
from plait.online.generation import SamplingParams
from plait.testing.tiny_model import tiny_model_path
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("vllm")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the engine keeps vLLM's own default")]
CHAT = [{"role": "user", "content": "What is 7 plus 5?"}]


def test_a_long_cpu_run_compiles_the_engine_and_samples_the_trainers_distribution(tmp_path):
    from plait.plugins.generation.vllm_colocate import vllm_colocate_backend
    from vllm.config import CompilationMode

    path = tiny_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    args = plait.GRPOConfig(output_dir=str(tmp_path), max_steps=100, max_completion_length=128, report_to="none",
                            vllm_dtype="float32", vllm_max_model_length=256, vllm_kv_cache_memory_bytes=64 * 2**20)
    backend = vllm_colocate_backend(model, tokenizer, args)  # 100 x 128 = 12,800 decode steps planned
    assert backend.params.enforce_eager is False
    start = time.perf_counter()
    backend.start()
    print(f"\ncompiled vLLM colocate engine started in {time.perf_counter() - start:.1f} s")
    try:
        assert backend.engine.llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE
        out = backend.generate([CHAT], SamplingParams(max_completion_length=12, num_generations=4, temperature=1.0))
        assert any(out.completion_ids)
        for prompt, completion, logprobs in zip(out.prompt_ids, out.completion_ids, out.logprobs):
            if completion:
                with torch.no_grad():
                    mine = token_logprobs(model, torch.tensor([prompt + completion])).logps[0, len(prompt):]
                assert (mine - torch.tensor(logprobs)).abs().max().item() < 1e-4  # float32 both sides
    finally:
        backend.close()
