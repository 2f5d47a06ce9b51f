"""Adapter-only weight sync to vLLM (``vllm_lora_sync``): a LoRA policy reaches a colocated engine
as its adapter alone, served by vLLM's LoRA support over the frozen base weights.

After a real optimizer step on the adapter, greedy completions through the adapter route equal
the merged route's (every weight pushed) and the trainer's own, while each sync carries a small
fraction of the bytes. Engine tests are skipped where vLLM is not installed.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.online.generation import SamplingParams
from plait.online.weights import lora_unservable, payload_bytes, policy_parameters, save_adapter
from plait.testing.tiny_model import tiny_model_path

CHAT = [[{"role": "user", "content": "What is 7 plus 5?"}], [{"role": "user", "content": "Name a river."}]]


def lora_policy(**lora):
    path = str(tiny_model_path())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **lora)
    return get_peft_model(model, config), AutoTokenizer.from_pretrained(path)


def train_step(model, tokenizer, lr=5e-2):
    """One real AdamW step on the adapter: the policy moves away from what the engine holds."""
    ids = torch.tensor([tokenizer("the river runs over the stones and the town sleeps")["input_ids"]])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


def test_adapter_payload_is_the_adapter_alone(tmp_path):
    model, _ = lora_policy()
    sent = save_adapter(model, str(tmp_path))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    with policy_parameters(model) as named:
        merged = payload_bytes(named)
    assert sent == trainable  # exactly the adapter's tensors
    assert sent < merged / 5
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert all(name.startswith("base_model.model.") and ".lora_" in name and ".default." not in name for name in saved)
    assert (tmp_path / "adapter_config.json").exists()


@pytest.mark.parametrize("lora, reason", [({"use_dora": True}, "DoRA"),
                                          ({"modules_to_save": ["lm_head"]}, "modules_to_save")])
def test_adapters_vllm_cannot_serve_take_the_merged_route(lora, reason):
    model, tokenizer = lora_policy(**lora)
    assert reason in lora_unservable(model)
    from plait.plugins.generation.vllm_colocate import VLLMColocateBackend, VLLMColocateParams

    assert not VLLMColocateBackend(model, tokenizer, VLLMColocateParams(lora_sync=True)).lora  # asked, not servable
    assert not VLLMColocateBackend(lora_policy()[0], tokenizer).lora  # a servable adapter merges unless asked
    assert "no PEFT adapter" in lora_unservable(model.get_base_model())


def test_a_quantized_base_is_refused_on_the_merged_route_before_the_engine_starts():
    from plait.errors import PlaitError
    from plait.plugins.generation.vllm_colocate import VLLMColocateBackend

    model, tokenizer = lora_policy()
    layer = model.get_base_model().model.layers[0].mlp.down_proj.base_layer
    # packed 4-bit weights as bitsandbytes' Params4bit holds them: bytes, no float a merged push could carry
    layer.weight = torch.nn.Parameter(torch.zeros(layer.weight.numel() // 2, 1, dtype=torch.uint8), requires_grad=False)
    backend = VLLMColocateBackend(model, tokenizer)
    with pytest.raises(PlaitError, match=r"quantized \(not floats\).*set vllm_lora_sync=True \(only the adapter travels\)"):
        backend.start()
    assert backend.engine is None


def trainer_greedy(model, tokenizer, prompt_ids, n):
    with torch.no_grad():
        return [model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=n, do_sample=False)[0, len(ids):].tolist() for ids in prompt_ids]


@pytest.mark.slow
def test_greedy_samples_equal_the_merged_route():
    pytest.importorskip("vllm")
    from plait.plugins.generation.vllm_colocate import VLLMColocateBackend, VLLMColocateParams

    greedy = SamplingParams(max_completion_length=12, temperature=0.0)
    completions, sent = {}, {}
    for lora_sync in (True, False):  # each route: the same seeded policy and the same optimizer step
        model, tokenizer = lora_policy()
        params = VLLMColocateParams(dtype="float32", max_model_length=256, kv_cache_memory_bytes=32 * 2**20,
                                    lora_sync=lora_sync)
        backend = VLLMColocateBackend(model, tokenizer, params)
        assert backend.lora is lora_sync
        try:
            before = backend.generate(CHAT, greedy)
            train_step(model, tokenizer)
            backend.load_weights(model)
            after = backend.generate(CHAT, greedy)
            sent[lora_sync] = backend.push_bytes[-1]
        finally:
            backend.close()
        completions[lora_sync] = after.completion_ids
        assert after.completion_ids != before.completion_ids  # the sync changed what the engine samples
        eos = set(backend.eos_ids)
        trainer = trainer_greedy(model, tokenizer, after.prompt_ids, 12)
        assert [[t for t in c if t not in eos] for c in after.completion_ids] == \
            [[t for t in c if t not in eos][:len(mine)] for c, mine in zip(trainer, after.completion_ids)]
    assert completions[True] == completions[False]
    assert sent[True] < sent[False] / 5
