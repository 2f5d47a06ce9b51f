"""plait_sdpa (plait.engine.attention): a packed row attended one sequence at a time, so a padding-free
batch costs Σ Lᵢ² attention pairs instead of N², with the outputs and gradients of sdpa's block mask;
every other batch is plain sdpa. And where DPO turns padding-free batches on by itself."""

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.engine.attention import packs_per_sequence
from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
from plait.testing.tiny_model import tiny_model_path

CONFIG = transformers.LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)


def model(attention="sdpa"):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIG, attn_implementation=attention).train()


def packed(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (1, sum(lengths)), generator=g)
    return ids, torch.cat([torch.arange(n) for n in lengths])[None]


def output_and_gradients(m, ids, positions):
    m.zero_grad()
    hidden = m.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    hidden.pow(2).mean().backward()
    return hidden.detach(), {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 24), min_size=1, max_size=6))
def test_outputs_and_gradients_equal_sdpa_with_its_block_mask(lengths):
    ids, positions = packed(lengths)
    reference, ours = model(), model()
    assert packs_per_sequence(ours) and ours.config._attn_implementation == "plait_sdpa"
    expected, expected_grads = output_and_gradients(reference, ids, positions)
    got, grads = output_and_gradients(ours, ids, positions)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_segments_of_a_row_with_branches_by_hand():
    from plait.engine.attention import Segment, packed_segments

    #            root [0 1 2 3] | branch from 2 | branch from 3 | own [0 1] | p>0 after no root | too long a prefix
    positions = [0, 1, 2, 3, 2, 3, 3, 4, 5, 0, 1, 4, 5, 2, 3, 4]
    # after [0 1] a branch from 2 would reach past its root's 2 tokens: a sequence of its own
    assert packed_segments(torch.tensor([positions]), len(positions)) == [
        Segment(0, 4, 0, 0), Segment(4, 2, 2, 0), Segment(6, 3, 3, 0), Segment(9, 2, 0, 3),
        Segment(11, 2, 0, 4), Segment(13, 3, 0, 5)]
    assert packed_segments(torch.tensor([[3, 4, 5]]), 3) is None  # one sequence, wherever it starts


def branch_row(shape, seed=0):
    """A packed row of roots, each followed by branches continuing a prefix of it, and the same tokens
    as the full sequences run alone: [(ids alone, where its packed tokens sit in it, their packed places)]."""
    g = torch.Generator().manual_seed(seed)
    ids, positions, alone = [], [], []
    for root_size, branches in shape:
        root = torch.randint(3, 500, (root_size,), generator=g)
        start = len(ids)
        alone.append((root, list(range(root_size)), list(range(start, start + root_size))))
        ids += root.tolist()
        positions += range(root_size)
        for prefix, size in branches:
            prefix = min(prefix, root_size)
            if prefix == positions[-1] + 1:  # it would read as the segment before it going on
                prefix -= 1
            if not prefix:
                continue
            own = torch.randint(3, 500, (size,), generator=g)
            start = len(ids)
            alone.append((torch.cat([root[:prefix], own]), list(range(prefix, prefix + size)), list(range(start, start + size))))
            ids += own.tolist()
            positions += range(prefix, prefix + size)
    return torch.tensor([ids]), torch.tensor([positions]), alone


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.lists(st.tuples(st.integers(1, 12), st.integers(1, 8)), max_size=3)),
                min_size=1, max_size=3))
def test_a_branch_gets_the_outputs_and_gradients_of_its_full_sequence_run_alone(shape):
    ids, positions, alone = branch_row(shape)
    ours, reference = model(), model()
    assert packs_per_sequence(ours)
    weights = torch.randn(ids.shape[1], CONFIG.hidden_size, generator=torch.Generator().manual_seed(1))

    hidden = ours.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0]
    (hidden * weights).sum().backward()
    expected, loss = torch.zeros_like(hidden), 0
    for sequence, own, packed_at in alone:  # each token counted once: where it sits in the packed row
        out = reference.model(input_ids=sequence[None], use_cache=False).last_hidden_state[0, own]
        expected[packed_at] = out.detach()
        loss = loss + (out * weights[packed_at]).sum()
    loss.backward()
    torch.testing.assert_close(hidden.detach(), expected, atol=1e-5, rtol=1e-5)
    for (name, mine), theirs in zip(ours.named_parameters(), reference.parameters(), strict=True):
        if theirs.grad is not None:  # rounding of sums whose terms reach ~100
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_each_sequence_is_attended_alone_without_a_mask(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[0], query.shape[-2], key.shape[-2], attn_mask is None, kwargs.get("is_causal")))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    m = model()
    packs_per_sequence(m)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    ids, positions = packed([7, 3, 1, 7, 5])
    with torch.no_grad():
        m.model(input_ids=ids, position_ids=positions, use_cache=False)
    # per layer: one causal call per sequence length over those sequences' own tokens, the two of
    # length 7 as a batch of 2 (a 1-token sequence needs no causality)
    per_layer = [(2, 7, 7, True, True), (1, 3, 3, True, True), (1, 1, 1, True, False), (1, 5, 5, True, True)]
    assert calls == per_layer * CONFIG.num_hidden_layers


def test_padded_and_cached_batches_are_plain_sdpa():
    reference, ours = model(), model()
    packs_per_sequence(ours)
    ids = torch.randint(3, 500, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, as in generation
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits,
                                   reference(input_ids=ids, attention_mask=mask).logits)
        for m in (reference, ours):
            m.eval()
        generated = [m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
                     for m in (reference, ours)]
    assert torch.equal(*generated)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=1, max_size=4))
def test_a_right_padded_batch_is_attended_without_its_mask_with_sdpas_outputs_and_gradients(lengths):
    """Tokens before their padding, as training collators pad: each token's keys are its row's own, so plait_sdpa
    attends the batch causally without a mask and every token gets what sdpa's padding mask gives it."""
    import transformers.masking_utils as masking

    width = max(lengths)
    ids = torch.randint(3, 500, (len(lengths), width), generator=torch.Generator().manual_seed(len(lengths)))
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    reference, ours = model(), model()
    packs_per_sequence(ours)
    masks = []
    sdpa_mask = masking.ALL_MASK_ATTENTION_FUNCTIONS["plait_sdpa"]
    masking.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["plait_sdpa"] = lambda **kw: masks.append(sdpa_mask(**kw)) or masks[-1]
    try:
        outputs, grads = [], []
        for m in (reference, ours):
            hidden = m.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            (hidden * mask[..., None]).pow(2).sum().backward()  # padding positions read by nothing
            outputs.append(hidden.detach()[mask.bool()])
            grads.append({name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None})
    finally:
        masking.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["plait_sdpa"] = sdpa_mask
    assert masks and all(m is None for m in masks)  # no mask built, padded or not
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_only_padding_after_each_rows_tokens_goes_without_a_mask():
    from transformers.masking_utils import and_masks, causal_mask_function

    from plait.engine.attention import sequence_sdpa_mask

    def mask_for(padding, mask_function=causal_mask_function):
        padding = torch.tensor(padding, dtype=torch.bool)
        return sequence_sdpa_mask(batch_size=padding.shape[0], attention_mask=padding, q_length=padding.shape[1],
                                  kv_length=padding.shape[1], mask_function=mask_function)

    assert mask_for([[1, 1, 1], [1, 1, 0], [1, 0, 0]]) is None  # right padding
    assert mask_for([[1, 1, 1], [0, 1, 1]]) is not None  # left padding (generation): a token would see padding
    assert mask_for([[1, 0, 1]]) is not None  # a hole
    keep_two = and_masks(causal_mask_function, lambda b, h, q, kv: kv < 2)  # a pattern beyond causal: kept
    assert mask_for([[1, 1, 0]], keep_two) is not None


def test_a_model_whose_attention_ignores_position_ids_stays_as_it_was(monkeypatch):
    m = model()
    # as an architecture that never hands position_ids to its attention layers
    from plait.engine import attention
    monkeypatch.setattr(attention, "packed_segments", lambda position_ids, length: None)
    assert not packs_per_sequence(m)
    assert m.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("attention, given, expected", [
    ("sdpa", None, True),  # DPO's default: padding-free where attention runs per sequence
    ("eager", None, False),  # eager's block mask costs the whole row squared: padded rows
    ("eager", True, True),  # asked for: padding-free still, correct through the block mask
    ("sdpa", False, False),
])
def test_dpo_turns_padding_free_on_where_attention_runs_per_sequence(tmp_path, attention, given, expected):
    from datasets import Dataset

    data = Dataset.from_list([{"prompt": "Tell me", "chosen": " apple river", "rejected": " stone"}] * 2)
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", padding_free=given,
                     model_init_kwargs={"attn_implementation": attention})
    t = DPOTrainer(str(tiny_model_path()), args=args, train_dataset=data)
    assert t.padding_free is expected
    batch = t.data_collator([t.train_dataset[0], t.train_dataset[1]])
    assert batch["input_ids"].shape[0] == (1 if expected else 4)
    attentions = {m.config._attn_implementation for m in t.held_models()}  # the policy and its reference copy
    assert len(t.held_models()) == 2
    # plait_sdpa with padded batches too: it attends them as sdpa does, right-padded ones without a mask
    assert attentions == ({"plait_sdpa"} if attention == "sdpa" else {attention})


@pytest.mark.parametrize("implementation, varlen", [
    ("flash_attention_2", True), ("flash_attention_3", True),
    ("kernels-community/flash-attn3", True), ("kernels-community/vllm-flash-attn3", True),
    ("kernels-community/flash-attn@main", True), ("kernels-community/flash-attn:flash_attn_varlen_func", True),
    ("sdpa", False), ("eager", False), ("flex_attention", False), ("kernels-community/paged-attention", False),
])
def test_hub_flash_kernels_count_as_variable_length(implementation, varlen):
    """A Hub kernel (transformers' `kernels` integration) named by its repository attends per packed sequence
    as transformers' own flash kernels do, so padding-free batches keep it as it is."""
    from plait.engine.attention import is_varlen_kernel

    assert is_varlen_kernel(implementation) is varlen
    m = model()
    m.config._attn_implementation = implementation  # as from_pretrained(attn_implementation=...) records it
    if varlen:
        assert packs_per_sequence(m) and m.config._attn_implementation == implementation
