"""plait.engine.cpu_linear: linear layers under bf16 autocast on a CPU. The output and the input's gradient are
autocast's own numbers bit for bit, the weight gradient autograd's to bf16 rounding (and as near the float64
definition), layers reading one tensor share its cast without changing a gradient, a changed tensor is cast
again, what runs ``nn.Linear``'s own forward, and a DPO run that trains through it."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from plait.engine import cpu_linear
from plait.engine.cpu_linear import AutocastLinear, CpuLinear, cpu_linears, transposed
from plait.testing.tiny_model import loss_and_gradients, tiny_llama, tiny_model_path

BF16_EPS = 2.0**-8  # bf16 keeps 8 significant bits
MIN_TOKENS, MIN_WIDTH = cpu_linear.MIN_TOKENS, cpu_linear.MIN_WIDTH  # the sizes from which it pays


@pytest.fixture(scope="module", autouse=True)
def at_any_size():
    """The tests below take small layers and batches through the Function; the last ones check the sizes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_linear, "MIN_TOKENS", 1)
        patch.setattr(cpu_linear, "MIN_WIDTH", 1)
        yield


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def pair(in_features: int, out_features: int, bias: bool, seed: int) -> tuple[torch.nn.Linear, CpuLinear]:
    torch.manual_seed(seed)
    plain = torch.nn.Linear(in_features, out_features, bias=bias)
    converted = torch.nn.Linear(in_features, out_features, bias=bias)
    converted.load_state_dict(plain.state_dict())
    assert cpu_linears(converted) == 1 and type(converted) is CpuLinear
    return plain, converted


def forward_and_gradients(layer, x, grad):
    x = x.detach().requires_grad_()
    with autocast():
        output = layer(x * 1)  # an activation, as in a model: not a leaf
    params = [layer.weight] + ([layer.bias] if layer.bias is not None else [])
    return output, torch.autograd.grad(output, [x, *params], grad)


def test_transposed_copies_rows_into_columns():
    x = torch.randn(7, 5).bfloat16()
    assert torch.equal(transposed(x), x.t().contiguous()) and transposed(x).is_contiguous()


@settings(max_examples=30, deadline=None)
@given(widths=st.sampled_from([(16, 48), (48, 16), (32, 32), (40, 8)]), tokens=st.integers(1, 70),
       bias=st.booleans(), batched=st.booleans(), low_input=st.booleans(), seed=st.integers(0, 2**16))
def test_outputs_and_input_gradients_are_autocasts_and_weight_gradients_within_bf16_rounding(
        widths, tokens, bias, batched, low_input, seed):
    in_features, out_features = widths
    # a bf16 input with nothing to share and autograd's weight gradient: nn.Linear's forward (the sizes' test)
    assume(not low_input or cpu_linear._row_major_side(in_features, out_features) is not None)
    plain, converted = pair(in_features, out_features, bias, seed)
    shape = (2, tokens, in_features) if batched else (tokens, in_features)
    x = torch.randn(shape)
    if low_input:  # a layer fed by another's bf16 output (the attention's output projection, the MLP's down)
        x = x.bfloat16()
    grad = torch.randn(*shape[:-1], out_features).bfloat16()
    expected, expected_grads = forward_and_gradients(plain, x, grad)
    output, grads = forward_and_gradients(converted, x, grad)
    assert output.grad_fn.name() == "AutocastLinearBackward"
    assert output.dtype == torch.bfloat16 and torch.equal(output, expected)
    assert torch.equal(grads[0], expected_grads[0]) and grads[0].dtype == x.dtype
    if bias:
        assert torch.equal(grads[2], expected_grads[2])
    weight_grad, by_autograd = grads[1], expected_grads[1]
    assert weight_grad.dtype == torch.float32 and weight_grad.is_contiguous()
    if cpu_linear._row_major_side(in_features, out_features) is None:  # autograd's own GEMM
        assert torch.equal(weight_grad, by_autograd)
    # the same float32 sums, blocked differently: their bf16 rounding differs by one place here and there
    largest = by_autograd.abs().max().item()
    assert (weight_grad - by_autograd).abs().max().item() <= BF16_EPS * largest
    exact = grad.double().reshape(-1, out_features).T @ x.bfloat16().double().reshape(-1, in_features)
    assert (weight_grad.double() - exact).abs().max() <= 2 * (by_autograd.double() - exact).abs().max() + 1e-12


@pytest.mark.parametrize("widths", [(16, 48), (48, 16)], ids=["wider output", "wider input"])
def test_a_broadcast_gradient_differentiates_as_autograd(widths):
    plain, converted = pair(*widths, True, 0)
    x = torch.randn(3, 5, widths[0])
    grads = []
    for layer in (plain, converted):
        source = x.clone().requires_grad_()
        with autocast():
            output = layer(source * 1)
        output.float().sum().backward()  # the output's gradient arrives as an expanded tensor of ones
        grads.append((source.grad, layer.weight.grad, layer.bias.grad))
    assert output.grad_fn.name() == "AutocastLinearBackward"
    (x_grad, weight_grad, bias_grad), (expected_x, expected_weight, expected_bias) = grads[1], grads[0]
    assert torch.equal(x_grad, expected_x) and torch.equal(bias_grad, expected_bias)
    assert (weight_grad - expected_weight).abs().max() <= BF16_EPS * expected_weight.abs().max()


def test_layers_reading_one_tensor_share_its_cast_and_sum_their_gradients_as_autograd():
    torch.manual_seed(0)
    plain = [torch.nn.Linear(32, width, bias=False) for width in (32, 16, 16)]  # query, key, value
    converted = [torch.nn.Linear(32, width, bias=False) for width in (32, 16, 16)]
    for mine, theirs in zip(converted, plain):
        mine.load_state_dict(theirs.state_dict())
        cpu_linears(mine)
    x = torch.randn(3, 10, 32)

    def run(layers):
        leaf = x.clone().requires_grad_()
        source = leaf * 1.0  # the normalised hidden states: not a leaf, whose casts autocast would cache
        with autocast():
            outputs = [layer(source) for layer in layers]
        saved = {out.grad_fn.saved_tensors[0].data_ptr() for out in outputs  # each layer's input as kept
                 if out.grad_fn.name() == "AutocastLinearBackward"}
        sum(out.float().square().sum() for out in outputs).backward()
        return outputs, leaf.grad, saved

    outputs, grad, casts = run(converted)
    expected_outputs, expected_grad, _ = run(plain)
    assert len(casts) == 1  # one bf16 copy of x, held once for the three backwards
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected_outputs))
    assert torch.equal(grad, expected_grad)  # each layer's gradient in float32, summed as autograd sums them


def test_a_tensor_changed_in_place_is_cast_again():
    _, layer = pair(8, 8, False, 0)
    x = torch.randn(4, 8)
    with autocast():
        first = layer(x)
        x.mul_(2)  # the same tensor at a new version: the cast the first call made is stale
        second = layer(x)
        expected = torch.nn.functional.linear(x, layer.weight)
    assert second.grad_fn.name() == "AutocastLinearBackward"
    assert torch.equal(second, expected) and not torch.equal(second, first)


@pytest.mark.parametrize("case", ["float32", "no gradient", "frozen", "bf16 weight", "leaf input"])
def test_anything_but_a_differentiated_bf16_autocast_runs_the_layers_own_forward(case):
    _, layer = pair(8, 16, True, 0)
    x = torch.randn(3, 8, requires_grad=case == "leaf input")
    if case == "frozen":
        layer.requires_grad_(False)
    if case == "bf16 weight":
        layer.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case != "float32"):
        with torch.set_grad_enabled(case != "no gradient"):
            output = layer(x)
    assert output.grad_fn is None or output.grad_fn.name() != "AutocastLinearBackward"


def test_every_linear_but_the_output_layer_changes_once():
    model = tiny_llama()
    layers = model.config.num_hidden_layers
    assert cpu_linears(model) == 7 * layers and cpu_linears(model) == 0  # q, k, v, o, gate, up, down
    assert type(model.lm_head) is torch.nn.Linear


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")  # the floor lacks the new name
def test_a_checkpointed_model_computes_the_same_loss_and_gradients_within_rounding():
    plain, converted = tiny_llama(), tiny_llama()
    cpu_linears(converted)
    for model in (plain, converted):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    (expected, expected_grads), (loss, grads) = (loss_and_gradients(model, bf16_autocast=True, tokens=24)
                                                 for model in (plain, converted))
    assert torch.equal(loss, expected)  # the forward is autocast's, bit for bit
    for name, grad in expected_grads.items():  # weight gradients' bf16 rounding, carried down the layers
        assert (grads[name] - grad).norm() <= 1e-2 * grad.norm() + 1e-7, name


def test_a_dpo_run_trains_its_policy_through_it_and_its_margin_grows(tmp_path, monkeypatch):
    from datasets import Dataset

    from plait.plugins.methods.dpo import DPOConfig, DPOTrainer

    calls = []
    apply = AutocastLinear.apply
    monkeypatch.setattr(AutocastLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    colours = ["red", "green", "blue", "amber", "violet", "grey", "white", "black"]
    pairs = [{"prompt": f"Which colour is {c}?", "chosen": f" {c.title()}, plainly.", "rejected": " No idea."}
             for c in colours]
    trainer = DPOTrainer(str(tiny_model_path()), train_dataset=Dataset.from_list(pairs), args=DPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=6, learning_rate=1e-3, bf16=True,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no"))
    trainer.train()
    layers = trainer.model.config.num_hidden_layers
    # each step: six of the policy's linears a layer in the forward and the checkpoint's recompute (the output
    # projection, fed bf16 with a weight gradient autograd's, keeps nn.Linear's forward); the frozen reference
    # runs without gradients, through nn.Linear's own forward
    assert len(calls) == 6 * 2 * 6 * layers
    first, last = trainer.state.log_history[0], trainer.state.log_history[-2]
    assert last["rewards/margins"] > first["rewards/margins"] + 0.05, (first, last)


@pytest.mark.parametrize("widths, tokens, dtype, takes, row_major", [
    ((576, 1536), MIN_TOKENS, torch.float32, True, True),  # an MLP's gate: its cast shared, dWᵀ from xᵀ
    ((1536, 576), MIN_TOKENS, torch.bfloat16, True, True),  # its down projection: dW from dyᵀ
    ((576, 192), MIN_TOKENS, torch.float32, True, False),  # a key projection: its cast shared, autograd's GEMM
    ((576, 576), MIN_TOKENS, torch.bfloat16, False, False),  # an output projection: nothing to gain
    ((576, 1536), MIN_TOKENS // 2, torch.float32, False, True),  # a small batch: nn.Linear's forward
], ids=["gate", "down", "key", "output projection", "small batch"])
def test_the_sizes_from_which_it_pays(monkeypatch, widths, tokens, dtype, takes, row_major):
    monkeypatch.setattr(cpu_linear, "MIN_TOKENS", MIN_TOKENS)
    monkeypatch.setattr(cpu_linear, "MIN_WIDTH", MIN_WIDTH)
    layer = torch.nn.Linear(*widths, bias=False)
    cpu_linears(layer)
    x = torch.randn(tokens, widths[0]).to(dtype)
    output, _ = forward_and_gradients(layer, x, torch.ones(tokens, widths[1]).bfloat16())
    assert (output.grad_fn.name() == "AutocastLinearBackward") == takes
    assert (cpu_linear._row_major_side(*widths) is not None) == row_major
