"""Gradient checkpointing combines with the chunked log-prob path: the same losses and updates as
without it, and the output layer is not run more often (the decoder layers are recomputed in
backward; the head, applied chunk by chunk after the model's forward, is recomputed once per chunk
either way). Default on for every method, as in TRL."""

import pytest
import torch
from datasets import Dataset
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig

from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
from plait.plugins.methods.sft import SFTConfig, SFTTrainer
from plait.testing.tiny_model import tiny_model_path

COMMON = dict(save_strategy="no", report_to="none", seed=0, max_length=64, logging_steps=1, max_steps=2,
              bf16=False, learning_rate=1e-3)
WORDS = ["apple", "river", "stone", "cloud"]


def sft(tmp_path, checkpointing: bool) -> SFTTrainer:
    rows = [{"prompt": f"The {w} is", "completion": f" a {w} of seven blue horses."} for w in WORDS]
    return SFTTrainer(str(tiny_model_path()), train_dataset=Dataset.from_list(rows),
                      args=SFTConfig(output_dir=str(tmp_path / f"sft{checkpointing}"), per_device_train_batch_size=4,
                                     gradient_checkpointing=checkpointing, **COMMON))


def dpo(tmp_path, checkpointing: bool) -> DPOTrainer:
    rows = [{"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.", "rejected": f" The {w} is bad."}
            for w in WORDS]
    return DPOTrainer(str(tiny_model_path()), train_dataset=Dataset.from_list(rows),
                      args=DPOConfig(output_dir=str(tmp_path / f"dpo{checkpointing}"), per_device_train_batch_size=4,
                                     gradient_checkpointing=checkpointing, **COMMON))


def train_counting_head_calls(trainer) -> tuple[list[float], dict[str, torch.Tensor], int]:
    calls = []
    head = trainer.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        trainer.train()
    finally:
        handle.remove()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, len(calls)


@pytest.mark.parametrize("build", [sft, dpo], ids=["sft", "dpo"])
def test_checkpointing_changes_neither_losses_updates_nor_head_calls(tmp_path, build):
    off, on = build(tmp_path, False), build(tmp_path, True)
    assert not off.args.gradient_checkpointing and on.args.gradient_checkpointing
    losses_off, weights_off, head_off = train_counting_head_calls(off)
    losses_on, weights_on, head_on = train_counting_head_calls(on)
    assert on.model.is_gradient_checkpointing and not off.model.is_gradient_checkpointing
    assert losses_on == pytest.approx(losses_off, abs=1e-6)
    assert max((weights_on[k] - weights_off[k]).abs().max().item() for k in weights_off) < 1e-6
    assert head_on == head_off > 0  # checkpointing recomputes layers, not the chunked head


def test_default_is_on_for_every_method(tmp_path):
    """TRL's default, and plait's since it was measured to pay (benchmarks/gradient_checkpointing.py)."""
    from plait.manager import default_plugins

    methods = default_plugins().methods
    for name in methods.names():
        args = methods.get(name).obj.config(output_dir=str(tmp_path), report_to="none")
        assert args.gradient_checkpointing is True, name


def test_either_name_turns_it_off_on_every_transformers_version_and_warns_nothing(tmp_path):
    """transformers 5.19 knows only ``gradient_checkpointing``, 5.20+ calls it ``activation_checkpointing``
    (the old name deprecated): plait's configs take both names on both (plait.data.versions), silently."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on = SFTConfig(output_dir=str(tmp_path), report_to="none")
        off_new = SFTConfig(output_dir=str(tmp_path), report_to="none", activation_checkpointing=False)
        off_old = SFTConfig(output_dir=str(tmp_path), report_to="none", gradient_checkpointing=False)
        both = SFTConfig(output_dir=str(tmp_path), report_to="none", gradient_checkpointing=False,
                         activation_checkpointing=True)  # the new name wins, as transformers decides
    assert (on.gradient_checkpointing, on.activation_checkpointing) == (True, True)
    assert (off_new.gradient_checkpointing, off_new.activation_checkpointing) == (False, False)
    assert (off_old.gradient_checkpointing, off_old.activation_checkpointing) == (False, False)
    assert (both.gradient_checkpointing, both.activation_checkpointing) == (True, True)
    assert on.gradient_checkpointing_kwargs is on.activation_checkpointing_kwargs  # the recompute's context_fn in both
    assert "context_fn" in on.gradient_checkpointing_kwargs


# -- the recompute keeps attention's output (plait.engine.checkpointing) --------------------------------------------
def attention_kernel_calls_and_grads(context_fn) -> tuple[int, dict[str, torch.Tensor]]:
    """One forward and backward of the tiny model with every layer checkpointed under ``context_fn``
    (None: no checkpointing): how often a fused attention kernel ran, and the gradients."""
    from transformers import AutoModelForCausalLM

    from plait.data.versions import enable_checkpointing
    from plait.engine.checkpointing import ATTENTION_KERNELS
    from plait.engine.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), attn_implementation="sdpa").train()
    if context_fn is not None:
        enable_checkpointing(model, {"use_reentrant": False, "context_fn": context_fn})
    ids = torch.randint(5, 900, (3, 24), generator=torch.Generator().manual_seed(0))
    calls = []

    class CountKernels(TorchDispatchMode):
        # beneath selective checkpointing's own mode, so only the kernel runs that really happen count
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.extend([func] if func in ATTENTION_KERNELS else [])
            return func(*args, **(kwargs or {}))

    with CountKernels():
        token_logprobs(model, ids).logps.sum().backward()
    calls = len(calls)
    return calls, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_recompute_reuses_attention_and_the_gradients_are_unchanged():
    from torch.utils.checkpoint import noop_context_fn

    from plait.engine.checkpointing import keep_attention

    layers = AutoConfig.from_pretrained(str(tiny_model_path())).num_hidden_layers
    plain_calls, plain = attention_kernel_calls_and_grads(None)
    full_calls, _ = attention_kernel_calls_and_grads(noop_context_fn)
    kept_calls, kept = attention_kernel_calls_and_grads(keep_attention)
    assert plain_calls == layers and full_calls == 2 * layers  # a fused kernel ran; plain recompute runs it again
    assert kept_calls == layers
    assert max((kept[k] - plain[k]).abs().max().item() for k in plain) < 1e-6


def test_default_kwargs_keep_attention_and_the_users_choice_stands(tmp_path):
    from torch.utils.checkpoint import noop_context_fn

    from plait.engine.checkpointing import keep_attention
    from plait.errors import PlaitError

    config = lambda **kw: SFTConfig(output_dir=str(tmp_path), report_to="none", **kw)  # noqa: E731
    default = config()
    assert default.activation_checkpointing_kwargs == {"use_reentrant": False, "context_fn": keep_attention}
    assert default.gradient_checkpointing_kwargs is default.activation_checkpointing_kwargs
    assert default.to_dict()["activation_checkpointing_kwargs"]["context_fn"] == "plait.engine.checkpointing:keep_attention"
    # the logged form builds the same run (a recipe names functions by import path)
    again = config(activation_checkpointing_kwargs=default.to_dict()["activation_checkpointing_kwargs"])
    assert again.activation_checkpointing_kwargs["context_fn"] is keep_attention
    mine = config(activation_checkpointing_kwargs={"context_fn": "torch.utils.checkpoint:noop_context_fn", "every_n_layers": 2})
    assert mine.activation_checkpointing_kwargs == {"context_fn": noop_context_fn, "every_n_layers": 2, "use_reentrant": False}
    assert config(activation_checkpointing_kwargs={"use_reentrant": True}).activation_checkpointing_kwargs == {"use_reentrant": True}
    assert config(activation_checkpointing=False).activation_checkpointing_kwargs is None
    with pytest.raises(PlaitError, match="context_fn needs use_reentrant=False"):
        config(activation_checkpointing_kwargs={"use_reentrant": True, "context_fn": noop_context_fn})
    with pytest.raises(PlaitError, match="context_fn=3 is not callable"):
        config(activation_checkpointing_kwargs={"context_fn": 3})


def bf16_layer_gradients(context_fn, second_backward: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
    """A bf16-autocast forward and backward of the tiny model on plait_sdpa (attention differentiated by plait's
    CausalAttention) with every layer checkpointed under ``context_fn``: attention forwards run, and the gradients."""
    from transformers import AutoModelForCausalLM

    from plait.data.versions import enable_checkpointing
    from plait.engine import causal_attention
    from plait.engine.attention import packs_per_sequence
    from plait.engine.autocast import rotary_in_compute_dtype

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), attn_implementation="sdpa").train()
    assert packs_per_sequence(model)  # on plait_sdpa, as a run puts it
    rotary_in_compute_dtype(model)  # so queries stay bf16, as in a run
    enable_checkpointing(model, {"use_reentrant": False, "context_fn": context_fn})
    ids = torch.randint(5, 900, (3, 24), generator=torch.Generator().manual_seed(0))
    forwards = []
    with pytest.MonkeyPatch.context() as patch, torch.autocast("cpu", dtype=torch.bfloat16):
        apply = causal_attention.CausalAttention.apply

        def counting(query, key, value, scale, attend):
            return apply(query, key, value, scale, lambda *qkv: forwards.append(1) or attend(*qkv))

        patch.setattr(causal_attention.CausalAttention, "apply", counting)
        loss = model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
        loss.backward(retain_graph=second_backward)
        if second_backward:
            loss.backward()
    return len(forwards), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_under_cpu_autocast_attention_keeps_its_own_outputs_with_the_same_gradients():
    """keep_attention under bf16 autocast on a CPU: CausalAttention keeps its outputs for the recompute (no
    dispatch mode), so attention runs once a layer, and every gradient is the dispatch mode's bit for bit."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts, noop_context_fn

    from plait.engine.checkpointing import _save_attention, keep_attention

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not any(isinstance(context, TorchDispatchMode) for context in keep_attention())
    assert all(isinstance(context, TorchDispatchMode) for context in keep_attention())  # float32: torch's
    layers = AutoConfig.from_pretrained(str(tiny_model_path())).num_hidden_layers
    kept_forwards, kept = bf16_layer_gradients(keep_attention)
    sac_forwards, sac = bf16_layer_gradients(lambda: create_selective_checkpoint_contexts(_save_attention))
    full_forwards, full = bf16_layer_gradients(noop_context_fn)
    assert kept_forwards == layers and full_forwards == 2 * layers
    assert sac_forwards == 2 * layers  # the Function's attend runs; torch's mode hands back the kernel's output
    for name, grad in full.items():
        assert torch.equal(kept[name], grad) and torch.equal(sac[name], grad), name


def test_a_retained_graphs_second_backward_computes_attention_afresh():
    from torch.utils.checkpoint import noop_context_fn

    from plait.engine.checkpointing import keep_attention

    layers = AutoConfig.from_pretrained(str(tiny_model_path())).num_hidden_layers
    kept_forwards, kept = bf16_layer_gradients(keep_attention, second_backward=True)
    _, full = bf16_layer_gradients(noop_context_fn, second_backward=True)
    assert kept_forwards == 2 * layers  # the forward's, then the second recompute's (the first reused them)
    for name, grad in full.items():
        assert torch.equal(kept[name], grad), name
