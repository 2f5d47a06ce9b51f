"""plait.engine.causal_attention: causal attention's blocked backward (bf16 on a CPU) against the float64
definition, the forward left exactly as the caller's SDPA call, and a packed bf16 model's use of it."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from test_packed_attention import model as packed_attention_model
from torch.utils._python_dispatch import TorchDispatchMode

from plait.engine import causal_attention
from plait.engine.causal_attention import BLOCK_ROWS, CausalAttention, causal_attention_backward


def inputs(batch, kv_heads, groups, queries, prefix, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = queries + prefix
    q = torch.randn(batch, kv_heads * groups, queries, dim, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(batch, kv_heads * groups, queries, dim, generator=g).to(dtype)


def float64_gradients(q, k, v, grad, scale):
    """Autograd of the definition in float64: softmax(Q Kᵀ·scale, keys past i + Lk − Lq hidden) V."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(groups, dim=1) for t in (k64, v64))
    visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(diagonal=k.shape[2] - q.shape[2])
    scores = (q64 @ keys.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return torch.autograd.grad(scores.softmax(-1) @ values, (q64, k64, v64), grad.double())


def sdpa_attend(q, k, v):
    """As transformers' sdpa does for a causal call (``is_causal``) or a branch (an explicit mask), [B, L, H, D]."""
    groups, (queries, keys) = q.shape[1] // k.shape[1], (q.shape[2], k.shape[2])
    if keys == queries:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=queries > 1, enable_gqa=True)
    else:
        mask = torch.ones(queries, keys, dtype=torch.bool).tril(diagonal=keys - queries)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask)
    return out.transpose(1, 2).contiguous()


def relative_error(got, expected):
    # a query with one key has no gradient (its softmax is 1 whatever the score): measured against 1e-3 there
    return ((got.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-3)).item()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2), st.integers(1, 2), st.integers(1, 3), st.integers(1, 2 * BLOCK_ROWS + 5), st.integers(0, 40),
       st.sampled_from([8, 16]))
def test_float32_gradients_are_the_definitions(batch, kv_heads, groups, queries, prefix, dim):
    # across block edges (more queries than BLOCK_ROWS), a branch's prefix, grouped heads, one query
    q, k, v, grad = inputs(batch, kv_heads, groups, queries, prefix, dim, torch.float32)
    scale = dim ** -0.5
    got = causal_attention_backward(q.detach(), k.detach(), v.detach(), grad, scale)
    for mine, exact in zip(got, float64_gradients(q, k, v, grad, scale), strict=True):
        assert mine.shape == exact.shape and mine.dtype == torch.float32
        assert relative_error(mine, exact) < 1e-5


@pytest.mark.parametrize("queries, prefix", [(300, 0), (512, 0), (200, 150), (64, 192), (1, 0)])
def test_bf16_gradients_are_within_bf16s_rounding_of_the_definition(queries, prefix):
    # SmolLM2's heads: 9 query heads over 3 key/value heads, 64 wide. On these inputs torch's flash kernel's bf16
    # gradients are 3e-3 to 1.4e-2 off (largest max error over max value; AVX-512, 2026-12-05), these 3.8e-3 to
    # 1.7e-2: both round scores, probabilities and their gradients to bf16 (2⁻⁸ = 3.9e-3) at different points
    q, k, v, grad = inputs(2, 3, 3, queries, prefix, 64, torch.bfloat16)
    scale = 64 ** -0.5
    with sdpa_kernel(SDPBackend.MATH):  # the suite holds torch to AVX2, where the CPU flash kernel takes no bf16
        mine = torch.autograd.grad(CausalAttention.apply(q, k, v, scale, sdpa_attend), (q, k, v), grad.transpose(1, 2))
    for name, ours, truth in zip("qkv", mine, float64_gradients(q, k, v, grad, scale), strict=True):
        assert ours.dtype == torch.bfloat16
        assert relative_error(ours, truth) < 2e-2, name


def test_the_forward_is_the_callers_own_call_bit_for_bit():
    q, k, v, _ = inputs(2, 3, 3, 40, 24, 64, torch.bfloat16)
    with torch.no_grad():
        expected = sdpa_attend(q, k, v)
    assert torch.equal(CausalAttention.apply(q, k, v, 0.125, sdpa_attend), expected)


# -- a packed bf16 model on plait_sdpa ------------------------------------------------------------------------------
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def packed_bf16_gradients(blocked: bool, checkpointing: bool = False):
    from plait.data.versions import enable_checkpointing
    from plait.engine.attention import packs_per_sequence
    from plait.engine.autocast import rotary_in_compute_dtype
    from plait.engine.checkpointing import ATTENTION_KERNELS, keep_attention

    model = packed_attention_model()  # test_packed_attention's small Llama, on sdpa
    assert packs_per_sequence(model)
    rotary_in_compute_dtype(model)  # as a plait run does: queries and keys stay bf16 through the rotation
    if checkpointing:
        enable_checkpointing(model, {"use_reentrant": False, "context_fn": keep_attention})
    g = torch.Generator().manual_seed(0)
    # root of 40, a branch over its first 30, a sequence of 40 (batched with the root), one of 7
    ids = torch.randint(3, 500, (1, 40 + 12 + 40 + 7), generator=g)
    positions = torch.cat([torch.arange(40), torch.arange(29, 41), torch.arange(40), torch.arange(7)])[None]
    kernels = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in ATTENTION_KERNELS or func == FLASH_BACKWARD:
                kernels[func] = kernels.get(func, 0) + 1
            return func(*args, **(kwargs or {}))

    with pytest.MonkeyPatch.context() as patch, Count(), torch.autocast("cpu", dtype=torch.bfloat16):
        patch.setattr(causal_attention, "BLOCK_ROWS", 16)  # blocks at these lengths too
        if not blocked:
            patch.setattr("plait.engine.attention.pays", lambda query: False)
        hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        hidden.float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, kernels


def test_a_packed_bf16_model_trains_through_it_with_flash_attentions_gradients():
    flash, flash_kernels = packed_bf16_gradients(False)
    blocked, blocked_kernels = packed_bf16_gradients(True)
    assert flash_kernels[FLASH_BACKWARD] > 0 and FLASH_BACKWARD not in blocked_kernels
    assert {k: n for k, n in flash_kernels.items() if k != FLASH_BACKWARD} == blocked_kernels  # the same forwards
    for name, grad in flash.items():  # bf16 rounding, at different points of the same sums
        torch.testing.assert_close(blocked[name], grad, atol=2e-3, rtol=2e-2, msg=name)
    assert max((blocked[n] - g).abs().max().item() for n, g in flash.items()) > 0  # not flash's own backward


def test_the_checkpoints_recompute_still_reuses_attentions_forward():
    plain, plain_kernels = packed_bf16_gradients(True)
    checkpointed, kernels = packed_bf16_gradients(True, checkpointing=True)
    assert kernels == plain_kernels  # three calls a layer (the batched pair, the branch, the 7), none run again
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=0, rtol=0, msg=name)


def test_sfts_padded_batches_in_bf16_train_through_it(tmp_path, monkeypatch):
    """SFT's default batches are padded on the right (padding_free=False, as TRL's): plait_sdpa attends them
    causally without the mask, so a bf16 run's attention backward is the blocked one, and it learns."""
    from datasets import Dataset

    from plait.plugins.methods.sft import SFTConfig, SFTTrainer
    from plait.testing.tiny_model import tiny_model_path

    calls = []
    blocked = causal_attention.causal_attention_backward
    monkeypatch.setattr(causal_attention, "causal_attention_backward", lambda *a: calls.append(a[0].shape) or blocked(*a))
    rows = [{"prompt": f"The {w} is", "completion": " a" + f" {w}" * n + " of seven blue horses."}
            for n, w in enumerate(["apple", "river", "stone", "cloud"])]  # four lengths: padded rows
    trainer = SFTTrainer(str(tiny_model_path()), train_dataset=Dataset.from_list(rows * 2), args=SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=6, learning_rate=3e-3, bf16=True,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no"))
    assert trainer.padding_free is False and trainer.model.config._attn_implementation == "plait_sdpa"
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert not batch["attention_mask"].all()  # padded
    trainer.train()
    layers = trainer.model.config.num_hidden_layers
    assert len(calls) == 6 * layers and all(shape[0] == 4 for shape in calls)  # every layer of every step, 4 rows
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0] - 0.5  # it learns (6.9 -> 5.7 here)
