"""A tiny chat model and tokenizer built offline in seconds, for tests, benchmarks and demos.

``build_tiny_model(directory)`` trains a byte-level BPE tokenizer (vocab ~1000) on English text
bundled in this module and saves it, with a ChatML-like chat template, next to a randomly
initialised 2-layer ``LlamaForCausalLM`` (hidden 64, 2 heads, 1 KV head, head_dim 32 -- the
smallest head_dim vLLM's CPU backend accepts). A Llama config is used on purpose: for
``model_type`` qwen2, ``AutoTokenizer`` rebuilds the pre-tokenizer and ids change after reload.

``tiny_model_path()`` builds once per option set into plait's cache folder
(:func:`plait.paths.cache_dir`) and returns the folder; concurrent test processes are safe because each
build happens in a private temporary folder that is renamed into place atomically.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import random
import shutil
import tempfile

from plait.paths import cache_dir, honour_umask, umask

# Bump when the output of build_tiny_model changes, so stale caches are not reused.
BUILDER_VERSION = "2"  # 2: the template renders tools= (a system turn listing their schemas)

BOS, EOS, PAD = "<|begin_of_text|>", "<|im_end|>", "<|pad|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = [PAD, BOS, "<|endoftext|>", IM_START, EOS]

# Assistant turns (their content and the closing <|im_end|>) are wrapped in
# {% generation %} so transformers can return an assistant-token mask.
# With tools=, a first system turn lists their JSON schemas (nothing changes without tools).
_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nTools:' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "@@OPEN@@"
    "{{- message['content'] if message['content'] is string else '' -}}"
    "{%- if message.get('tool_calls') -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "@@CLOSE@@"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- (message['content'] if message['content'] is string else '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def chat_template(generation_markers: bool = True) -> str:
    """The tiny model's ChatML-like template, with or without {% generation %} markers."""
    open_, close = ("{% generation %}", "{% endgeneration %}") if generation_markers else ("", "")
    return _CHAT_TEMPLATE.replace("@@OPEN@@", open_).replace("@@CLOSE@@", close)


_PASSAGE = """\
The river ran slowly past the old mill, and the children who lived in the village would sit on
the stone wall every evening to watch the light change on the water. Nobody could remember when
the wheel had last turned. Some said the miller left during a hard winter; others said he had
simply grown tired of flour and gone to sea. What everyone agreed on was that the building was
beautiful at sunset, when the windows burned orange and the swallows came home to the roof.
A good answer is short, clear and correct. When you are asked a question, think about what the
person really needs, explain the steps, and check your work before you reply. If you do not
know something, say so honestly. Numbers such as 1, 2, 3, 10, 42, 100 and 2025 appear in
questions about arithmetic: what is 7 plus 5? The answer is 12. What is 9 times 8? It is 72.
Python is a programming language. A function takes arguments and returns a value; a list holds
items in order; a dictionary maps keys to values. Errors should never pass silently.
The weather today is cold and bright. Tomorrow there may be rain in the north and wind along
the coast, but the south should stay dry and warm until the weekend.
"""

_WORDS = """
the a an and or but if then because while when where who what which how why this that these
those is are was were be been being have has had do does did will would can could should may
might must shall I you he she it we they me him her us them my your his its our their mine
yours model answer question user assistant system tool call result data train training loss
learn learning reward policy reference value token tokens text sentence word words story
river mountain forest city village house garden door window table chair book paper letter
friend family child children mother father teacher student doctor farmer king queen people
time day night morning evening week month year today tomorrow yesterday always never often
good bad new old big small long short high low early late young great little own other same
right left first last next best better worse happy sad quick slow bright dark warm cold
go come make take give find think know see look want use work call try ask need feel leave
put mean keep let begin seem help show hear play run move live believe bring write sit stand
lose pay meet include continue set change lead understand watch follow stop create speak read
spend grow open walk win offer remember love consider appear buy wait serve die send expect
build stay fall cut reach kill remain suggest raise pass sell require report decide pull
water fire earth air light sound music color number problem system program function list
question example reason idea world country state school market company group family part
place case point government hand eye life fact room area money story issue side kind head
service friend power hour game line end member law car name president team minute body
information back parent face others level office door health person art war history party
""".split()


def training_text(seed: int = 0, sentences: int = 3000) -> str:
    """The bundled passage plus deterministic pseudo-sentences over a few hundred common words."""
    rng = random.Random(seed)
    lines = [_PASSAGE]
    for _ in range(sentences):
        words = rng.choices(_WORDS, k=rng.randint(4, 14))
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!", ","])
        lines.append(sentence)
    return "\n".join(lines)


def _build_tokenizer(seed: int, generation_markers: bool, vocab_size: int = 1000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(training_text(seed).splitlines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        model_max_length=1024,
        padding_side="right",
        chat_template=chat_template(generation_markers),
    )
    return tokenizer


def build_tiny_model(directory, *, seed: int = 0, generation_markers: bool = True) -> pathlib.Path:
    """Build the tiny tokenizer and ``LlamaForCausalLM`` into ``directory``; return its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = pathlib.Path(directory)
    tokenizer = _build_tokenizer(seed, generation_markers)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # A private generator: building the fixture must not disturb the caller's RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_model_path(generation_markers: bool = True, *, seed: int = 0) -> pathlib.Path:
    """The cached tiny model folder for these options, built on first use (atomic, process-safe)."""
    key = hashlib.sha256(f"{BUILDER_VERSION}|markers={generation_markers}|seed={seed}".encode()).hexdigest()[:12]
    return cached_build(f"tiny-model-{key}",
                        lambda staging: build_tiny_model(staging, seed=seed, generation_markers=generation_markers))


def cached_build(name: str, build) -> pathlib.Path:
    """``cache_dir() / name``, made by ``build(folder)`` on first use in a private folder renamed into place."""
    root = cache_dir()
    final = root / name
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(staging)
        # mkdtemp's folder is private (0700) and safetensors writes 0600: shared like any new folder of the user
        staging.chmod(0o777 & ~umask())
        honour_umask(staging.rglob("*"))
        try:
            os.rename(staging, final)  # atomic; fails if another process got there first
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def noisy_tiny_model(seed: int = 1, scale: float = 0.5):
    """The tiny model with Gaussian noise (``scale``) added to every weight, drawn from ``seed``
    without touching the caller's RNG: a different but fixed model, e.g. a teacher to distil from."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * scale)
    return model


def tiny_llama():
    """The tiny model (:func:`tiny_model_path`) loaded in train mode: transformers' own Llama classes, so the
    engine's conversions (norms, linear layers, MLPs) find what they find in a real model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path())).train()


def loss_and_gradients(model, *, bf16_autocast: bool, tokens: int = 20):
    """(loss, {parameter name: gradient}) of ``model``'s language-modelling loss on two fixed rows of ``tokens``
    random ids, under bf16 autocast on the CPU or not; earlier gradients are cleared first."""
    import torch

    ids = torch.randint(5, 900, (2, tokens), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}
