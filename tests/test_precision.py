"""Precision from the hardware: bf16 autocast where the device computes bf16 natively, fp32
otherwise, an explicit choice always respected, and SFT/DPO learn under each."""

import logging
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from plait.engine.config import _warn_emulated_once, cpu_bf16_support
from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
from plait.plugins.methods.sft import SFTConfig, SFTTrainer
from plait.testing.tiny_model import tiny_model_path

WORDS = ["apple", "river", "stone", "cloud", "music", "garden", "window", "paper"]
COMMON = dict(save_strategy="no", report_to="none", seed=0, max_length=64, logging_steps=1)


def cpu_flags() -> set[str]:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return set(next(line for line in lines if line.startswith("flags")).split())


def native_bf16_here() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_bf16_support()[0]


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux /proc/cpuinfo")
def test_cpu_detection_agrees_with_proc_cpuinfo_and_torch():
    native, reason = cpu_bf16_support()
    units = {"avx512_bf16", "amx_bf16"} & cpu_flags()
    assert native == (bool(units) and torch.backends.cpu.get_cpu_capability().startswith("AVX512")), reason
    # torch's own cpuinfo probe reads the CPUID bits /proc/cpuinfo reports
    assert torch.cpu._is_avx512_bf16_supported() == ("avx512_bf16" in cpu_flags())
    assert all(unit in reason for unit in units)


def test_default_config_picks_bf16_exactly_where_the_hardware_computes_it(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="plait"):
        args = DPOConfig(output_dir=str(tmp_path), report_to="none")
    assert args.bf16 is native_bf16_here()
    assert args.mixed_precision == ("bf16" if args.bf16 else "no")
    if args.bf16 and not torch.accelerator.is_available():
        assert args.use_cpu  # else transformers refuses bf16 without a GPU
    logged = [r.getMessage() for r in caplog.records if "bf16 autocast" in r.getMessage() or "fp32" in r.getMessage()]
    assert len(logged) <= 1 and all(("bf16 autocast" if args.bf16 else "fp32") in m for m in logged)


@pytest.mark.parametrize("bf16", [False, True])
def test_an_explicit_choice_is_respected_and_emulated_bf16_is_flagged(tmp_path, bf16, caplog):
    _warn_emulated_once.cache_clear()  # said once per process; an earlier test may have said it
    with caplog.at_level(logging.WARNING, logger="plait"):
        args = SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=bf16)
    assert args.bf16 is bf16 and args.mixed_precision == ("bf16" if bf16 else "no")
    emulated = bf16 and not torch.accelerator.is_available() and not cpu_bf16_support()[0]
    assert any("emulated" in r.getMessage() for r in caplog.records) == emulated


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _trainers(tmp_path, precision: dict):
    sft = SFTTrainer(
        str(tiny_model_path()),
        args=SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=4, max_steps=8,
                       learning_rate=3e-3, **COMMON, **precision),
        train_dataset=Dataset.from_list([{"prompt": "The secret code is", "completion": " seven blue horses."}] * 8),
    )
    dpo = DPOTrainer(
        str(tiny_model_path()),
        args=DPOConfig(output_dir=str(tmp_path / "dpo"), per_device_train_batch_size=8, max_steps=8,
                       learning_rate=1e-3, beta=0.1, **COMMON, **precision),
        train_dataset=_pairs(),
    )
    return sft, dpo


def _pairs() -> Dataset:
    return Dataset.from_list([{"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.",
                               "rejected": f" The {w} is bad."} for w in WORDS])


@pytest.mark.parametrize("choice", ["default", "the other one"])
def test_sft_and_dpo_learn_under_each_precision(tmp_path, choice):
    # the default and, asked for explicitly, the precision the default did not pick: both run here
    precision = {} if choice == "default" else {"bf16": not native_bf16_here()}
    sft, dpo = _trainers(tmp_path, precision)
    expected = precision.get("bf16", native_bf16_here())
    for trainer in (sft, dpo):
        assert trainer.args.bf16 is expected
        trainer.train()
        # the precision asked for is the one the step ran under (accelerate autocasts the forward)
        assert trainer.accelerator.mixed_precision == ("bf16" if expected else "no")
        assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    sft_losses, dpo_losses = _losses(sft), _losses(dpo)
    assert all(torch.isfinite(torch.tensor(sft_losses + dpo_losses)))
    assert sft_losses[-1] < 0.85 * sft_losses[0], sft_losses
    first, last = dpo.state.log_history[0], dpo.state.log_history[-2]
    assert last["rewards/margins"] > first["rewards/margins"] + 0.05, (first, last)


# -- checkpoints stored in half precision (most hub models) train as float32 master weights -----------


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    """The tiny model as most hub checkpoints are stored: ``"dtype": "bfloat16"`` in config.json."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("bf16-checkpoint")
    shutil.copytree(tiny_model_path(), folder, dirs_exist_ok=True)
    AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    return folder


def test_a_bf16_checkpoint_loads_as_float32_unless_a_dtype_is_asked_for(bf16_checkpoint):
    from plait.engine.models import load_model
    from plait.errors import PlaitError

    def dtypes(**init) -> set[torch.dtype]:
        return {p.dtype for p in load_model(str(bf16_checkpoint), init or None).parameters()}

    assert dtypes() == {torch.float32}  # TRL's default: float32 master weights
    assert dtypes(dtype="auto") == {torch.bfloat16}  # as stored
    assert dtypes(dtype="bfloat16") == dtypes(torch_dtype="bfloat16") == {torch.bfloat16}  # TRL-era scripts' name too
    assert {p.dtype for p in load_model(str(bf16_checkpoint), default_dtype="auto").parameters()} == {torch.bfloat16}
    with pytest.raises(PlaitError, match=r"dtype='bf16' is not a torch dtype; use 'float32'"):
        dtypes(dtype="bf16")


def test_sft_on_a_bf16_checkpoint_changes_every_weight_and_pure_bf16_says_why_it_would_not(
        tmp_path, bf16_checkpoint, caplog):
    """At a fine-tuning learning rate, AdamW's updates fall below bf16's resolution: trained as stored,
    tensors come out unchanged (and plait warns); trained as plait loads it, every one moves."""
    from safetensors.torch import load_file

    rows = Dataset.from_list([{"prompt": f"Say {w}.", "completion": f" {w}"} for w in WORDS])
    initial = load_file(bf16_checkpoint / "model.safetensors")

    def unchanged_after_training(name: str, **init) -> list[str]:
        args = SFTConfig(output_dir=str(tmp_path / name), max_steps=3, learning_rate=2e-5, per_device_train_batch_size=4,
                         bf16=False, model_init_kwargs=init or None, **COMMON)
        trainer = SFTTrainer(str(bf16_checkpoint), args=args, train_dataset=rows)
        trainer.train()
        trained = {n: p.detach() for n, p in trainer.model.named_parameters()}
        return [n for n, p in trained.items() if torch.equal(p.float(), initial[n].float())]

    with caplog.at_level(logging.WARNING, logger="plait"):
        assert unchanged_after_training("default") == []
    assert "trainable weight tensors are" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="plait"):
        lost = unchanged_after_training("pure-bf16", dtype="bfloat16")
    assert lost, "pure bf16 weights at lr 2e-5 should lose some updates (what this test guards against)"
    assert f"{len(initial)} of {len(initial)} trainable weight tensors are bfloat16" in caplog.text


# -- under autocast the rotary tables come in the autocast's dtype (plait.engine.autocast) ---------------


def test_rotary_tables_follow_autocast_and_change_nothing_without_it():
    from transformers import AutoModelForCausalLM

    from plait.engine.autocast import rotary_in_compute_dtype

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    hooked = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    assert rotary_in_compute_dtype(hooked) == 1 and rotary_in_compute_dtype(hooked) == 0  # once per model
    rotary = hooked.model.rotary_emb
    x, positions = torch.randn(1, 5, hooked.config.hidden_size), torch.arange(5)[None]
    ids = torch.randint(0, hooked.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert all(t.dtype == torch.float32 for t in rotary(x, positions))
        assert torch.equal(plain(input_ids=ids).logits, hooked(input_ids=ids).logits)  # no autocast: the same numbers
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert all(t.dtype == torch.bfloat16 for t in rotary(x, positions))
            ours, theirs = hooked(input_ids=ids).logits.float(), plain(input_ids=ids).logits.float()
    # bf16 rounding of the rotation alone: far below a logit's scale, and not nothing (the hook acted)
    assert 0 < (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


def test_a_trainer_gives_its_models_rotary_tables_in_the_compute_dtype(tmp_path):
    sft, dpo = _trainers(tmp_path, {})
    for trainer in (sft, dpo):
        for model in (trainer.model, *trainer.held_models()):
            rotaries = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
            assert rotaries and all(m._plait_compute_dtype for m in rotaries)


# -- a frozen reference under autocast holds its linear layers in the compute dtype (plait.engine.autocast) --


def _linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_frozen_linears_stored_in_bf16_give_the_same_products_under_autocast_at_half_the_bytes():
    from transformers import AutoModelForCausalLM

    from plait.engine.autocast import frozen_linears_in_compute_dtype

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path()).requires_grad_(False)
    stored = AutoModelForCausalLM.from_pretrained(tiny_model_path()).requires_grad_(False)
    output = stored.get_output_embeddings()
    assert frozen_linears_in_compute_dtype(stored, torch.bfloat16) == len(_linears(stored)) - 1  # all but the output
    assert all(m.weight.dtype == torch.bfloat16 for m in _linears(stored) if m is not output)
    assert output.weight.dtype == torch.float32 and output.weight is stored.get_input_embeddings().weight  # tied
    assert frozen_linears_in_compute_dtype(stored, torch.bfloat16) == 0  # once
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(plain(input_ids=ids).logits, stored(input_ids=ids).logits)  # bit for bit
    size = lambda model: sum(p.numel() * p.element_size() for p in model.parameters())  # noqa: E731
    linear_bytes = sum(m.weight.numel() * 4 for m in _linears(plain) if m is not plain.get_output_embeddings())
    assert size(plain) - size(stored) == linear_bytes // 2


def test_only_frozen_unshared_float32_linears_change():
    from plait.engine.autocast import frozen_linears_in_compute_dtype

    frozen, trained, shared = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    frozen.requires_grad_(False)
    shared.requires_grad_(False)
    other = torch.nn.Module()
    other.weight = shared.weight  # held by a second module (as a tied embedding is)
    model = torch.nn.ModuleDict({"frozen": frozen, "trained": trained, "shared": shared, "other": other})
    assert frozen_linears_in_compute_dtype(model, torch.bfloat16) == 1
    assert [m.weight.dtype for m in (frozen, trained, shared)] == [torch.bfloat16, torch.float32, torch.float32]


def _dpo(tmp_path, name: str, ref_model=None, **fields) -> DPOTrainer:
    return DPOTrainer(str(tiny_model_path()), ref_model=ref_model, train_dataset=_pairs(),
                      args=DPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8, max_steps=1,
                                     **COMMON, **fields))


def test_a_bf16_runs_own_reference_holds_bf16_linears_and_scores_exactly_as_its_float32_copy(tmp_path):
    import copy

    trainer = _dpo(tmp_path, "bf16", bf16=True)
    reference, policy = trainer.ref_model, trainer.model
    output = reference.get_output_embeddings()
    assert all(m.weight.dtype == torch.bfloat16 for m in _linears(reference) if m is not output)
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # the policy trains float32 weights
    # untrained, the policy holds the reference's weights: a float32 copy prepared as the reference is (its
    # forward in accelerate's autocast, as every reference forward runs) scores the same bit for bit
    float32_copy = trainer.accelerator.prepare_model(copy.deepcopy(policy).eval().requires_grad_(False),
                                                     evaluation_mode=True)
    assert all(p.dtype == torch.float32 for p in float32_copy.parameters())
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        ours = trainer.completion_logps(reference, batch)[0]
        theirs = trainer.completion_logps(float32_copy, batch)[0]
        unprepared = trainer.completion_logps(copy.deepcopy(policy).eval(), batch)[0]  # float32 compute, no autocast
    assert torch.equal(ours, theirs), (ours, theirs)
    assert not torch.equal(ours, unprepared)  # autocast acted: the comparison could fail


def test_a_reference_stays_float32_without_autocast_when_the_user_gave_it_or_when_synced(tmp_path):
    from transformers import AutoModelForCausalLM

    given = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    trainers = {"fp32": _dpo(tmp_path, "fp32", bf16=False), "given": _dpo(tmp_path, "given", bf16=True, ref_model=given),
                "synced": _dpo(tmp_path, "synced", bf16=True, sync_ref_model=True)}
    for name, trainer in trainers.items():
        assert all(p.dtype == torch.float32 for p in trainer.ref_model.parameters()), name
    assert trainers["given"].ref_model is given
