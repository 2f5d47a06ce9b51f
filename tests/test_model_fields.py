"""The model-loading fields every method's Config has, with TRL 1.16's meanings: trust_remote_code,
pad_token, eos_token, chat_template_path, disable_dropout, router_aux_loss_coef, activation_offloading.

Each is shown by what it changes on the tiny model: the class a folder's own code defines, the pad id
in a collated batch, the token a completion ends with, the rendered prompt, the dropout probability
in the policy and the reference, the loss of a tiny Mixture-of-Experts model.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

from plait import PlaitError
from plait.plugins.methods.distill import DistillConfig
from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
from plait.plugins.methods.grpo import GRPOConfig
from plait.plugins.methods.kto import KTOConfig
from plait.plugins.methods.ppo import PPOConfig
from plait.plugins.methods.reward_model import RewardConfig
from plait.plugins.methods.rloo import RLOOConfig
from plait.plugins.methods.sft import SFTConfig, SFTTrainer
from plait.testing.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
PLAIT = Path(sys.executable).parent / "plait"
OTHER_SPECIAL = "<|endoftext|>"  # a special token of the tiny vocabulary that is neither its EOS nor its pad

PAIRS = Dataset.from_list([{"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.",
                            "rejected": f" The {w} is bad."} for w in ("apple", "river", "stone", "cloud")])
FACTS = Dataset.from_list([{"prompt": "The sky is", "completion": " blue."},
                           {"prompt": "Seven plus five is", "completion": " twelve, as every child learns."}])


def args(config_cls, tmp_path, **values):
    return config_cls(output_dir=str(tmp_path / "out"), report_to="none", max_length=64, **values)


def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory) -> str:
    """A tiny GPT-2 (nn.Dropout with p = 0.1 in every block) with the tiny tokenizer."""
    folder = tmp_path_factory.mktemp("gpt2-dropout")
    tok = tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=128,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def dropout_ps(model: torch.nn.Module) -> set[float]:
    return {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}


# -- defaults: TRL 1.16's for each config ------------------------------------------------------


def test_defaults_follow_trl_per_config(tmp_path):
    disable = {SFTConfig: False, DPOConfig: True, KTOConfig: True, RewardConfig: True, GRPOConfig: False,
               RLOOConfig: False, DistillConfig: False, PPOConfig: True}
    aux = {SFTConfig: None, DPOConfig: None, KTOConfig: None, GRPOConfig: None, RLOOConfig: None,
           RewardConfig: 0.0, DistillConfig: 0.0, PPOConfig: 0.0}  # 0 where TRL's config has no such field
    for config_cls, expected in disable.items():
        fields = {f.name: f.default for f in config_cls.__dataclass_fields__.values()}
        assert fields["disable_dropout"] is expected, config_cls.__name__
        assert fields["router_aux_loss_coef"] == aux[config_cls], config_cls.__name__
        assert (fields["trust_remote_code"], fields["activation_offloading"]) == (False, False)
        assert (fields["pad_token"], fields["eos_token"], fields["chat_template_path"]) == (None, None, None)


def test_bad_values_are_refused_naming_the_field(tmp_path):
    with pytest.raises(PlaitError, match=r"router_aux_loss_coef=-0.1 must be a number >= 0"):
        args(SFTConfig, tmp_path, router_aux_loss_coef=-0.1)
    with pytest.raises(PlaitError, match=r"pad_token='' must be a non-empty string"):
        args(DPOConfig, tmp_path, pad_token="")
    with pytest.raises(PlaitError, match=r"chat_template_path='/nonexistent.jinja' does not exist"):
        GRPOConfig(output_dir=str(tmp_path), chat_template_path="/nonexistent.jinja")


# -- disable_dropout ---------------------------------------------------------------------------


def test_dpo_disables_dropout_in_policy_and_reference_by_default(tmp_path, dropout_model):
    trainer = DPOTrainer(dropout_model, args=args(DPOConfig, tmp_path), train_dataset=PAIRS)
    assert trainer.reference.model is not None
    assert dropout_ps(trainer.model) == dropout_ps(trainer.reference.model) == {0.0}


def test_dropout_stays_when_disable_dropout_is_false(tmp_path, dropout_model):
    trainer = DPOTrainer(dropout_model, args=args(DPOConfig, tmp_path, disable_dropout=False), train_dataset=PAIRS)
    assert dropout_ps(trainer.model) == dropout_ps(trainer.reference.model) == {0.1}
    sft = SFTTrainer(dropout_model, args=args(SFTConfig, tmp_path), train_dataset=FACTS)  # TRL's SFT keeps dropout
    assert dropout_ps(sft.model) == {0.1}


def test_disable_dropout_reaches_a_given_reference_and_lora_dropout(tmp_path, dropout_model):
    from peft import LoraConfig

    from plait.engine.models import load_model

    ref = load_model(dropout_model)
    trainer = DPOTrainer(dropout_model, ref_model=ref, args=args(DPOConfig, tmp_path),
                         train_dataset=PAIRS)
    assert trainer.reference.model is ref and dropout_ps(ref) == {0.0}
    lora = LoraConfig(r=4, lora_dropout=0.3, target_modules=["c_attn"])
    sft = SFTTrainer(dropout_model, args=args(SFTConfig, tmp_path, disable_dropout=True), train_dataset=FACTS,
                     peft_config=lora)
    assert dropout_ps(sft.model) == {0.0}  # the base model's and the adapters' alike


# -- pad_token, eos_token ------------------------------------------------------------------------


def test_pad_token_sets_the_collated_pad_id(tmp_path):
    tok = tokenizer()
    for pad_token, expected in ((None, tok.pad_token_id), (OTHER_SPECIAL, tok.convert_tokens_to_ids(OTHER_SPECIAL))):
        trainer = SFTTrainer(str(tiny_model_path()), args=args(SFTConfig, tmp_path, pad_token=pad_token),
                             train_dataset=FACTS)
        rows = [trainer.train_dataset[i] for i in range(2)]
        short = min(range(2), key=lambda i: len(rows[i]["input_ids"]))
        batch = trainer.data_collator(rows)
        width = len(rows[short]["input_ids"])
        assert batch["input_ids"][short, width:].unique().tolist() == [expected]
        assert trainer.model.config.pad_token_id == trainer.model.generation_config.pad_token_id == expected


def test_eos_token_ends_every_completion_and_stops_generation(tmp_path):
    tok = tokenizer()
    new_eos = tok.convert_tokens_to_ids(OTHER_SPECIAL)
    trainer = SFTTrainer(str(tiny_model_path()), args=args(SFTConfig, tmp_path, eos_token=OTHER_SPECIAL),
                         train_dataset=FACTS)
    for row in trainer.train_dataset:
        assert row["input_ids"][-1] == new_eos and tok.eos_token_id not in row["input_ids"]
    assert trainer.model.config.eos_token_id == new_eos
    assert trainer.model.generation_config.eos_token_id == [new_eos, tok.eos_token_id]


@pytest.mark.parametrize("field", ["pad_token", "eos_token"])
def test_a_token_outside_the_vocabulary_is_refused_naming_the_field(tmp_path, field):
    with pytest.raises(PlaitError, match=rf"{field}='<\|nope\|>' is not a token of the tokenizer's vocabulary"):
        SFTTrainer(str(tiny_model_path()), args=args(SFTConfig, tmp_path, **{field: "<|nope|>"}), train_dataset=FACTS)


# -- chat_template_path ------------------------------------------------------------------------

BRACKETS = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
CONVERSATION = Dataset.from_list([{"prompt": [{"role": "user", "content": "The sky is"}],
                                   "completion": [{"role": "assistant", "content": "blue."}]}])


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory) -> str:
    """The tiny model with its chat template removed."""
    folder = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(tiny_model_path(), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(folder).chat_template is None
    return str(folder)


def test_chat_template_file_replaces_the_template_in_the_rendered_prompt(tmp_path):
    path = tmp_path / "brackets.jinja"
    path.write_text(BRACKETS)
    default = SFTTrainer(str(tiny_model_path()), args=args(SFTConfig, tmp_path), train_dataset=CONVERSATION)
    trainer = SFTTrainer(str(tiny_model_path()), args=args(SFTConfig, tmp_path, chat_template_path=str(path)),
                         train_dataset=CONVERSATION)
    tok = trainer.processing_class
    assert tok.chat_template == BRACKETS
    assert tok.decode(trainer.train_dataset[0]["input_ids"]) == "[user] The sky is\n[assistant] blue.\n"
    assert tok.decode(default.train_dataset[0]["input_ids"]).startswith("<|im_start|>user\nThe sky is<|im_end|>")


def test_a_tokenizer_without_template_gets_one_as_the_error_message_says(tmp_path, no_template_model):
    with pytest.raises(PlaitError, match="no chat template; set chat_template_path"):
        SFTTrainer(no_template_model, args=args(SFTConfig, tmp_path), train_dataset=CONVERSATION)
    trainer = SFTTrainer(no_template_model, args=args(SFTConfig, tmp_path, chat_template_path=str(tiny_model_path())),
                         train_dataset=CONVERSATION)  # a tokenizer folder whose template it takes
    assert trainer.processing_class.chat_template == tokenizer().chat_template
    assert len(trainer.processing_class) == len(tokenizer())  # the template only: vocabulary and embeddings stay
    assert trainer.model.get_input_embeddings().num_embeddings == len(tokenizer())
    assert trainer.processing_class.decode(trainer.train_dataset[0]["input_ids"]).startswith("<|im_start|>user\n")


# -- trust_remote_code -------------------------------------------------------------------------

CUSTOM_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


class CustomConfig(LlamaConfig):
    model_type = "plait_custom"


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
'''


@pytest.fixture(scope="module")
def custom_code_model(tmp_path_factory) -> str:
    """The tiny model as a folder whose config, model and tokenizer classes are its own code (auto_map)."""
    folder = tmp_path_factory.mktemp("custom-code") / "model"
    shutil.copytree(tiny_model_path(), folder)
    (folder / "custom_code.py").write_text(CUSTOM_CODE)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="plait_custom", architectures=["CustomForCausalLM"],
                  auto_map={"AutoConfig": "custom_code.CustomConfig",
                            "AutoModelForCausalLM": "custom_code.CustomForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.update(tokenizer_class="CustomTokenizer",
                            auto_map={"AutoTokenizer": [None, "custom_code.CustomTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(folder)


def test_trust_remote_code_loads_the_folders_own_classes(tmp_path, custom_code_model):
    with pytest.raises(PlaitError, match="set trust_remote_code=True if you trust the code its auto_map names"):
        SFTTrainer(custom_code_model, args=args(SFTConfig, tmp_path), train_dataset=FACTS)
    trainer = DPOTrainer(str(tiny_model_path()), ref_model=custom_code_model, train_dataset=PAIRS,
                         processing_class=tokenizer(), args=args(DPOConfig, tmp_path, trust_remote_code=True))
    assert type(trainer.reference.model).__name__ == "CustomForCausalLM"
    trainer = SFTTrainer(custom_code_model, args=args(SFTConfig, tmp_path, trust_remote_code=True), train_dataset=FACTS)
    assert (type(trainer.model).__name__, type(trainer.processing_class).__name__) == ("CustomForCausalLM", "CustomTokenizer")


# -- router_aux_loss_coef ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    """A tiny Mixtral (4 experts, 2 per token) whose config weighs its load-balancing loss 0.02."""
    folder = tmp_path_factory.mktemp("tiny-moe")
    tok = tokenizer()
    config = MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2, router_aux_loss_coef=0.02, max_position_embeddings=128,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def sft_loss_and_aux(model_path, tmp_path, **values) -> tuple[float, float, float, SFTTrainer]:
    """The training loss, the model's own load-balancing loss, and the loss without gradient (evaluation)."""
    trainer = SFTTrainer(model_path, args=args(SFTConfig, tmp_path, **values), train_dataset=FACTS)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    trainer.model.train()  # as training_step does
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        evaluated = trainer.compute_loss(trainer.model, batch)
        forward = {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch}
        aux = trainer.model(**forward, output_router_logits=True).aux_loss
    return loss.item(), aux.item(), evaluated.item(), trainer


def test_router_aux_loss_adds_exactly_coef_times_the_load_balancing_loss(tmp_path, moe_model):
    off, aux, _, _ = sft_loss_and_aux(moe_model, tmp_path, router_aux_loss_coef=0.0)
    on, aux_again, evaluated, trainer = sft_loss_and_aux(moe_model, tmp_path, router_aux_loss_coef=0.5)
    default, _, _, _ = sft_loss_and_aux(moe_model, tmp_path)  # None: the config's own 0.02, as TRL
    assert aux == pytest.approx(aux_again) and aux > 1.0
    assert on - off == pytest.approx(0.5 * aux, rel=1e-5)
    assert default - off == pytest.approx(0.02 * aux, rel=1e-5)
    assert trainer._metrics["train"]["aux_loss"] == [pytest.approx(aux, rel=1e-6)]
    assert evaluated == pytest.approx(off, rel=1e-6)  # a loss without gradient (eval_loss) has no auxiliary term


def test_router_aux_loss_with_lora(tmp_path, moe_model):
    from peft import LoraConfig

    losses = {}
    for coef in (0.0, 0.5):
        trainer = SFTTrainer(moe_model, args=args(SFTConfig, tmp_path, router_aux_loss_coef=coef), train_dataset=FACTS,
                             peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
        trainer.model.train()
        losses[coef] = trainer.compute_loss(trainer.model, batch).item()
    aux = trainer._metrics["train"]["aux_loss"][0]
    assert losses[0.5] - losses[0.0] == pytest.approx(0.5 * aux, rel=1e-5) and aux > 1.0


def test_router_aux_loss_gives_the_router_a_gradient(tmp_path, moe_model):
    def router_grad(coef: float) -> torch.Tensor:
        trainer = SFTTrainer(moe_model, args=args(SFTConfig, tmp_path, router_aux_loss_coef=coef), train_dataset=FACTS)
        trainer.compute_loss(trainer.model, trainer.data_collator([trainer.train_dataset[i] for i in range(2)])).backward()
        return next(p.grad for n, p in trainer.model.named_parameters() if n.endswith("layers.0.mlp.gate.weight"))

    assert not torch.allclose(router_grad(0.0), router_grad(1.0))


def test_router_aux_loss_coef_on_a_dense_model_is_refused(tmp_path):
    with pytest.raises(PlaitError, match="router_aux_loss_coef=0.1: LlamaForCausalLM is not a Mixture-of-Experts"):
        SFTTrainer(str(tiny_model_path()), args=args(SFTConfig, tmp_path, router_aux_loss_coef=0.1), train_dataset=FACTS)


# -- activation_offloading ---------------------------------------------------------------------


def test_activation_offloading_on_cpu_is_a_no_op_that_says_why(tmp_path, caplog):
    from plait.engine import trainer as chassis

    chassis._log_offloading_is_a_no_op.cache_clear()
    losses = []
    for offload in (False, True):
        with caplog.at_level(logging.INFO, logger="plait"):
            trainer = SFTTrainer(str(tiny_model_path()), train_dataset=FACTS,
                                 args=args(SFTConfig, tmp_path, activation_offloading=offload, use_cpu=True))
        trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before each step
        losses.append(trainer.training_step(trainer.model, trainer.data_collator(list(trainer.train_dataset))).item())
    assert "activation_offloading=True does nothing on a CPU run" in caplog.text
    assert losses[0] == losses[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_activation_offloading_keeps_saved_activations_off_the_gpu(tmp_path):
    long = Dataset.from_list([{"prompt": "The river ran slowly past the old mill " * 20, "completion": " and on."}] * 8)

    def held_after_forward(offload: bool) -> int:
        """GPU memory the training forward leaves allocated until backward: what it saved for it."""
        trainer = SFTTrainer(str(tiny_model_path()), train_dataset=long,
                             args=args(SFTConfig, tmp_path, activation_offloading=offload, max_length=512, bf16=False))
        batch = trainer._prepare_inputs(trainer.data_collator(list(trainer.train_dataset)))
        trainer.model.train()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(trainer.model, batch)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        return held

    assert held_after_forward(True) < 0.25 * held_after_forward(False)


# -- through the plait command -----------------------------------------------------------------


def plait(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PLAIT), "dpo", "--config", str(ROOT / "examples/recipes/dpo_tiny.yaml"), *flags, "--check"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_plait_command_takes_the_fields(tmp_path, custom_code_model):
    result = plait("--model", str(tiny_model_path()), "--output_dir", str(tmp_path / "a"), "--disable_dropout", "false")
    assert result.returncode == 0, result.stderr
    trusted = plait("--model", custom_code_model, "--output_dir", str(tmp_path / "c"), "--trust_remote_code", "true")
    assert trusted.returncode == 0, trusted.stderr
