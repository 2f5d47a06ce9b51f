"""The reference every KL-regularised method shares (plait.engine.models.Reference), as TRL 1.16 builds it.

TR-DPO's sync (``sync_ref_model``: π_ref ← α·π + (1 − α)·π_ref every ``ref_model_sync_steps``)
works the same in DPO, KTO, GRPO and RLOO and is refused where there is no separate reference
model to mix into. A policy passed already wrapped in PEFT gets a frozen copy of its adapter as
the reference (TRL's "ref" adapter): the initial policy, adapter included, and no second model.
"""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, TrainerCallback

import plait
from plait import PlaitError
from plait.testing.tiny_model import tiny_model_path

WORDS = ["apple", "river", "stone", "cloud", "music", "garden", "window", "paper"]
PAIRS = Dataset.from_list([{"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.",
                            "rejected": f" The {w} is bad."} for w in WORDS])
PROMPTS = [{"prompt": f"Tell me about the {w}."} for w in WORDS]
MISSING = "/nonexistent/model"  # loading it would fail: refusals that name it came first
CONFIGS = {"dpo": plait.DPOConfig, "kto": plait.KTOConfig, "grpo": plait.GRPOConfig, "rloo": plait.RLOOConfig}
ONLINE = {"grpo": dict(num_generations=2, max_completion_length=4, beta=0.1), "rloo": dict(max_completion_length=4)}


def token_sum(completion_ids, **kwargs):
    """A reward that differs between almost any two completions, so every group has advantages."""
    return [float(sum(ids)) for ids in completion_ids]


def build(method, model, tmp_path, peft_config=None, **overrides):
    """A ``method`` trainer on ``model`` with small data: preference pairs, or prompts for GRPO/RLOO."""
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-2,
                  report_to="none", save_strategy="no", seed=0, disable_tqdm=True, **ONLINE.get(method, {}))
    args = CONFIGS[method](**{**values, **overrides})
    trainer_class = getattr(plait, f"{method.upper()}Trainer")
    if method in ONLINE:
        return trainer_class(model, reward_funcs=token_sum, args=args, train_dataset=PROMPTS, peft_config=peft_config)
    return trainer_class(model, args=args, train_dataset=PAIRS, peft_config=peft_config)


# -- TR-DPO sync --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", list(CONFIGS))
def test_sync_mixes_the_policy_into_the_reference_every_sync_steps(tmp_path, method):
    trainer = build(method, str(tiny_model_path()), tmp_path, sync_ref_model=True, ref_model_sync_steps=2,
                    ref_model_mixup_alpha=0.6, max_steps=3)
    reference = trainer.reference.model
    original = {n: p.detach().clone() for n, p in reference.named_parameters()}
    seen = []

    class Watch(TrainerCallback):  # runs after the sync callback, added before it
        def on_step_end(self, args, state, control, **kwargs):
            seen.append({n: p.detach().clone() for n, p in reference.named_parameters()})
            seen[-1]["policy"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    trainer.add_callback(Watch())
    trainer.train()
    step1, step2, step3 = seen
    assert all(torch.equal(step1[n], original[n]) for n in original)  # step 1: not a multiple of 2
    for name in original:  # step 2: 0.6 of the policy, 0.4 of the reference as it was
        torch.testing.assert_close(step2[name], 0.6 * step2["policy"][name] + 0.4 * original[name])
        assert torch.equal(step3[name], step2[name])
    assert any(not torch.equal(step2[n], original[n]) for n in original)


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_online_sync_with_beta_0_is_refused_before_the_model_loads(tmp_path, method):
    with pytest.raises(PlaitError, match=r"sync_ref_model=True but beta=0.0 uses no reference model"):
        build(method, MISSING, tmp_path, sync_ref_model=True, beta=0.0)


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_sync_with_precomputed_reference_log_probs_is_refused_by_the_config(tmp_path, method):
    with pytest.raises(PlaitError, match="precompute_ref_log_probs=True cannot be combined with sync_ref_model=True"):
        CONFIGS[method](output_dir=str(tmp_path), sync_ref_model=True, precompute_ref_log_probs=True)


@pytest.mark.parametrize("method", list(CONFIGS))
def test_sync_with_peft_is_refused(tmp_path, method):
    with pytest.raises(PlaitError, match="sync_ref_model=True mixes the policy's weights .* the policy has PEFT adapters"):
        build(method, str(tiny_model_path()), tmp_path, peft_config=LoraConfig(r=4, target_modules="all-linear"),
              sync_ref_model=True)
    with pytest.raises(PlaitError, match="the policy has PEFT adapters"):
        build(method, lora_policy(), tmp_path, sync_ref_model=True)


# -- a policy already wrapped in PEFT -----------------------------------------------------------


def lora_policy():
    """The tiny model with a LoRA adapter whose B matrices are not zero: its outputs differ from the base's."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path()),
                           LoraConfig(r=4, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("method", list(CONFIGS))
def test_a_peft_policy_is_its_own_reference_through_a_frozen_adapter_copy(tmp_path, method):
    policy = lora_policy()
    ids = torch.tensor([[56, 73, 281, 600, 311, 70, 278, 88, 327, 311, 417, 319, 18]])
    initial = logits(policy, ids)
    base_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_path()).parameters())
    adapter_params = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    with policy.disable_adapter():
        assert (logits(policy, ids) - initial).abs().max() > 0.1  # the adapter matters

    trainer = build(method, policy, tmp_path)
    reference = trainer.reference
    assert reference.model is None and reference.adapter == "ref" and reference.available
    # no second model: the base once, the trained adapter and its frozen copy
    assert sum(p.numel() for p in trainer.model.parameters()) == base_params + 2 * adapter_params
    assert sum(p.numel() for p in trainer.model.parameters() if p.requires_grad) == adapter_params
    trainer.train()
    moved = logits(trainer.model, ids)
    assert (moved - initial).abs().max() > 1e-3  # the policy trained
    flags = [p.requires_grad for p in trainer.model.parameters()]
    torch.testing.assert_close(reference(trainer.model, lambda m: logits(m, ids)), initial)
    assert trainer.model.active_adapter == "default"
    assert [p.requires_grad for p in trainer.model.parameters()] == flags  # what trains is left as it was
    torch.testing.assert_close(logits(trainer.model, ids), moved)


def test_a_peft_policy_with_another_peft_config_is_refused(tmp_path):
    with pytest.raises(PlaitError, match="model is already a PEFT model and peft_config would add adapters on top"):
        build("dpo", lora_policy(), tmp_path, peft_config=LoraConfig(r=4, target_modules="all-linear"))
