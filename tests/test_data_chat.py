"""Chat templates: applied once, prompt/completion boundaries, assistant masks with and without markers."""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from plait import PlaitError
from plait.data import chat
from plait.data.prepare import prepare_dataset
from plait.testing.tiny_model import chat_template, tiny_model_path

MARKED = AutoTokenizer.from_pretrained(tiny_model_path())
PLAIN = AutoTokenizer.from_pretrained(tiny_model_path(generation_markers=False))


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


def encode_full(tok, messages):
    return chat.encode(tok, chat.render(tok, messages), special_tokens=False)


words = st.text(alphabet="abcdefg xyz.,?!\n", min_size=1, max_size=30).filter(lambda s: s.strip())


@st.composite
def conversations(draw):
    messages = [{"role": "system", "content": draw(words)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        messages.append(u(draw(words)))
        if draw(st.booleans()):  # a tool round trip
            call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": draw(words)}}}
            messages += [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": draw(words)}]
        messages.append(a(draw(words)))
    return messages


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
def test_derived_assistant_mask_equals_generation_mask(messages):
    messages = chat.check_messages(messages, "messages")
    marked_ids, marked_mask = chat.encode_with_assistant_mask(MARKED, messages)  # {% generation %}
    derived_ids, derived_mask = chat.derived_assistant_mask(MARKED, messages)  # prefix diffing
    plain_ids, plain_mask = chat.encode_with_assistant_mask(PLAIN, messages)  # markerless template
    assert derived_ids == marked_ids == plain_ids
    assert derived_mask == marked_mask == plain_mask
    assert any(marked_mask)


def test_markerless_mask_covers_exactly_the_assistant_turns():
    messages = [u("What is 7 plus 5?"), a("The answer is 12."), u("And 9 times 8?"), a("It is 72.")]
    ids, mask = chat.encode_with_assistant_mask(PLAIN, messages)
    assert PLAIN.decode([t for t, m in zip(ids, mask) if m]) == "The answer is 12.<|im_end|>It is 72.<|im_end|>"


def test_template_that_rewrites_earlier_turns_is_refused():
    tok = copy.deepcopy(PLAIN)
    # Numbers every render by the conversation length: no rendering of a prefix is a prefix of the whole.
    tok.chat_template = "{{ messages | length }}\n" + chat_template(False)
    messages = [u("hi"), a("hello"), u("bye"), a("see you")]
    with pytest.raises(PlaitError, match="not prefix-preserving.*chat_template_path.*assistant_only_loss=False"):
        chat.encode_with_assistant_mask(tok, messages)
    # the same refusal surfaces from prepare_dataset, before training
    with pytest.raises(PlaitError, match="row 0.*not prefix-preserving"):
        prepare_dataset([{"messages": messages}], tok, "language_modeling", assistant_only_loss=True)


def test_prompt_ending_in_user_gets_the_generation_prompt():
    prompt, completion = [u("Sky colour?")], [a("Blue.")]
    prompt_ids, completion_ids = chat.encode_prompt_completion(MARKED, prompt, completion)
    assert prompt_ids + completion_ids == encode_full(MARKED, prompt + completion)
    assert MARKED.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    assert MARKED.decode(completion_ids) == "Blue.<|im_end|>\n"


def test_prompt_ending_in_assistant_is_continued():
    prompt, completion = [u("7 plus 5?"), a("The answer is")], [a(" 12.")]
    prompt_ids, completion_ids = chat.encode_prompt_completion(MARKED, prompt, completion)
    assert MARKED.decode(prompt_ids).endswith("<|im_start|>assistant\nThe answer is")
    assert MARKED.decode(completion_ids) == " 12.<|im_end|>\n"
    assert prompt_ids + completion_ids == encode_full(MARKED, [prompt[0], a("The answer is 12.")])


def test_boundary_is_the_common_token_prefix_when_the_template_rewrites_the_prompt_end():
    tok = copy.deepcopy(MARKED)
    # The generation prompt opens an empty think block that the finished conversation does not contain.
    tok.chat_template = chat_template(True).replace(
        "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}", "{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
    )
    assert chat.render_prompt(tok, [u("hi")]).endswith("<think>\n")
    prompt_ids, completion_ids = chat.encode_prompt_completion(tok, [u("hi")], [a("hello there")])
    assert prompt_ids + completion_ids == encode_full(tok, [u("hi"), a("hello there")])
    assert tok.decode(completion_ids) == "hello there<|im_end|>\n"


def test_role_markers_and_the_template_applied_twice_warning():
    assert "<|im_start|>user" in chat.role_markers(MARKED)
    templated = MARKED.apply_chat_template([u("Sky colour?")], tokenize=False, add_generation_prompt=True)
    with pytest.warns(UserWarning, match="already contains the chat template's marker"):
        prepare_dataset([{"prompt": templated, "completion": "Blue."}], MARKED, "language_modeling")


def test_chat_template_path_loads_a_template(tmp_path):
    bare = copy.deepcopy(MARKED)
    bare.chat_template = None
    path = tmp_path / "template.jinja"
    path.write_text(chat_template(True))
    out = prepare_dataset([{"messages": [u("hi"), a("hello")]}], bare, "language_modeling", chat_template_path=str(path))
    assert out[0]["input_ids"] == encode_full(MARKED, [u("hi"), a("hello")])
    with pytest.raises(PlaitError, match="chat_template_path='/nonexistent'"):
        chat.load_chat_template(bare, "/nonexistent")
