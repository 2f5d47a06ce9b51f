"""Collator plugins: layouts, padding, masks, and padding-free attention on a real model."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait import PlaitError, make_plugins
from plait.testing.tiny_model import tiny_model_path

TOK = AutoTokenizer.from_pretrained(tiny_model_path())
PAD = TOK.pad_token_id
COLLATORS = make_plugins().collators

ids = st.lists(st.integers(5, 999), min_size=1, max_size=12)
multiples = st.sampled_from([None, 1, 4, 8])


def collator(name, **options):
    return COLLATORS.get(name).obj(TOK, **options)


def rows_of(tensor, mask):
    return [row[m.bool()].tolist() for row, m in zip(tensor, mask)]


def check_width(batch_tensor, longest, multiple):
    width = batch_tensor.shape[-1]
    assert width >= longest and (multiple is None or width % multiple == 0)
    assert width < longest + (multiple or 1)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(ids, ids, ids), min_size=1, max_size=5), multiples)
def test_preference_collation_then_chunk_recovers_chosen_and_rejected(triples, multiple):
    examples = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r, "ref_chosen_logps": -1.0 * i, "ref_rejected_logps": -2.0}
                for i, (p, c, r) in enumerate(triples)]
    batch = collator("collator.preference", pad_to_multiple_of=multiple)(examples)
    assert batch["input_ids"].shape[0] == 2 * len(examples)
    check_width(batch["input_ids"], max(len(p) + max(len(c), len(r)) for p, c, r in triples), multiple)
    chosen, rejected = batch["input_ids"].chunk(2)
    attn_c, attn_r = batch["attention_mask"].chunk(2)
    mask_c, mask_r = batch["completion_mask"].chunk(2)
    assert rows_of(chosen, attn_c) == [p + c for p, c, _ in triples]
    assert rows_of(rejected, attn_r) == [p + r for p, _, r in triples]
    assert rows_of(chosen, mask_c) == [c for _, c, _ in triples]
    assert rows_of(rejected, mask_r) == [r for _, _, r in triples]
    # right padding: each attention row is ones then zeros; padding holds the pad token
    for row in batch["attention_mask"]:
        assert row.tolist() == sorted(row.tolist(), reverse=True)
    assert (batch["input_ids"][batch["attention_mask"] == 0] == PAD).all()
    assert batch["ref_chosen_logps"].tolist() == [-1.0 * i for i in range(len(triples))]
    assert "margin" not in batch


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(ids, st.lists(st.booleans(), min_size=12, max_size=12)), min_size=1, max_size=5), multiples)
def test_language_modeling_labels_are_masked_exactly(rows, multiple):
    examples = [{"input_ids": i, "completion_mask": [int(b) for b in m[: len(i)]]} for i, m in rows]
    batch = collator("collator.language_modeling", pad_to_multiple_of=multiple)(examples)
    check_width(batch["input_ids"], max(len(i) for i, _ in rows), multiple)
    for b, ex in enumerate(examples):
        n = len(ex["input_ids"])
        expected = [t if m else -100 for t, m in zip(ex["input_ids"], ex["completion_mask"])]
        assert batch["labels"][b].tolist() == expected + [-100] * (batch["labels"].shape[1] - n)
        assert batch["attention_mask"][b].sum() == n


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(ids, min_size=1, max_size=3), min_size=1, max_size=4), multiples)
def test_padding_free_positions_restart_exactly_at_each_document(packed_rows, multiple):
    examples = [{"input_ids": sum(docs, []), "seq_lengths": [len(d) for d in docs]} for docs in packed_rows]
    batch = collator("collator.padding_free", pad_to_multiple_of=multiple)(examples)
    docs = [d for row in packed_rows for d in row]
    flat = sum(docs, [])
    assert batch["input_ids"].shape == batch["position_ids"].shape == batch["labels"].shape
    check_width(batch["input_ids"], len(flat), multiple)
    assert batch["input_ids"][0, : len(flat)].tolist() == flat
    starts = [sum(len(d) for d in docs[:k]) for k in range(len(docs))]
    positions = batch["position_ids"][0].tolist()
    assert positions[: len(flat)] == [p for d in docs for p in range(len(d))]
    assert [i for i, p in enumerate(positions[: len(flat)]) if p == 0] == starts
    labels = batch["labels"][0].tolist()
    assert all(labels[s] == -100 for s in starts)
    assert [labels[i] for i in range(len(flat)) if i not in starts] == [t for d in docs for t in d[1:]]
    assert all(label == -100 for label in labels[len(flat):])


def test_padding_free_attention_stays_within_documents():
    # The layout the collator emits must reproduce separate forwards on a real model (training mode: no cache).
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path()).eval()
    docs = [[10, 20, 30, 40, 50], [60, 70, 80], [90, 91]]
    with torch.no_grad():
        separate = torch.cat([model(input_ids=torch.tensor([d])).logits[0] for d in docs])

    def flat_logits(examples):
        batch = collator("collator.padding_free")(examples)
        with torch.no_grad():
            return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]

    # a packed row (seq_lengths) and a plain row: three documents, each attending only to itself
    flat = flat_logits([{"input_ids": docs[0] + docs[1], "seq_lengths": [5, 3]}, {"input_ids": docs[2]}])
    torch.testing.assert_close(flat, separate, atol=1e-5, rtol=1e-5)
    # without seq_lengths the first row is one document, so its second half sees the first
    joined = flat_logits([{"input_ids": docs[0] + docs[1]}, {"input_ids": docs[2]}])
    torch.testing.assert_close(joined[:5], separate[:5], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(joined[5:8], separate[5:8], atol=1e-3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(ids, ids, st.booleans()), min_size=1, max_size=5))
def test_unpaired_batch_and_mismatched_kl_pairs(rows):
    examples = [{"prompt_ids": p, "completion_ids": c, "label": y} for p, c, y in rows]
    batch = collator("collator.unpaired")(examples)
    assert batch["label"].tolist() == [y for _, _, y in rows]
    assert rows_of(batch["input_ids"], batch["attention_mask"]) == [p + c for p, c, _ in rows]
    assert rows_of(batch["input_ids"], batch["completion_mask"]) == [c for _, c, _ in rows]
    rotated = [rows[i - 1][1] for i in range(len(rows))]  # prompt i with the completion of row i-1
    assert rows_of(batch["kl_input_ids"], batch["kl_attention_mask"]) == [p + c for (p, _, _), c in zip(rows, rotated)]
    assert rows_of(batch["kl_input_ids"], batch["kl_completion_mask"]) == rotated


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(ids, ids, ids), min_size=1, max_size=5))
def test_unpaired_rows_with_fixed_partners_keep_them(rows):
    examples = [{"prompt_ids": p, "completion_ids": c, "kl_completion_ids": k, "label": True, "ref_logps": -1.5}
                for p, c, k in rows]
    batch = collator("collator.unpaired")(examples)
    assert rows_of(batch["kl_input_ids"], batch["kl_attention_mask"]) == [p + k for p, _, k in rows]
    assert rows_of(batch["kl_input_ids"], batch["kl_completion_mask"]) == [k for _, _, k in rows]
    assert batch["ref_logps"].tolist() == [-1.5] * len(rows)


@settings(max_examples=60, deadline=None)
@given(st.lists(ids, min_size=1, max_size=5), multiples)
def test_prompt_only_is_left_padded_for_generation(prompts, multiple):
    examples = [{"prompt_ids": p, "prompt": f"text {i}", "solution": i} for i, p in enumerate(prompts)]
    batch = collator("collator.prompt_only", pad_to_multiple_of=multiple)(examples)
    check_width(batch["input_ids"], max(map(len, prompts)), multiple)
    width = batch["input_ids"].shape[1]
    for row, mask, p in zip(batch["input_ids"], batch["attention_mask"], prompts):
        assert row[width - len(p):].tolist() == p and mask.tolist() == [0] * (width - len(p)) + [1] * len(p)
    assert batch["solution"] == list(range(len(prompts))) and batch["prompt"][0] == "text 0"


@pytest.mark.parametrize("name", ["collator.language_modeling", "collator.padding_free", "collator.preference",
                                  "collator.unpaired", "collator.prompt_only"])
def test_bad_pad_to_multiple_of(name):
    with pytest.raises(PlaitError, match="pad_to_multiple_of=0"):
        collator(name, pad_to_multiple_of=0)


# -- data-loader workers started by spawn receive the collator --------------------------------------


def test_a_trainers_collator_pickles_as_its_registry_entry_and_batches_alike_in_a_spawned_worker(tmp_path):
    """Collator factories return closures; a trainer hands the data loader a RegisteredCollator, which a worker
    started by spawn (macOS, Python 3.14's forkserver, dataloader_multiprocessing_context) rebuilds by name."""
    import pickle

    from datasets import Dataset

    import plait

    rows = [{"prompt": "The sky is", "completion": " blue."}, {"prompt": "Grass is", "completion": " green."}]
    args = plait.SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", dataloader_num_workers=1,
                           dataloader_multiprocessing_context="spawn", padding_free=False)
    trainer = plait.SFTTrainer(str(tiny_model_path()), args=args, train_dataset=Dataset.from_list(rows))
    collate = trainer.data_collator
    examples = [trainer.train_dataset[i] for i in range(2)]
    again = pickle.loads(pickle.dumps(collate))
    assert again.padded.plugins is None and again.padded.name == "collator.language_modeling"  # rebuilt by name
    expected = collate(examples)
    got = again(examples)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    trainer.train()  # transformers' loader, its worker started by spawn
    assert trainer.state.global_step == 1
