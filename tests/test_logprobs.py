"""The one log-prob path: chunked equals plain, padding-free equals per-document, bounded logits."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import functools
import weakref
import math

import peft
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from plait.engine.logprobs import (HEAD_BUFFER_BYTES, LOGITS_BUDGET_BYTES, TokenLogprobs, default_chunk_size, head_chunk_size,
                                   token_logprobs)
from plait.errors import PlaitError

VOCAB, HIDDEN = 300, 64
FEW = settings(max_examples=12, deadline=None)


def tiny_llama(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform logits; a larger head makes them peaked so errors would show.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@functools.lru_cache(maxsize=None)
def shared_llama(tie: bool = False) -> LlamaForCausalLM:
    return tiny_llama(0, tie)


def all_stats(model, ids, mask=None, **kw):
    return token_logprobs(model, ids, mask, with_entropy=True, with_logit_mean=True, **kw)


def weighted_sum(out: TokenLogprobs, mask: torch.Tensor) -> torch.Tensor:
    """A loss touching all three outputs, so gradients through each are compared."""
    m = mask.float()
    return (out.logps * m).sum() + 0.3 * (out.entropy * m).sum() - 0.1 * (out.logit_mean * m).sum()


def assert_close_relative(actual, expected, tol=1e-5, msg=""):
    """fp32 agreement relative to the tensor's scale (gradients here reach magnitudes of ~100)."""
    scale = max(1.0, expected.abs().max().item())
    assert (actual - expected).abs().max().item() <= tol * scale, msg


def grads(model, loss) -> dict:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@st.composite
def padded_batches(draw):
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(2, 20))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
    lengths = draw(st.lists(st.integers(1, length), min_size=batch, max_size=batch))
    lengths[0] = length  # one full row, so T is the longest row as a collator would pad it
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    chunk = draw(st.integers(1, max(1, batch * length - 1)))
    temperature = draw(st.sampled_from([0.5, 1.0, 1.7]))
    return ids, mask, chunk, temperature


@FEW
@given(padded_batches(), st.booleans())
def test_chunked_equals_plain_in_values_and_gradients(case, tie):
    ids, mask, chunk, temperature = case
    model = shared_llama(tie)
    chunked = all_stats(model, ids, mask, chunk_size=chunk, temperature=temperature)
    plain = all_stats(model, ids, mask, chunked=False, temperature=temperature)
    for field in ("logps", "entropy", "logit_mean"):
        assert getattr(chunked, field).shape == ids.shape
        torch.testing.assert_close(getattr(chunked, field), getattr(plain, field), atol=1e-5, rtol=1e-5)
    assert (chunked.logps[:, 0] == 0).all() and (plain.logps[:, 0] == 0).all()
    g_chunked, g_plain = grads(model, weighted_sum(chunked, mask)), grads(model, weighted_sum(plain, mask))
    assert g_chunked.keys() == g_plain.keys() == {n for n, _ in model.named_parameters()}
    for name in g_plain:
        assert_close_relative(g_chunked[name], g_plain[name], msg=name)


@FEW
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 12), st.integers(0, 2**16))
def test_padding_free_batch_equals_each_document_alone(doc_lengths, chunk, seed):
    model = shared_llama()
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in doc_lengths]
    packed = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in doc_lengths])[None]
    with torch.no_grad():
        together = all_stats(model, packed, position_ids=position_ids, chunk_size=chunk)
        alone = [all_stats(model, d) for d in docs]
    for field in ("logps", "entropy", "logit_mean"):
        expected = torch.cat([getattr(a, field) for a in alone], dim=1)
        torch.testing.assert_close(getattr(together, field), expected, atol=1e-5, rtol=1e-5)
    starts = position_ids == 0
    assert (together.logps[starts] == 0).all() and (together.logps[~starts] < 0).all()


def test_padding_free_ignores_an_all_ones_attention_mask():
    model = shared_llama()
    ids, position_ids = torch.randint(0, VOCAB, (1, 9)), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        with_mask = token_logprobs(model, ids, torch.ones_like(ids), position_ids=position_ids).logps
        second_alone = token_logprobs(model, ids[:, 4:]).logps
    torch.testing.assert_close(with_mask[:, 4:], second_alone)


@FEW
@given(padded_batches())
def test_logps_and_entropy_match_the_full_softmax_computed_directly(case):
    ids, mask, chunk, temperature = case
    model = shared_llama()
    with torch.no_grad():
        out = all_stats(model, ids, mask, chunk_size=chunk, temperature=temperature)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    probs = torch.softmax(logits / temperature, dim=-1)
    entropy = -(probs * probs.log()).sum(-1)
    logp_next = torch.log(probs[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1))
    torch.testing.assert_close(out.entropy[:, 1:], entropy[:, :-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logps[:, 1:], logp_next, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logit_mean[:, 1:], logits[:, :-1].mean(-1), atol=1e-5, rtol=1e-5)
    assert (out.entropy[:, 0] == 0).all() and (out.logps[:, 0] == 0).all()
    # neither one-hot nor uniform, so the comparison above means something
    assert (entropy > 0.01).all() and entropy.mean() < math.log(VOCAB) - 0.2


def test_temperature_one_logps_sum_to_minus_the_causal_lm_loss():
    model = shared_llama()
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        logps = token_logprobs(model, ids, chunk_size=4).logps
        loss = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(-logps[:, 1:].mean(), loss)


@pytest.mark.parametrize("target_modules", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_lora_model_gets_the_same_values_and_gradients_reach_only_lora(target_modules):
    model = peft.get_peft_model(tiny_llama(1), peft.LoraConfig(r=4, target_modules=target_modules, lora_dropout=0.0))
    with torch.no_grad():  # LoRA B starts at zero; move it so the adapter changes the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = torch.randint(0, VOCAB, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    chunked = all_stats(model, ids, mask, chunk_size=5)
    plain = all_stats(model, ids, mask, chunked=False)
    torch.testing.assert_close(chunked.logps, plain.logps, atol=1e-5, rtol=1e-5)
    with model.disable_adapter(), torch.no_grad():
        base = token_logprobs(model, ids, mask).logps
    assert (chunked.logps - base).abs().max() > 1e-3  # the adapter is really in the path
    g_chunked, g_plain = grads(model, weighted_sum(chunked, mask)), grads(model, weighted_sum(plain, mask))
    assert g_chunked and all("lora_" in name for name in g_chunked)
    assert g_chunked.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for name in g_plain:
        assert_close_relative(g_chunked[name], g_plain[name], msg=name)


def test_lora_dropout_on_the_output_layer_in_training_mode_passes_the_head_check():
    model = peft.get_peft_model(tiny_llama(2), peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.5))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
    model.train()
    out = token_logprobs(model, torch.randint(0, VOCAB, (2, 7)), chunk_size=3)
    out.logps.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_the_output_layer_never_projects_more_than_chunk_size_positions(chunk):
    model = tiny_llama(3)
    ids = torch.randint(0, VOCAB, (3, 6))
    projected: list[int] = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: projected.append(out.reshape(-1, VOCAB).shape[0]))
    try:
        token_logprobs(model, ids, chunk_size=chunk, with_entropy=True).logps.sum().backward()
        first = list(projected)
        projected.clear()
        token_logprobs(model, ids, chunk_size=chunk)
    finally:
        handle.remove()
    # Besides the chunks: the model's own call keeps one position per row (3), and the first
    # call on a model checks that projection once against the model's logits.
    assert first[:2] == [3, 3] and max(first[2:]) <= chunk
    last = 18 - chunk * ((18 - 1) // chunk)  # the last chunk's graph is kept, not recomputed
    assert sum(first[2:]) == 2 * 18 - last  # every position once in forward, once more in backward
    assert projected[0] == 3 and max(projected[1:]) <= chunk and sum(projected[1:]) == 18


class AliveLogits(TorchDispatchMode):
    """The most bytes of [positions, V] tensors alive at once, forward and backward (a tensor an
    autograd node saved stays alive, and counted, until the backward frees the node). The output
    layer's [hidden, V] (its weight's transpose and gradient) is parameter-sized, not counted."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.dim() == 2 and leaf.shape[1] == VOCAB and leaf.shape[0] != HIDDEN:
                key = leaf.untyped_storage().data_ptr()
                if key not in self.alive:
                    self.alive[key] = leaf.untyped_storage().nbytes()
                    weakref.finalize(leaf.untyped_storage(), self.alive.pop, key, None)
        self.peak = max(self.peak, sum(self.alive.values()))
        return out


def peak_logits_bytes(positions: int, chunk: int, autograd_chain: bool = False) -> int:
    model = tiny_llama(3)
    if autograd_chain:  # a hook on the output layer keeps the generic path (projection, log-softmax, gather)
        model.lm_head.register_forward_pre_hook(lambda module, args: None)
    ids = torch.randint(0, VOCAB, (1, positions + 1), generator=torch.Generator().manual_seed(0))
    with AliveLogits() as alive:
        token_logprobs(model, ids, chunk_size=chunk).logps.sum().backward()
    return alive.peak


def test_keeping_the_last_chunks_graph_costs_no_peak_memory():
    # Three chunks (the last one's graph kept from forward to backward, the others recomputed)
    # peak at what one chunk alone does: the backward frees the kept graph before recomputing.
    one = peak_logits_bytes(8, chunk=8, autograd_chain=True)
    assert one > 0 and peak_logits_bytes(24, chunk=8, autograd_chain=True) == one
    assert peak_logits_bytes(24, chunk=24, autograd_chain=True) == 3 * one  # the counter sees a larger chunk


def test_head_statistics_hold_one_chunk_of_logits_at_a_time():
    # HeadStatistics (a plain linear output layer on a CPU) projects every chunk into one reused [chunk, V]
    # buffer, forward and backward, and works out its softmax a block of ROW_BLOCK rows at a time (at most
    # three block-sized tensors: log p, its gradient, the logits' gradient): beside the model's own
    # one-position logits that is all, whatever the positions, and less than the chain's chunk graph.
    from plait.engine.head_statistics import ROW_BLOCK

    assert peak_logits_bytes(8, chunk=8) == peak_logits_bytes(24, chunk=8) == peak_logits_bytes(48, chunk=8)
    assert peak_logits_bytes(96, chunk=48) <= (1 + 48 + 3 * ROW_BLOCK) * VOCAB * 4
    assert peak_logits_bytes(96, chunk=48) < peak_logits_bytes(96, chunk=48, autograd_chain=True)


@FEW
@given(padded_batches(), st.integers(0, 2**16))
def test_select_gives_the_selected_tokens_values_and_gradients_and_zero_elsewhere(case, seed):
    ids, mask, chunk, temperature = case
    select = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.5) & mask.bool()
    model = shared_llama()
    full = all_stats(model, ids, mask, chunk_size=chunk, temperature=temperature)
    expected = grads(model, weighted_sum(full, select))
    chosen = all_stats(model, ids, mask, chunk_size=chunk, temperature=temperature, select=select)
    for name in ("logps", "entropy", "logit_mean"):
        assert_close_relative(getattr(chosen, name), getattr(full, name) * select, msg=name)
        assert (getattr(chosen, name)[~select] == 0).all()
    for name, grad in grads(model, weighted_sum(chosen, select)).items():
        assert_close_relative(grad, expected[name], msg=name)


def test_select_projects_only_the_positions_that_predict_selected_tokens():
    # A 992-token prompt and a 32-token completion: without select the output layer and the
    # softmax over the vocabulary run at all 1024 positions, with it at the 32 that are read.
    model = tiny_llama(3)
    ids = torch.randint(0, VOCAB, (3, 10))
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[:, 7:] = True  # tokens 7..9, predicted by positions 6..8
    projected: list[int] = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: projected.append(out.reshape(-1, VOCAB).shape[0]))
    try:
        token_logprobs(model, ids, select=select)
    finally:
        handle.remove()
    # the model's own call (one position per row), the one-time head check, then the 3 × 3 selected
    assert projected == [3, 3, 9]


def test_plain_path_projects_every_position_for_comparison():
    model = tiny_llama(3)
    projected: list[int] = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: projected.append(out.reshape(-1, VOCAB).shape[0]))
    try:
        token_logprobs(model, torch.randint(0, VOCAB, (3, 10)), chunked=False)
    finally:
        handle.remove()
    assert projected == [30]


def test_an_unknown_transform_after_the_output_layer_is_refused_not_silently_wrong():
    model = tiny_llama(4)
    model.config.final_logit_softcapping = 0.5  # Llama's forward ignores it; plait would apply it
    with pytest.raises(PlaitError, match="chunked=False"):
        token_logprobs(model, torch.randint(0, VOCAB, (1, 6)))
    token_logprobs(model, torch.randint(0, VOCAB, (1, 6)), chunked=False)


def _tiny(model_class, config_class, **extra):
    torch.manual_seed(5)
    config = config_class(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=VOCAB, **extra,
    )
    return model_class(config)


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _tiny(Gemma2ForCausalLM, Gemma2Config, final_logit_softcapping=0.8)


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    return _tiny(GraniteForCausalLM, GraniteConfig, logits_scaling=4.0)


def _cohere():
    from transformers import CohereConfig, CohereForCausalLM

    return _tiny(CohereForCausalLM, CohereConfig, logit_scale=3.0)


@pytest.mark.parametrize("build", [_gemma2, _granite, _cohere], ids=["softcap", "logits_scaling", "logit_scale"])
def test_models_that_transform_their_logits_agree_chunked_and_plain(build):
    model = build()
    ids = torch.randint(0, VOCAB, (2, 9))
    chunked = all_stats(model, ids, chunk_size=4, temperature=0.8)
    plain = all_stats(model, ids, chunked=False, temperature=0.8)
    for field in ("logps", "entropy", "logit_mean"):
        torch.testing.assert_close(getattr(chunked, field), getattr(plain, field), atol=1e-5, rtol=1e-5)


def test_no_grad_and_grad_give_the_same_values():
    model = shared_llama()
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        frozen = token_logprobs(model, ids, chunk_size=3).logps
    assert not frozen.requires_grad
    torch.testing.assert_close(token_logprobs(model, ids, chunk_size=3).logps.detach(), frozen)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": 0.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"chunk_size": 0}, "chunk_size"), ({"chunk_size": 2.5}, "chunk_size")],
)
def test_bad_arguments_raise_naming_the_field(kwargs, field):
    with pytest.raises(PlaitError, match=field):
        token_logprobs(shared_llama(), torch.zeros(1, 4, dtype=torch.long), **kwargs)


def test_default_chunk_size_bounds_one_chunk_of_logits():
    assert default_chunk_size(32_000) * 32_000 * 4 <= LOGITS_BUDGET_BYTES
    assert default_chunk_size(32_000) >= 1000 and default_chunk_size(152_064) >= 200
    assert default_chunk_size(300) == 4096 and default_chunk_size(10**9) == 16

def test_head_chunks_for_a_backward_are_as_few_and_as_even_as_the_buffer_allows():
    # SmolLM2's vocabulary: SFT's 4 x 512 batch (2,044 predicted positions) is one chunk in bf16 and float32
    assert head_chunk_size(2044, 49_152, torch.bfloat16) == 2044
    assert head_chunk_size(2044, 49_152, torch.float32) == 2044
    # past the buffer: the fewest chunks that fit, of equal size (4,096 bf16 rows fit, 4,097 take two, 10,000 three)
    most = HEAD_BUFFER_BYTES // (2 * 49_152)
    assert most == 4096
    assert head_chunk_size(10_000, 49_152, torch.bfloat16) == 3334
    assert head_chunk_size(4097, 49_152, torch.bfloat16) == 2049
    for positions in (1, 15, 4096, 4097, 12_289):
        size = head_chunk_size(positions, 49_152, torch.float32)
        assert size * 49_152 * 4 <= HEAD_BUFFER_BYTES and -(-positions // size) == -(-positions // 2048)
    assert head_chunk_size(0, 49_152, torch.float32) == 1  # no positions: a chunk size HeadStatistics accepts


# Each rank's gradient under DDP, run by torchrun as the other multi-process tests are (it joins the
# ranks and bounds the run); a rank that cannot reach the other fails in two minutes with gloo's reason.
DDP_SCRIPT = """
import datetime, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
sys.path.insert(0, sys.argv[2])
from test_logprobs import VOCAB, tiny_llama
from plait.engine.logprobs import token_logprobs

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
torch.set_num_threads(1)
model = DistributedDataParallel(tiny_llama(6))
ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + rank))
token_logprobs(model, ids, chunk_size=5).logps.sum().backward()
torch.save({n: p.grad for n, p in model.module.named_parameters()}, f"{sys.argv[1]}/grads{rank}.pt")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_under_ddp_every_gradient_is_all_reduced(tmp_path):
    """The forward runs through the DDP wrapper, so the output layer's gradient is averaged too."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "ddp_logprobs.py"
    script.write_text(DDP_SCRIPT)
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reduced = [torch.load(tmp_path / f"grads{r}.pt") for r in range(2)]
    local = []
    for rank in range(2):
        model = tiny_llama(6)
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + rank))
        local.append(grads(model, token_logprobs(model, ids, chunk_size=5).logps.sum()))
    for name, g in local[0].items():
        expected = (g + local[1][name]) / 2
        assert_close_relative(reduced[0][name], expected, tol=1e-5, msg=name)
        assert torch.equal(reduced[0][name], reduced[1][name]), name
    assert not torch.allclose(local[0]["lm_head.weight"], local[1]["lm_head.weight"])


# --- bf16 autocast (mixed precision as accelerate applies it: only the model's forward is autocast) ---

def bf16_prepared(model):
    """``model`` as transformers' Trainer runs it with bf16=True: prepared by accelerate, whose
    forward runs under bf16 autocast and returns fp32 outputs."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # An earlier test in the same process may have left a default (fp32) state behind.
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        return Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("autograd_chain", [True, False], ids=["autograd-chain", "head-statistics"])
def test_under_bf16_autocast_chunked_equals_the_models_own_logits_in_values_and_gradients(autograd_chain):
    # Large logits and a batch of 8: the head check once compared an fp32 projection with the
    # model's bf16 logits and refused ("output differs from the model's logits"). Both the autograd chain
    # (kept by a hook on the output layer) and HeadStatistics run the plain path's float32 log-softmax on
    # the same bf16 logits, so the values are the same bits.
    ids = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    results = []
    for chunked in (True, False):
        model = tiny_llama(0)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
        model = bf16_prepared(model)
        if autograd_chain:
            model.lm_head.register_forward_pre_hook(lambda module, args: None)
        out = all_stats(model, ids, mask, chunked=chunked, chunk_size=24)
        results.append((out, grads(model, weighted_sum(out, mask))))
    (chunked_out, chunked_grads), (plain_out, plain_grads) = results
    for field in ("logps", "entropy", "logit_mean"):
        assert torch.equal(getattr(chunked_out, field), getattr(plain_out, field)), field
    for name, g in plain_grads.items():
        assert_close_relative(chunked_grads[name], g, tol=2e-2, msg=name)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_bf16_autocast_logprobs_stay_within_bound_of_fp32(tie):
    """bf16 keeps 8 mantissa bits; each token's log-prob moves by at most 0.012 here (0.040 tied,
    whose embeddings the ×8 head scaling inflates too; 0.002 on plait's tiny model, 0.007 on a
    256-wide 4-layer Llama, benchmarks/precision.py), bounded below 0.1 nats."""
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    reference = token_logprobs(shared_llama(tie), ids).logps
    fp32_again = token_logprobs(shared_llama(tie), ids, chunk_size=40).logps
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast around the whole call
        around = token_logprobs(shared_llama(tie), ids, chunk_size=40).logps
    prepared = token_logprobs(bf16_prepared(tiny_llama(0, tie)), ids, chunk_size=40).logps
    assert_close_relative(fp32_again, reference)  # outside autocast, fp32 as before
    for bf16 in (around, prepared):
        error = (bf16 - reference).abs().max().item()
        assert 0 < error < 0.1, error  # 0 would mean bf16 never ran


def test_prompt_tuning_virtual_tokens_are_not_scored_and_sft_trains_them(tmp_path):
    """A PEFT prompt-learning model prepends virtual tokens to every row: its outputs have T + n positions,
    the first n predicting none of the given tokens (TRL's prompt-tuning test: the log-prob path used to
    reshape [B, T + n] as [B, T])."""
    model = peft.get_peft_model(tiny_llama(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids).logits
    assert logits.shape[1] == 10  # 3 virtual + 7 given
    expected = torch.log_softmax(logits[:, 3:-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    for chunked in (True, False):
        got = token_logprobs(model, ids, torch.ones_like(ids), chunked=chunked).logps
        torch.testing.assert_close(got[:, 1:], expected)
    from datasets import Dataset

    import plait
    from plait.testing.tiny_model import tiny_model_path

    args = plait.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=0.1,
                           report_to="none")
    rows = Dataset.from_list([{"prompt": "The sky is", "completion": " blue."}] * 4)
    trainer = plait.SFTTrainer(str(tiny_model_path()), args=args, train_dataset=rows,
                               peft_config=peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    before = trainer.model.get_prompt_embedding_to_save("default").clone()
    trainer.train()
    assert not torch.equal(before, trainer.model.get_prompt_embedding_to_save("default"))


def test_head_statistics_take_one_chunk_for_a_backward_and_the_chains_chunks_without_one(monkeypatch):
    # Each chunk but the last is projected again in the backward and summed into the weight's gradient on
    # its own, so a call that trains takes as few chunks as HeadStatistics' one buffer allows; a call without
    # gradients (a reference model) saves nothing by it and keeps the chain's smaller chunks.
    import plait.engine.logprobs as logprobs

    monkeypatch.setattr(logprobs, "LOGITS_BUDGET_BYTES", 16 * VOCAB * 4)  # the chain: 16 positions a chunk
    monkeypatch.setattr(logprobs, "HEAD_BUFFER_BYTES", 40 * VOCAB * 4)  # the buffer: up to 40
    calls = []
    real = logprobs.HeadStatistics

    class Spy(real):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, dtype, chunk, statistics):
            calls.append((hidden.shape[0], chunk))
            return real.forward(ctx, hidden, weight, bias, targets, dtype, chunk, statistics)

    monkeypatch.setattr(logprobs, "HeadStatistics", Spy)
    model = tiny_llama(5)
    ids = torch.randint(0, VOCAB, (3, 12))
    token_logprobs(model, ids).logps.sum().backward()
    with torch.no_grad():
        token_logprobs(model, ids)
    assert calls == [(36, 36), (36, 16)]
    # 36 positions past a 24-position buffer: two even chunks of 18
    monkeypatch.setattr(logprobs, "HEAD_BUFFER_BYTES", 24 * VOCAB * 4)
    token_logprobs(model, ids).logps.sum().backward()
    assert calls[-1] == (36, 18)
