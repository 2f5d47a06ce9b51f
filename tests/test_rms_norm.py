"""plait.engine.rms_norm: a decoder's RMSNorm differentiated by its closed-form gradient on a CPU. The
forward is the module's own numbers bit for bit, the gradients the definition's (float64) and autograd's to
float32 rounding, which norms it takes (by what they compute, not by name), what runs the module's own
forward, and an SFT run that goes through it and learns."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.engine.rms_norm import ClosedFormRMSNorm, closed_form_rms_norms
from plait.testing.tiny_model import loss_and_gradients, tiny_llama, tiny_model_path


def definition(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zhang & Sennrich 2019, eq. 4, in float64."""
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class LlamaStyleRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, written out: the norm the closed form is for."""

    def __init__(self, hidden: int, eps: float, generator: torch.Generator):
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.randn(hidden, generator=generator)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class GemmaStyleRMSNorm(LlamaStyleRMSNorm):
    """An RMSNorm by name whose gain is 1 + w: not the formula, so left alone."""

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 9), hidden=st.sampled_from([8, 16, 40]), scale=st.sampled_from([1e-2, 1.0, 30.0]),
       eps=st.sampled_from([1e-6, 1e-5]), seed=st.integers(0, 2**16))
def test_values_are_the_modules_and_gradients_the_definitions(tokens, hidden, scale, eps, seed):
    generator = torch.Generator().manual_seed(seed)
    norm = LlamaStyleRMSNorm(hidden, eps, generator)
    x = (torch.randn(2, tokens, hidden, generator=generator) * scale).requires_grad_()
    grad = torch.randn(2, tokens, hidden, generator=generator)
    own = norm(x)
    own_grads = torch.autograd.grad(own, (x, norm.weight), grad)
    assert closed_form_rms_norms(norm) == 1
    output = norm(x)
    grads = torch.autograd.grad(output, (x, norm.weight), grad)
    assert output.grad_fn.name() == "ClosedFormRMSNormBackward"
    assert torch.equal(output, own)  # the same ops in the same order
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    expected = torch.autograd.grad(definition(x64, w64, eps), (x64, w64), grad.double())
    for got, by_autograd, exact in zip(grads, own_grads, expected):
        assert got.dtype == torch.float32 and got.shape == exact.shape
        # float32 rounding of the formula, no more than autograd's own rounding of the chain
        assert (got.double() - exact).abs().max() <= 4 * (by_autograd.double() - exact).abs().max() + 1e-6 * exact.abs().max()
        torch.testing.assert_close(got, by_autograd, rtol=1e-5, atol=1e-6 * by_autograd.abs().max().item())


def test_a_frozen_gain_gets_no_gradient_and_a_frozen_input_none_either():
    norm = LlamaStyleRMSNorm(16, 1e-5, torch.Generator().manual_seed(0))
    closed_form_rms_norms(norm)
    norm.weight.requires_grad_(False)  # a LoRA run's norms
    x = torch.randn(3, 5, 16, requires_grad=True)
    output = norm(x)
    assert output.grad_fn.name() == "ClosedFormRMSNormBackward"
    output.square().sum().backward()
    assert x.grad is not None and norm.weight.grad is None
    norm.weight.requires_grad_(True)
    frozen_x = torch.randn(3, 5, 16)  # activations that take no gradient: the gain's alone
    output = norm(frozen_x)
    assert output.grad_fn.name() == "ClosedFormRMSNormBackward"
    (grad_weight,) = torch.autograd.grad(output.square().sum(), norm.weight)
    (expected,) = torch.autograd.grad(LlamaStyleRMSNorm.forward(norm, frozen_x).square().sum(), norm.weight)
    torch.testing.assert_close(grad_weight, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["bf16 input", "no gradient", "inference mode"])
def test_anything_but_a_differentiated_float32_input_runs_the_modules_own_forward(case):
    norm = LlamaStyleRMSNorm(16, 1e-5, torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, 16, requires_grad=True)
    expected = LlamaStyleRMSNorm.forward(norm, x.bfloat16() if case == "bf16 input" else x)
    closed_form_rms_norms(norm)
    if case == "bf16 input":  # transformers rounds x̂ to bf16 before the gain: its own forward keeps that
        output = norm(x.bfloat16())
    elif case == "no gradient":
        with torch.no_grad():
            output = norm(x)
    else:
        with torch.inference_mode():
            output = norm(x)
    assert output.grad_fn is None or output.grad_fn.name() != "ClosedFormRMSNormBackward"
    assert torch.equal(output, expected.detach() if case != "bf16 input" else expected)


def test_the_norms_that_compute_the_formula_change_once():
    model = tiny_llama()
    expected = 2 * model.config.num_hidden_layers + 1  # two a layer and the final one
    assert closed_form_rms_norms(model) == expected and closed_form_rms_norms(model) == 0
    generator = torch.Generator().manual_seed(0)
    others = torch.nn.Sequential(GemmaStyleRMSNorm(8, 1e-6, generator), torch.nn.LayerNorm(8))
    assert closed_form_rms_norms(others) == 0
    half = LlamaStyleRMSNorm(8, 1e-6, generator).bfloat16()  # a bf16 model's norm: its own forward
    assert closed_form_rms_norms(half) == 0


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16 autocast"])
def test_a_model_computes_the_same_loss_and_gradients_within_rounding(autocast):
    plain, closed = tiny_llama(), tiny_llama()
    closed_form_rms_norms(closed)
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        apply = ClosedFormRMSNorm.apply
        patch.setattr(ClosedFormRMSNorm, "apply", lambda *a: calls.append(1) or apply(*a))
        loss, grads = loss_and_gradients(closed, bf16_autocast=autocast)
    assert len(calls) == 2 * closed.config.num_hidden_layers + 1
    expected, expected_grads = loss_and_gradients(plain, bf16_autocast=autocast)
    assert torch.equal(loss, expected)  # the forward is the module's, bit for bit
    # float32 rounding of the norms' gradients, carried through; under autocast a gradient's bf16 cast before
    # a projection's GEMM then rounds an element the other way now and then (up to 1.4e-3 of a norm, measured)
    tolerance = 1e-2 if autocast else 1e-5
    for name, grad in expected_grads.items():
        assert (grads[name] - grad).norm() <= tolerance * grad.norm() + 1e-7, name


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")  # the floor lacks the new name
def test_gradient_checkpointing_recomputes_through_it_to_the_same_gradients():
    model = tiny_llama()
    closed_form_rms_norms(model)
    loss, grads = loss_and_gradients(model, bf16_autocast=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed, checkpointed_grads = loss_and_gradients(model, bf16_autocast=False)
    assert torch.equal(loss, checkpointed)
    assert all(torch.equal(checkpointed_grads[name], grad) for name, grad in grads.items())


def test_an_sft_run_differentiates_its_norms_by_the_formula_and_learns(tmp_path, monkeypatch):
    from datasets import Dataset

    from plait.plugins.methods.sft import SFTConfig, SFTTrainer

    calls = []
    apply = ClosedFormRMSNorm.apply
    monkeypatch.setattr(ClosedFormRMSNorm, "apply", lambda *a: calls.append(1) or apply(*a))
    rows = [{"prompt": f"The {w} is", "completion": f" a {w} of seven blue horses."} for w in ["apple", "river", "stone"]]
    trainer = SFTTrainer(str(tiny_model_path()), train_dataset=Dataset.from_list(rows * 4), args=SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=8, learning_rate=3e-3, bf16=True,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no"))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    layers = trainer.model.config.num_hidden_layers
    # each step: every norm in the forward, the layers' two again in the checkpoint's recompute
    assert len(calls) == 8 * (2 * 2 * layers + 1)
    assert losses[-1] < losses[0] * 0.8, losses
