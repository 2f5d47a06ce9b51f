"""KTO's mismatched pairs and data preparation, as TRL 1.16 prepares them (and where plait differs).

z is estimated from prompts paired with *other* examples' completions (KTO, Sec. 4.1). The
partners are fixed when the data is prepared, never a row with the same prompt (a preference
pair's two rows share theirs), and under the default sequential sampling they are the batch's own
completions. Long rows keep their start (TRL has no other mode) and stay in the data.
"""

import logging

import pytest
from datasets import Dataset
from torch.utils.data import RandomSampler, SequentialSampler

from plait.plugins.methods.kto import KTOConfig, KTOTrainer, mismatched_partners
from plait.testing.tiny_model import tiny_model_path

WORDS = ["apple", "river", "stone", "cloud", "music", "garden", "window", "paper", "market"]


def pairs(words):
    return Dataset.from_list([{"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.",
                               "rejected": f" The {w} is bad."} for w in words])


def trainer(tmp_path, data, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to="none",
                  save_strategy="no", seed=0, max_length=64)
    return KTOTrainer(str(tiny_model_path()), args=KTOConfig(**{**values, **overrides}), train_dataset=data)


@pytest.mark.parametrize("prompts, batch, expected", [
    ("abc", 3, [2, 0, 1]),  # distinct prompts: rotation by one, as TRL
    ("aabbccdd", 4, [2, 3, 0, 1, 6, 7, 4, 5]),  # pairs: rotation by two, within each batch
    ("aabbcc", 4, [2, 3, 0, 1, 3, 3]),  # a last batch of one prompt borrows the nearest earlier other prompt
    ("aabb", 2, [3, 3, 1, 1]),
    ("abab", 1, [3, 0, 1, 2]),  # batches of one row
    ("aab", 3, [2, 2, 1]),  # no rotation of "aab" clears both a's
    ("aaa", 3, [2, 0, 1]),  # one prompt throughout: another row's completion
])
def test_partners_by_hand(prompts, batch, expected, caplog):
    with caplog.at_level(logging.WARNING, logger="plait"):
        assert mismatched_partners([[ord(c)] for c in prompts], batch) == expected
    assert ("every row has the same prompt" in caplog.text) == (len(set(prompts)) == 1)


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8])
def test_paired_data_never_pairs_a_prompt_with_its_own_completion(tmp_path, batch):
    data = trainer(tmp_path, pairs(WORDS), per_device_train_batch_size=batch).train_dataset
    rows = [data[i] for i in range(len(data))]
    assert [r["label"] for r in rows] == [True, False] * len(WORDS)
    for row in rows:
        own = [r["completion_ids"] for r in rows if r["prompt_ids"] == row["prompt_ids"]]
        assert len(own) == 2 and row["kl_completion_ids"] not in own
    if batch in (4, 8):  # a full batch of two or more whole pairs: its mismatched completions are its own
        for start in range(0, len(rows) - batch + 1, batch):
            block = rows[start:start + batch]
            assert sorted(r["kl_completion_ids"] for r in block) == sorted(r["completion_ids"] for r in block)
    # fixed when the data is prepared: the same for another seed, and what the batches carry
    again = trainer(tmp_path, pairs(WORDS), per_device_train_batch_size=batch, seed=1).train_dataset
    assert again["kl_completion_ids"] == data["kl_completion_ids"]


def test_sampling_is_sequential_by_default_and_random_keeps_each_rows_partner(tmp_path):
    sequential = trainer(tmp_path, pairs(WORDS[:4]))
    assert sequential.args.train_sampling_strategy == "sequential"
    assert isinstance(sequential._get_train_sampler(), SequentialSampler)
    first = next(iter(sequential.get_train_dataloader()))
    rows = [sequential.train_dataset[i] for i in range(4)]
    expected = sequential.data_collator(rows)
    assert first["kl_input_ids"].tolist() == expected["kl_input_ids"].tolist()

    shuffled = trainer(tmp_path, pairs(WORDS[:4]), train_sampling_strategy="random", padding_free=False)  # rows read one by one
    assert isinstance(shuffled._get_train_sampler(), RandomSampler)
    batch = next(iter(shuffled.get_train_dataloader()))
    data = shuffled.train_dataset
    for ids, mask, kl_ids, kl_mask in zip(batch["input_ids"], batch["attention_mask"], batch["kl_input_ids"],
                                          batch["kl_attention_mask"]):
        row = next(r for r in data if r["prompt_ids"] + r["completion_ids"] == ids[mask.bool()].tolist())
        assert kl_ids[kl_mask.bool()].tolist() == row["prompt_ids"] + row["kl_completion_ids"]


def test_long_rows_keep_their_start_and_stay(tmp_path):
    """Token lists from the tiny tokenizer (EOS = 4), the same TRL 1.16 produces for these rows."""
    data = Dataset.from_list([
        {"prompt": "The sky is", "completion": " very blue today.", "label": True},  # 5 + 9 tokens
        {"prompt": "Sky:", "completion": " red", "label": False},  # 4 + 3
        {"prompt": "one two three four", "completion": " a", "label": True},  # a 10-token prompt: dropped
        {"prompt": "Sky:", "completion": " the sky is blue and the sea is green", "label": False},  # 4 + 17
    ])
    t = trainer(tmp_path, data, max_length=8, per_device_train_batch_size=2, padding_free=False)  # TRL's padded rows
    rows = [t.train_dataset[i] for i in range(len(t.train_dataset))]
    assert [(r["prompt_ids"], r["completion_ids"]) for r in rows] == [
        ([927, 262, 79, 93, 857], [225, 345, 93]),
        ([55, 79, 93, 30], [322, 72, 4]),
        ([55, 79, 93, 30], [327, 262, 79, 93]),
    ]
    # batch [0, 1] swaps completions; row 2, alone in its batch, borrows row 0's (TRL: its own). A borrowed
    # completion is cut from its whole text to the borrowing prompt's room, as TRL cuts it: row 0's
    # " very blue today." keeps 3 tokens beside its own 5-token prompt, 4 beside a 4-token one
    assert [r["kl_completion_ids"] for r in rows] == [[322, 72, 4], [225, 345, 93, 272], [225, 345, 93, 272]]
    batch = t.data_collator(rows[:2])
    assert batch["input_ids"].tolist() == [[927, 262, 79, 93, 857, 225, 345, 93], [55, 79, 93, 30, 322, 72, 4, 0]]
    assert batch["kl_input_ids"].tolist() == [[927, 262, 79, 93, 857, 322, 72, 4], [55, 79, 93, 30, 225, 345, 93, 272]]
