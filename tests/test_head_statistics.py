"""HeadStatistics: the output layer's log-probs, entropy, logit mean and argmax with a handwritten backward,
against autograd of the definition (float64), and its place in token_logprobs."""

from __future__ import annotations

import hypothesis.strategies as st
import peft
import pytest
import torch
from hypothesis import given, settings

from plait.engine import logprobs
from plait.engine.head_statistics import HeadStatistics, Statistics
from test_logprobs import VOCAB, tiny_llama

FEW = settings(max_examples=40, deadline=None)
LOGP_ONLY = Statistics(1.0, with_entropy=False, with_logit_mean=False)


def definition(hidden, weight, bias, targets, temperature):
    x = torch.nn.functional.linear(hidden, weight, bias)
    logp = (x / temperature).log_softmax(-1)
    return (logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1), x.mean(-1),
            x.argmax(-1).to(x.dtype))


@st.composite
def cases(draw):
    N, H, V = draw(st.integers(0, 45)), draw(st.integers(1, 9)), draw(st.integers(2, 70))
    seed = draw(st.integers(0, 2**16))
    wanted = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))  # grads into logp, entropy, mean
    return N, H, V, seed, draw(st.integers(1, 40)), draw(st.sampled_from([1.0, 0.6, 1.7])), draw(st.booleans()), wanted


@FEW
@given(cases())
def test_float32_values_and_gradients_equal_the_definition(case):
    N, H, V, seed, chunk, temperature, with_bias, wanted = case
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(N, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(V, generator=g, dtype=torch.float64) if with_bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    weights = [torch.randn(N, generator=g, dtype=torch.float64) if keep else None for keep in wanted]
    leaves = [t.requires_grad_() for t in (hidden, weight, bias) if t is not None]

    expected = definition(*leaves[:2], bias, targets, temperature)
    ours_leaves = [t.float().requires_grad_() for t in leaves]
    ours_bias = ours_leaves[2] if with_bias else None
    ours = HeadStatistics.apply(ours_leaves[0], ours_leaves[1], ours_bias, targets, torch.float32, chunk,
                                Statistics(temperature, with_entropy=True, with_logit_mean=True, with_argmax=True))
    for name, mine, theirs in zip(("logp", "entropy", "mean"), ours, expected):
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(ours[3].long(), expected[3].long())  # first of tied maxima, like argmax
    if any(wanted):
        expected_grads = _grads(expected, weights, leaves)
        for name, mine, theirs in zip(("hidden", "weight", "bias"), _grads(ours, weights, ours_leaves), expected_grads):
            torch.testing.assert_close(mine.double(), theirs, rtol=1e-4, atol=1e-4, msg=name)


def _grads(outputs, weights, leaves):
    """Gradients of Σ weight·output over the outputs that have a weight (the others get no gradient)."""
    loss = sum((out * w.to(out.dtype)).sum() for out, w in zip(outputs, weights) if w is not None)
    return torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_matches_the_autograd_chain_chunk_for_chunk(temperature):
    # In bf16 both round each chunk's projections and gradients to bf16 and sum the weight's gradient over
    # chunks in float32; what differs is float32 rounding in the softmax.
    g = torch.Generator().manual_seed(0)
    N, H, V, chunk = 50, 32, 500, 16
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    coefficients = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def chain():
        values = []
        for h, t in zip(hidden.split(chunk), targets.split(chunk)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = torch.nn.functional.linear(h, weight)
            logp = (z.float() / temperature).log_softmax(-1)
            values.append((logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)))
        return [torch.cat(v) for v in zip(*values)]

    expected = chain()
    expected_grads = torch.autograd.grad(sum((v * c).sum() for v, c in zip(expected, coefficients)), [hidden, weight])
    ours = HeadStatistics.apply(hidden, weight, None, targets, torch.bfloat16, chunk,
                                Statistics(temperature, with_entropy=True, with_logit_mean=False))
    ours_grads = torch.autograd.grad(sum((v * c).sum() for v, c in zip(ours[:2], coefficients)), [hidden, weight])
    for mine, theirs in zip(ours[:2], expected):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(ours_grads, expected_grads):
        assert ((mine - theirs).abs().max() / theirs.abs().max()).item() < 2e-2


def test_a_frozen_weight_gets_no_gradient_and_no_positions_give_empty_values():
    weight = torch.randn(30, 8)
    hidden = torch.randn(0, 8, requires_grad=True)
    out = HeadStatistics.apply(hidden, weight, None, torch.zeros(0, dtype=torch.long), torch.float32, 4,
                               Statistics(1.0, with_entropy=False, with_logit_mean=False, with_argmax=True))
    assert [tuple(v.shape) for v in out] == [(0,), (0,)]  # log-prob and argmax
    hidden = torch.randn(5, 8, requires_grad=True)
    logp = HeadStatistics.apply(hidden, weight, None, torch.arange(5), torch.float32, 2, LOGP_ONLY)[0]
    (grad,) = torch.autograd.grad(logp.sum(), [hidden])
    assert grad.shape == hidden.shape and torch.isfinite(grad).all()


def spy_on_head_statistics(monkeypatch) -> list:
    calls: list = []
    original = HeadStatistics.apply
    monkeypatch.setattr(logprobs.HeadStatistics, "apply", lambda *args: calls.append(args[4]) or original(*args))
    return calls


def test_token_logprobs_takes_it_for_a_plain_output_layer_and_the_autograd_chain_otherwise(monkeypatch):
    calls = spy_on_head_statistics(monkeypatch)
    ids = torch.randint(0, VOCAB, (2, 7))
    model = tiny_llama(3)
    logprobs.token_logprobs(model, ids, chunk_size=4)
    assert calls == [torch.float32]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs.token_logprobs(model, ids, chunk_size=4)
    assert calls[-1] == torch.bfloat16
    logprobs.token_logprobs(model, ids, chunk_size=4, cast_lm_head_to_fp32=True)
    assert calls[-1] == torch.float32 and len(calls) == 3

    calls.clear()
    logprobs.token_logprobs(model, ids, with_collision=True)  # WPO's normaliser: not in HeadStatistics
    lora_head = peft.get_peft_model(tiny_llama(3), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    logprobs.token_logprobs(lora_head, ids)
    hooked = tiny_llama(3)
    hooked.lm_head.register_forward_hook(lambda module, args, output: output)
    logprobs.token_logprobs(hooked, ids)
    softcapped = tiny_llama(3)
    softcapped.config.final_logit_softcapping = 30.0
    logprobs.token_logprobs(softcapped, ids, chunked=True)
    assert calls == []


def test_lora_below_the_head_still_trains_through_it(monkeypatch):
    calls = spy_on_head_statistics(monkeypatch)
    model = peft.get_peft_model(tiny_llama(3), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, VOCAB, (2, 9))
    logprobs.token_logprobs(model, ids, chunk_size=5).logps.sum().backward()
    trained = {name for name, p in model.named_parameters() if p.grad is not None}
    assert calls and trained and all("lora_" in name for name in trained)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_float32_gradients_are_the_autograd_chains_bits(temperature):
    # The same log-softmax backward on the same gradient: a float32 run trains to the same weights through
    # HeadStatistics as through the chain (FSDP2's sharded head keeps the chain, DDP's plain head takes this).
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    grads = []
    for autograd_chain in (True, False):
        model = tiny_llama(5)
        if autograd_chain:
            model.lm_head.register_forward_pre_hook(lambda module, args: None)
        out = logprobs.token_logprobs(model, ids, chunk_size=7, temperature=temperature, with_logit_mean=True)
        (out.logps.sum() * 0.3 + out.logit_mean.sum() * 0.1).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_a_retained_graph_differentiates_again_to_the_same_gradients():
    hidden = torch.randn(9, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    logp = HeadStatistics.apply(hidden, weight, None, torch.arange(9), torch.float32, 4, LOGP_ONLY)[0]
    first = torch.autograd.grad(logp.sum(), [hidden, weight], retain_graph=True)
    again = torch.autograd.grad(logp.sum(), [hidden, weight])
    for a, b in zip(first, again):
        assert torch.equal(a, b)
