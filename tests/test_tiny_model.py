"""The offline tiny-model fixture: reloads identically and its template marks assistant text."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.testing.tiny_model import _build_tokenizer, build_tiny_model, tiny_model_path

TEXTS = ["The river ran slowly past the old mill.", "What is 7 plus 5? The answer is 12!", "Ünïcode ☃ and \ttabs\n"]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 7 plus 5?"},
    {"role": "assistant", "content": "The answer is 12."},
    {"role": "user", "content": "And 9 times 8?"},
    {"role": "assistant", "content": "It is 72."},
]


def test_build_reloads_with_identical_ids_and_a_working_model(tmp_path):
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    fresh = _build_tokenizer(0, True)
    reloaded = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert reloaded(text)["input_ids"] == fresh(text)["input_ids"]
        assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert reloaded.apply_chat_template(CONVERSATION) == fresh.apply_chat_template(CONVERSATION)
    assert (reloaded.eos_token, reloaded.pad_token) == ("<|im_end|>", "<|pad|>")
    assert reloaded.pad_token_id != reloaded.eos_token_id

    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 2)
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (1, 32, True)
    assert config.vocab_size == len(reloaded)
    ids = torch.tensor([reloaded(TEXTS[0])["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], config.vocab_size)


def test_cached_path_is_stable():
    assert tiny_model_path() == tiny_model_path()
    assert tiny_model_path(generation_markers=False) != tiny_model_path()


def test_generation_mask_covers_exactly_the_assistant_text():
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    out = tokenizer.apply_chat_template(CONVERSATION, return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    masked = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "The answer is 12.<|im_end|>It is 72.<|im_end|>"
    # the rest is exactly the non-assistant scaffolding
    unmasked = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert "The answer" not in unmasked and unmasked.count("<|im_start|>assistant\n") == 2


def test_markerless_template_renders_the_same_text():
    marked = AutoTokenizer.from_pretrained(tiny_model_path())
    plain = AutoTokenizer.from_pretrained(tiny_model_path(generation_markers=False))
    assert "{% generation %}" not in plain.chat_template and "{% generation %}" in marked.chat_template
    for prompt in (True, False):
        assert plain.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=prompt) == \
            marked.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=prompt)
    assert plain.apply_chat_template(CONVERSATION) == marked.apply_chat_template(CONVERSATION)
