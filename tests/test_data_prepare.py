"""prepare_dataset: one tokenisation per task, exact completion masks, truncation and reports."""

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from plait import make_plugins
from plait.data import chat
from plait.data.prepare import TASKS, Encoder, prepare_dataset
from plait.testing.tiny_model import tiny_model_path

TOK = AutoTokenizer.from_pretrained(tiny_model_path())
PLAIN = AutoTokenizer.from_pretrained(tiny_model_path(generation_markers=False))
PLUGINS = make_plugins()
EOS = TOK.eos_token


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


def prep(rows, task, tok=TOK, **options):
    return prepare_dataset(rows, tok, task, plugins=PLUGINS, **options).to_list()


def masked(row, key="completion_mask"):
    return TOK.decode([t for t, m in zip(row["input_ids"], row[key]) if m])


def unmasked(row):
    return TOK.decode([t for t, m in zip(row["input_ids"], row["completion_mask"]) if not m])


def test_language_modeling_standard_appends_eos_and_trains_everything():
    (row,) = prep([{"text": "The river ran slowly.", "id": 3}], "language_modeling")
    assert row["input_ids"] == TOK("The river ran slowly.")["input_ids"] + [TOK.eos_token_id]
    assert row["completion_mask"] == [1] * len(row["input_ids"]) and row["id"] == 3


def test_language_modeling_conversational_and_assistant_only():
    messages = [u("Hi"), a("Hello there."), u("Bye"), a("See you")]
    (whole,) = prep([{"messages": messages}], "language_modeling")
    assert whole["input_ids"] == chat.encode(TOK, chat.render(TOK, messages), special_tokens=False)
    assert all(whole["completion_mask"])
    for tok in (TOK, PLAIN):  # with {% generation %} markers and derived without them
        (row,) = prep([{"messages": messages}], "language_modeling", tok=tok, assistant_only_loss=True)
        assert row["input_ids"] == whole["input_ids"]
        assert masked(row) == f"Hello there.{EOS}See you{EOS}"


texts = st.text(alphabet="abcde xyz.,?!:\n0123456789", min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=texts, completion=texts)
def test_standard_completion_mask_covers_exactly_the_completion_tokens(prompt, completion):
    (row,) = prep([{"prompt": prompt, "completion": completion}], "language_modeling")
    # The boundary is the common token prefix of prompt and prompt+completion: what is not masked
    # is a prefix of the prompt, what is masked is the rest of the text plus EOS.
    full = TOK(prompt + completion)["input_ids"]
    assert row["input_ids"] == full + [TOK.eos_token_id]
    head = unmasked(row)
    assert prompt.startswith(head)
    assert masked(row) == (prompt + completion)[len(head):] + EOS
    assert row["completion_mask"] == sorted(row["completion_mask"])  # 0…0 1…1


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(question=texts.filter(str.strip), answer=texts.filter(str.strip), follow=st.booleans())
def test_conversational_completion_mask_is_exactly_the_assistant_reply(question, answer, follow):
    completion = [a(answer)] + ([u("thanks"), a("welcome")] if follow else [])
    (row,) = prep([{"prompt": [u(question)], "completion": completion}], "language_modeling")
    tail = f"{answer}{EOS}\n" + (f"<|im_start|>user\nthanks{EOS}\n<|im_start|>assistant\nwelcome{EOS}\n" if follow else "")
    assert masked(row) == tail
    assert unmasked(row) == f"<|im_start|>user\n{question}{EOS}\n<|im_start|>assistant\n"
    # assistant_only_loss additionally drops the user turn inside the completion (and the newlines after EOS)
    (only,) = prep([{"prompt": [u(question)], "completion": completion}], "language_modeling", assistant_only_loss=True)
    assert masked(only) == f"{answer}{EOS}" + (f"welcome{EOS}" if follow else "")
    (everything,) = prep([{"prompt": [u(question)], "completion": completion}], "language_modeling", completion_only_loss=False)
    assert all(everything["completion_mask"])


def test_preference_standard_and_conversational():
    (row,) = prep([{"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "margin": 1.5}], "preference")
    assert set(row) == {"prompt_ids", "chosen_ids", "rejected_ids", "margin"}
    assert TOK.decode(row["prompt_ids"]) == "The sky is"
    assert TOK.decode(row["chosen_ids"]) == f" blue.{EOS}" and TOK.decode(row["rejected_ids"]) == f" green.{EOS}"
    prompt = [u("Sky colour?")]
    (conv,) = prep([{"prompt": prompt, "chosen": [a("Blue.")], "rejected": [a("Green.")]}], "preference")
    assert conv["prompt_ids"] + conv["chosen_ids"] == chat.encode(TOK, chat.render(TOK, prompt + [a("Blue.")]), special_tokens=False)
    assert TOK.decode(conv["rejected_ids"]) == f"Green.{EOS}\n"


def test_unpaired_keeps_labels_and_splits_pairs():
    rows = prep([{"prompt": "Sky:", "completion": " blue", "label": True}, {"prompt": "Sky:", "completion": " red", "label": False}], "unpaired")
    assert [r["label"] for r in rows] == [True, False]
    assert TOK.decode(rows[1]["completion_ids"]) == f" red{EOS}"
    split = prep([{"prompt": "Sky:", "chosen": " blue", "rejected": " red", "id": 1}], "unpaired")
    assert [(TOK.decode(r["completion_ids"]), r["label"], r["id"]) for r in split] == [(f" blue{EOS}", True, 1), (f" red{EOS}", False, 1)]


def test_prompt_only_keeps_raw_prompt_and_reward_columns():
    rows = prep([{"prompt": [u("What is 7 plus 5?")], "solution": "12"}], "prompt_only")
    assert rows[0]["solution"] == "12" and rows[0]["prompt"] == [u("What is 7 plus 5?")]
    assert TOK.decode(rows[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")
    # any prompt-bearing dataset works for online methods; its other fields stay as columns
    (row,) = prep([{"prompt": "Sky:", "chosen": " blue", "rejected": " red"}], "prompt_only")
    assert row["chosen"] == " blue" and row["prompt_ids"] == TOK("Sky:")["input_ids"]


def test_every_task_documents_its_columns():
    outputs = {
        "language_modeling": prep([{"text": "abc"}], "language_modeling"),
        "preference": prep([{"prompt": "a", "chosen": "b", "rejected": "c"}], "preference"),
        "unpaired": prep([{"prompt": "a", "completion": "b", "label": True}], "unpaired"),
        "prompt_only": prep([{"prompt": "a"}], "prompt_only"),
    }
    for task, rows in outputs.items():
        assert set(rows[0]) == set(TASKS[task].columns)


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncation_modes_and_report(mode, caplog):
    text = " ".join(str(i) for i in range(40))
    ids = TOK(text)["input_ids"] + [TOK.eos_token_id]
    with caplog.at_level(logging.WARNING, logger="plait"):
        (row,) = prep([{"text": text}], "language_modeling", max_length=10, truncation_mode=mode)
    assert row["input_ids"] == (ids[:10] if mode == "keep_start" else ids[-10:])
    assert f"truncated 1 of 1 examples to max_length=10 ({mode}): {len(ids) - 10} tokens removed" in caplog.text


def test_preference_truncation_keeps_the_prompt_shared():
    enc = Encoder(TOK, max_length=10, truncation_mode="keep_start")
    p, (c, r), overlong = enc.fit(4, [8, 3])
    assert (p, c, r, overlong) == (slice(0, 4), slice(0, 6), slice(0, 3), False)
    enc = Encoder(TOK, max_length=10, truncation_mode="keep_end")
    p, (c, r), overlong = enc.fit(6, [8, 3])
    assert (p, c, r, overlong) == (slice(4, 6), slice(0, 8), slice(0, 3), False)
    assert enc.fit(6, [10, 3])[2] is True  # no prompt token would survive
    assert Encoder(TOK, max_length=10).fit(10, [1])[2] is True  # no completion token would survive


def test_datasets_input_and_num_proc_free_path():
    ds = datasets.Dataset.from_list([{"prompt": "Sky:", "completion": " blue"}] * 3)
    out = prepare_dataset(ds, TOK, "language_modeling", plugins=PLUGINS)
    assert len(out) == 3 and out.column_names == ["input_ids", "completion_mask"]
