"""Format detection over every built-in format, both variants, and the errors for bad inputs."""

import copy
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import pytest
from transformers import AutoTokenizer

from plait import PlaitError, make_plugins
from plait.data.prepare import detect_format, is_conversational_example, prepare_dataset
from plait.testing.tiny_model import tiny_model_path


@pytest.fixture(scope="module")
def plugins():
    return make_plugins()


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny_model_path())


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


STANDARD = {
    "format.language_modeling": {"text": "The sky is blue."},
    "format.prompt_only": {"prompt": "The sky is"},
    "format.prompt_completion": {"prompt": "The sky is", "completion": " blue."},
    "format.preference": {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    "format.implicit_preference": {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    "format.unpaired_preference": {"prompt": "The sky is", "completion": " blue.", "label": True},
    "format.tokenised_preference": {"chosen_ids": [5, 6, 7], "rejected_ids": [5, 6, 8, 9]},  # TRL's pre-tokenised rows
}
CONVERSATIONAL = {
    "format.language_modeling": {"messages": [u("Sky colour?"), a("Blue.")]},
    "format.prompt_only": {"prompt": [u("Sky colour?")]},
    "format.prompt_completion": {"prompt": [u("Sky colour?")], "completion": [a("Blue.")]},
    "format.preference": {"prompt": [u("Sky colour?")], "chosen": [a("Blue.")], "rejected": [a("Green.")]},
    "format.implicit_preference": {"chosen": [u("Sky colour?"), a("Blue.")], "rejected": [u("Sky colour?"), a("Green.")]},
    "format.unpaired_preference": {"prompt": [u("Sky colour?")], "completion": [a("Blue.")], "label": False},
    "format.sharegpt": {"conversations": [{"from": "human", "value": "Sky colour?"}, {"from": "gpt", "value": "Blue."}]},
}
CASES = [(name, ex, False) for name, ex in STANDARD.items()] + [(name, ex, True) for name, ex in CONVERSATIONAL.items()]


def test_every_format_is_registered_and_covered(plugins):
    text = {n for n in plugins.data_formats.names() if not n.startswith("format.vision_")}  # tests/test_vlm_data.py
    assert text == set(STANDARD) | set(CONVERSATIONAL)


@pytest.mark.parametrize("name,example,conversational", CASES, ids=[f"{n}-{'conv' if c else 'std'}" for n, _, c in CASES])
def test_detects_each_format_in_both_variants(plugins, name, example, conversational):
    row = {**example, "id": 7}  # an extra column never changes the answer
    assert detect_format(row, plugins).name == name
    assert detect_format([row, row], plugins).name == name
    component = detect_format(datasets.Dataset.from_list([row, row]), plugins)
    assert component.name == name
    canonical = component.obj.to_canonical(row)
    assert canonical["id"] == 7
    assert is_conversational_example(canonical, component.obj.kind) is conversational


def test_implicit_prompt_is_the_common_prefix(plugins):
    fmt = plugins.data_formats.get("format.implicit_preference").obj
    assert fmt.to_canonical(STANDARD["format.implicit_preference"]) == {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    # never split inside a word: "bl|ue" vs "bl|ack" backs up to the word start
    assert fmt.to_canonical({"chosen": "It is blue", "rejected": "It is black"})["prompt"] == "It is"
    conv = fmt.to_canonical(CONVERSATIONAL["format.implicit_preference"])
    assert conv == {"prompt": [u("Sky colour?")], "chosen": [a("Blue.")], "rejected": [a("Green.")]}


def test_sharegpt_becomes_messages(plugins):
    fmt = plugins.data_formats.get("format.sharegpt").obj
    assert fmt.to_canonical(CONVERSATIONAL["format.sharegpt"]) == {"text": [u("Sky colour?"), a("Blue.")]}
    with pytest.raises(PlaitError, match="from='robot'"):
        fmt.to_canonical({"conversations": [{"from": "robot", "value": "beep"}]})


@pytest.mark.parametrize("columns", [
    {"text": "a", "prompt": "b"},
    {"prompt": "a", "completion": "b", "chosen": "c", "rejected": "d"},
    {"text": "a", "messages": [u("x")]},
    {"messages": [u("x")], "conversations": []},
    {"prompt": "a", "completion": "b", "label": True, "chosen": "c", "rejected": "d"},
])
def test_ambiguous_shapes_are_refused(plugins, columns):
    with pytest.raises(PlaitError, match="ambiguous|twice") as info:
        detect_format(columns, plugins)
    assert str(sorted(columns)) in str(info.value)


def test_unknown_shape_names_columns_and_accepted_shapes(plugins):
    with pytest.raises(PlaitError) as info:
        detect_format(datasets.Dataset.from_list([{"question": "q", "answer": "a"}]), plugins)
    message = str(info.value)
    assert "['answer', 'question']" in message
    for shape in ("{prompt, chosen, rejected}", "{text} or {messages}", "{conversations}", "{prompt, completion, label}"):
        assert shape in message
    assert "\n" not in message


# -- bad inputs: one clear PlaitError each, before any training ------------------------------


def test_missing_column_is_named(tok):
    with pytest.raises(PlaitError, match=r"task 'preference'.*missing column\(s\) \['rejected'\]"):
        prepare_dataset([{"prompt": "a", "chosen": "b"}], tok, "preference")


def test_empty_completion(tok):
    with pytest.raises(PlaitError, match="row 1.*'completion' is empty"):
        prepare_dataset([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}], tok, "language_modeling")
    with pytest.raises(PlaitError, match="'chosen' is empty"):
        prepare_dataset([{"prompt": [u("a")], "chosen": [], "rejected": [a("b")]}], tok, "preference")


def test_overlong_prompt_dropped_with_count_or_refused(tok, caplog):
    rows = [{"prompt": "word " * 40, "completion": "yes"}, {"prompt": "short", "completion": "yes"}]
    with caplog.at_level(logging.WARNING, logger="plait"):
        out = prepare_dataset(rows, tok, "language_modeling", max_length=16)
    assert len(out) == 1
    assert "dropped 1 of 2" in caplog.text
    with pytest.raises(PlaitError, match=r"row 0: its prompt \(\d+ tokens\).*max_length=16.*on_overlong='drop'"):
        prepare_dataset(rows, tok, "language_modeling", max_length=16, on_overlong="error")
    with pytest.raises(PlaitError, match="every one of the 1 examples"):
        prepare_dataset(rows[:1], tok, "language_modeling", max_length=16)


def test_mixed_conversational_and_standard_rows(tok):
    rows = [STANDARD["format.prompt_completion"], CONVERSATIONAL["format.prompt_completion"]]
    with pytest.raises(PlaitError, match="row 1 holds conversations but row 0 holds standard strings"):
        prepare_dataset(rows, tok, "language_modeling")
    with pytest.raises(PlaitError, match="mix strings and conversations within one row"):
        prepare_dataset([{"prompt": "Sky?", "completion": [a("Blue.")]}], tok, "language_modeling")


def test_non_string_content(tok):
    row = {"messages": [u("hi"), {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]}
    with pytest.raises(PlaitError, match="message 1 \\(assistant\\) has non-string content of type list"):
        prepare_dataset([row], tok, "language_modeling")


def test_none_values(tok):
    with pytest.raises(PlaitError, match="row 1.*'completion' is None"):
        prepare_dataset(datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}]),
                        tok, "language_modeling")
    with pytest.raises(PlaitError, match="content None"):
        prepare_dataset([{"messages": [u("hi"), {"role": "assistant", "content": None}]}], tok, "language_modeling")


def test_label_must_be_boolean(tok):
    with pytest.raises(PlaitError, match="'label' is 1 \\(int\\).*booleans"):
        prepare_dataset([{"prompt": "a", "completion": "b", "label": 1}], tok, "unpaired")


def test_conversations_need_a_chat_template(tok):
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(PlaitError, match="chat_template_path"):
        prepare_dataset([CONVERSATIONAL["format.prompt_completion"]], bare, "language_modeling")


@pytest.mark.parametrize("kwargs,match", [
    ({"task": "dpo"}, "task='dpo'"),
    ({"truncation_mode": "middle"}, "truncation_mode='middle'"),
    ({"on_overlong": "ignore"}, "on_overlong='ignore'"),
    ({"max_length": 0}, "max_length=0"),
])
def test_bad_options(tok, kwargs, match):
    with pytest.raises(PlaitError, match=match):
        prepare_dataset([STANDARD["format.language_modeling"]], tok, **{"task": "language_modeling", **kwargs})
