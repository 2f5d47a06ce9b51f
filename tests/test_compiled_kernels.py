"""plait.engine.compiled_kernels: SwiGLU and RMSNorm as compiled loops under bf16 autocast on a CPU. SwiGLU's
output and gradients are eager's bit for bit, the norm's output and gradient the closed form's within float32
summation order, alike with gradients and without (a DPO policy equals its reference at the first step); what
takes them and what does not; MLPs converted only where their forward is SwiGLU; a checkpointed model's loss
the same; an SFT run that trains through them; a machine where inductor cannot build runs eager; kernels built
under AVX2 and under the CPU's own instruction set sharing one cache stay correct."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from plait.engine import compiled_kernels, rms_norm
from plait.engine.compiled_kernels import SwiGLU, compiled_mlps, forward_pays, pays
from plait.engine.rms_norm import ClosedFormRMSNorm, closed_form_rms_norms
from plait.testing.tiny_model import loss_and_gradients, tiny_llama, tiny_model_path

MIN_TOKENS = compiled_kernels.MIN_TOKENS


@pytest.fixture(autouse=True)
def at_any_size(monkeypatch):
    """Small batches take the kernels here; the sizes test sets the threshold back."""
    monkeypatch.setattr(compiled_kernels, "MIN_TOKENS", 1)
    monkeypatch.delenv(compiled_kernels.SWITCH, raising=False)


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@settings(max_examples=12, deadline=None)
@given(shape=st.sampled_from([(7, 48), (3, 5, 64), (1, 33, 96), (2, 1, 128)]), seed=st.integers(0, 2**16),
       scale=st.sampled_from([0.5, 4.0, 30.0]))
def test_swiglu_is_eagers_silu_and_product_bit_for_bit_forward_and_backward(shape, seed, scale):
    generator = torch.Generator().manual_seed(seed)
    gate, up, grad = (torch.randn(*shape, generator=generator).mul(scale).bfloat16() for _ in range(3))
    leaves = []
    for function in (lambda g, u: F.silu(g) * u, SwiGLU.apply):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        with autocast():
            output = function(g, u)
        output.backward(grad)
        leaves.append((output, g.grad, u.grad))
    for expected, got in zip(*leaves):
        assert got.dtype == torch.bfloat16 and got.shape == expected.shape
        assert torch.equal(got, expected)


def test_the_kernels_are_named_for_torchs_profiler():
    """An inductor kernel runs no aten op a profile could see; each is recorded under its own name."""
    gate, up, grad = (torch.randn(4, 32).bfloat16().requires_grad_(i < 2) for i in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        SwiGLU.apply(gate, up).backward(grad)
    names = {event.name for event in profile.events()}
    assert {"plait::_swiglu", "plait::_swiglu_backward"} <= names


@settings(max_examples=10, deadline=None)
@given(shape=st.sampled_from([(9, 32), (2, 7, 64), (1, 40, 48), (2, 64, 576)]), seed=st.integers(0, 2**16))
def test_the_norms_compiled_loops_are_the_closed_form_within_float32_summation_order(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    x, grad = torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator)
    weight = torch.randn(shape[-1], generator=generator)
    calls = []
    backward = rms_norm.compiled_backward
    results = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rms_norm, "compiled_backward", lambda *a: calls.append(1) or backward(*a))
        for compiled in (False, True):
            leaf_x, leaf_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
            output = ClosedFormRMSNorm.apply(leaf_x, leaf_w, 1e-5, compiled)
            output.backward(grad)
            results.append((output, leaf_x.grad, leaf_w.grad))
    assert len(calls) == 1
    (output, grad_x, grad_w), (compiled_output, compiled_grad_x, compiled_grad_w) = results
    assert relative(compiled_output, output) < 1e-6  # the mean summed in inductor's order
    for expected, got in ((grad_x, compiled_grad_x), (grad_w, compiled_grad_w)):
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert relative(got, expected) < 1e-5


def smollm2_norm() -> torch.nn.Module:
    """A converted Llama RMSNorm of SmolLM2's width, 576, where inductor's order of the mean is not ATen's."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=torch.Generator().manual_seed(1))
    assert closed_form_rms_norms(norm) == 1
    return norm


def test_a_norm_computes_a_batch_alike_with_gradients_and_without_whatever_its_rows(monkeypatch):
    """A trained model's norms and its frozen reference's (no gradients) must agree bit for bit: a compiled forward
    for the one and transformers' eager ops for the other made a DPO run's first loss 0.669 on SmolLM2, not ln 2."""
    monkeypatch.setattr(compiled_kernels, "MIN_TOKENS", MIN_TOKENS)
    norm, frozen = smollm2_norm(), smollm2_norm().requires_grad_(False)
    x = torch.randn(2, MIN_TOKENS // 2 + 40, 576, generator=torch.Generator().manual_seed(0)).mul(3)
    with autocast():
        trained = norm(x.clone().requires_grad_())
        with torch.no_grad():
            reference = frozen(x)
            rows = frozen(x[:, 7:MIN_TOKENS // 2 + 40].contiguous())  # other rows, still above the threshold
            small = frozen(x[:, :8])
        graphs = counters["stats"]["unique_graphs"]
        grad_mode_on = frozen(x)  # gradients on, none asked for (a frozen model outside no_grad): no second compile
    assert counters["stats"]["unique_graphs"] == graphs and torch.equal(grad_mode_on, reference)
    eager = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    assert not torch.equal(reference, eager)  # compiled: the test can tell the two apart at this width
    assert torch.equal(trained, reference) and torch.equal(rows, reference[:, 7:])
    assert torch.equal(small, eager[:, :8])  # below the threshold: transformers' ops


def test_a_dpo_policy_equals_its_reference_at_the_first_step(tmp_path):
    """The first DPO loss is ln 2 and both rewards 0, through the trainer, at SmolLM2's width."""
    import math

    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from plait.plugins.methods.dpo import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path()))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    words = "the sky is blue and the grass is green while snow stays white in the cold".split()
    rows = [{"prompt": " ".join(words[i:] + words[:i]), "chosen": " ".join(words[:i + 3]),
             "rejected": " ".join(reversed(words[: i + 4]))} for i in range(4)]
    trainer = DPOTrainer(model, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, args=DPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, bf16=True, use_cpu=True,
        report_to="none", logging_steps=1, save_strategy="no"))
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["rewards/chosen"] == 0 and first["rewards/rejected"] == 0, first
    assert abs(first["loss"] - math.log(2)) < 1e-6, first


def test_what_takes_the_kernels(monkeypatch):
    x = torch.randn(4, 8)
    assert not pays(x)  # no autocast
    with autocast():
        assert pays(x)
        with torch.no_grad():
            assert not pays(x)  # nothing to differentiate: generation, a frozen reference
            assert forward_pays(x)  # the norm's forward all the same (its numbers are not eager's)
        monkeypatch.setenv(compiled_kernels.SWITCH, "0")
        assert not pays(x)
        monkeypatch.setenv(compiled_kernels.SWITCH, "1")
        monkeypatch.setattr(compiled_kernels, "MIN_TOKENS", MIN_TOKENS)
        assert not pays(torch.randn(MIN_TOKENS - 1, 8)) and pays(torch.randn(2, MIN_TOKENS // 2, 8))
    with torch.autocast("cpu", dtype=torch.float16):
        assert not pays(x) and not forward_pays(x)


def test_only_swiglu_mlps_change_and_only_once():
    model = tiny_llama()
    layers = model.config.num_hidden_layers
    assert compiled_mlps(model) == layers and compiled_mlps(model) == 0
    assert all(getattr(layer.mlp, "_plait_compiled", False) for layer in model.model.layers)
    gelu = tiny_llama()
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    assert compiled_mlps(gelu) == 0  # its forward is not silu(gate) ⊙ up: left as it is


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")  # the floor lacks the new name
def test_a_checkpointed_model_computes_the_same_loss_and_gradients(monkeypatch):
    plain, converted = tiny_llama(), tiny_llama()
    closed_form_rms_norms(plain), closed_form_rms_norms(converted)
    compiled_mlps(converted)
    calls = []
    apply, backward = SwiGLU.apply, rms_norm.compiled_backward
    monkeypatch.setattr(SwiGLU, "apply", lambda *a: calls.append("SwiGLU") or apply(*a))
    monkeypatch.setattr(rms_norm, "compiled_backward", lambda *a: calls.append("norm") or backward(*a))
    for model in (plain, converted):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    results = [loss_and_gradients(model, bf16_autocast=True, tokens=24) for model in (plain, converted)]
    layers = plain.config.num_hidden_layers
    # SwiGLU: the converted model's forward and recompute; the norms' compiled backward: both models' two norms a
    # layer and the final one, once each
    assert calls.count("SwiGLU") == 2 * layers and calls.count("norm") == 2 * (2 * layers + 1)
    (expected, expected_grads), (loss, grads) = results
    assert torch.equal(loss, expected)  # SwiGLU's forward and backward are eager's bit for bit
    for name, grad in expected_grads.items():
        assert torch.equal(grads[name], grad), name


def test_an_sft_run_trains_through_the_kernels(tmp_path, monkeypatch):
    from datasets import Dataset

    from plait.plugins.methods.sft import SFTConfig, SFTTrainer

    calls = []
    apply = SwiGLU.apply
    monkeypatch.setattr(SwiGLU, "apply", lambda *a: calls.append(1) or apply(*a))
    rows = [{"text": f"The colour of the {thing} is {colour}."} for thing, colour in
            [("sky", "blue"), ("grass", "green"), ("sun", "yellow"), ("snow", "white")] * 2]
    trainer = SFTTrainer(str(tiny_model_path()), train_dataset=Dataset.from_list(rows), args=SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=8, learning_rate=3e-3, bf16=True,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no"))
    trainer.train()
    assert len(calls) == 8 * 2 * trainer.model.config.num_hidden_layers  # each step's forward and recompute
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0] - 1.0, losses  # 6.87 -> 5.34 when written


CHILD = """
import json, os, warnings, torch
from plait.engine import compiled_kernels
from plait.engine.compiled_kernels import SwiGLU
from plait.engine.rms_norm import ClosedFormRMSNorm
compiled_kernels.MIN_TOKENS = 1
g = torch.Generator().manual_seed(0)
gate, up, grad = (torch.randn(64, 96, generator=g).bfloat16() for _ in range(3))
x, w = torch.randn(64, 96, generator=g), torch.randn(96, generator=g)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
        SwiGLU.apply(a, b).backward(grad)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ClosedFormRMSNorm.apply(x1, w, 1e-5, True).backward(grad.float())  # compiled
a2, b2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
(torch.nn.functional.silu(a2) * b2).backward(grad)
ClosedFormRMSNorm.apply(x2, w, 1e-5).backward(grad.float())  # the eager closed form
print(json.dumps({"swiglu": torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad),
                  "norm": ((x1.grad - x2.grad).abs().max() / x2.grad.abs().max()).item(),
                  "broken": compiled_kernels._BROKEN, "warnings": [str(w.message) for w in caught]}))
"""


def run_child(**env) -> dict:
    """CHILD's findings in a fresh process; an environment variable given as None is removed."""
    environment = {**os.environ, **env}
    environment = {name: value for name, value in environment.items() if value is not None}
    out = subprocess.run([sys.executable, "-c", CHILD], env=environment, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_a_compiler_it_warns_once_and_runs_eager(tmp_path):
    result = run_child(CXX=str(tmp_path / "no-such-compiler"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    assert result["broken"] and result["swiglu"] and result["norm"] < 1e-6
    assert len([w for w in result["warnings"] if "inductor could not compile" in w]) == 1, result["warnings"]


@pytest.mark.slow
def test_kernels_built_under_two_instruction_sets_share_a_cache_correctly(tmp_path):
    """torch 2.13's FX-graph cache handed AVX2 kernels to an AVX-512 process and the reverse (wrong values, a
    corrupted heap); with it off for these kernels, alternating processes share inductor's C++ cache safely. On
    a CPU without AVX-512 both runs are AVX2."""
    cache = str(tmp_path / "cache")
    for capability in ("avx2", None):  # built under AVX2, then run under the CPU's own (AVX-512 with AMX here)
        result = run_child(TORCHINDUCTOR_CACHE_DIR=cache, ATEN_CPU_CAPABILITY=capability)
        assert not result["broken"] and result["swiglu"] and result["norm"] < 1e-6, (capability, result)
