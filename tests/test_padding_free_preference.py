"""Padding-free preference batches (DPO, KTO, the reward model): the sequences back to back in one
row, positions restarting per sequence, no pad tokens; the losses and gradients equal the padded path."""

import collections
import math
import random

import pytest
import torch
import transformers
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from plait import PlaitError, make_plugins
from plait.engine.attention import Segment, packed_segments, packs_per_sequence, shares_prefixes
from plait.engine.batches import PreferenceLogps
from plait.engine.layout import padded_length, row_token_logprobs, rows_from_flat
from plait.engine.logprobs import token_logprobs
from plait.plugins.methods.dpo import DPOConfig, DPOTrainer
from plait.plugins.methods.cpo import CPOConfig, CPOTrainer
from plait.plugins.methods.kto import KTOConfig, KTOTrainer
from plait.plugins.methods.orpo import ORPOConfig, ORPOTrainer
from plait.plugins.methods.reward_model import RewardConfig, RewardTrainer
from plait.testing.tiny_model import noisy_tiny_model, tiny_model_path

TOK = AutoTokenizer.from_pretrained(tiny_model_path())
COLLATORS = make_plugins().collators
ids = st.lists(st.integers(5, 999), min_size=1, max_size=12)


def collate(name, examples, **options):
    return COLLATORS.get(name).obj(TOK, **options)(examples)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(ids, ids, ids), min_size=1, max_size=5), st.sampled_from([None, 1, 8]))
def test_one_row_holds_every_sequence_and_maps_back_to_the_padded_rows(triples, multiple):
    examples = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r, "ref_chosen_logps": -1.0 * i, "ref_rejected_logps": -2.0}
                for i, (p, c, r) in enumerate(triples)]
    flat = collate("collator.preference_padding_free", examples, pad_to_multiple_of=multiple)
    padded = collate("collator.preference", examples)
    sequences = [p + c for p, c, _ in triples] + [p + r for p, _, r in triples]
    total = sum(map(len, sequences))

    assert flat["input_ids"].shape[0] == 1 and "attention_mask" not in flat
    assert flat["input_ids"][0, :total].tolist() == [t for s in sequences for t in s]
    assert flat["position_ids"][0, :total].tolist() == [i for s in sequences for i in range(len(s))]
    width = flat["input_ids"].shape[1]
    assert width - total < (multiple or 1) and width % (multiple or 1) == 0  # rounding only, as one extra sequence
    assert flat["position_ids"][0, total:].tolist() == list(range(width - total))
    assert flat["seq_lengths"].tolist() == list(map(len, sequences))
    # the per-row layout is the padded collator's: completion masks, and every token back in its row
    torch.testing.assert_close(flat["completion_mask"], padded["completion_mask"])
    back = rows_from_flat(flat["input_ids"], flat["seq_lengths"], padded["input_ids"].shape[1])
    torch.testing.assert_close(back, padded["input_ids"] * padded["attention_mask"])
    torch.testing.assert_close(flat["ref_chosen_logps"], padded["ref_chosen_logps"])


def contexts(ids: list[int], positions: list[int]) -> list[list[int]]:
    """What each token of a packed row attends to, as plait_sdpa reads the row (plait.engine.attention.packed_segments)."""
    segments = packed_segments(torch.tensor([positions]), len(ids)) or [Segment(0, len(ids), 0, 0)]
    out = []
    for s in segments:
        prefix = ids[segments[s.root].start:segments[s.root].start + s.prefix]
        out += [prefix + ids[s.start:s.start + k + 1] for k in range(s.size)]
    return out


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([[], [7], [7, 8, 9], [9, 8, 7, 6]]), ids, st.lists(st.integers(0, 999), max_size=6)),
                min_size=1, max_size=5), st.sampled_from([None, 1, 8]))
def test_prefix_shared_rows_map_back_to_the_padded_rows_each_prompt_held_once(triples, multiple):
    examples = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r, "margin": 1.0 * i} for i, (p, c, r) in enumerate(triples)]
    shared = collate("collator.preference_prefix_shared", examples, pad_to_multiple_of=multiple)
    padded = collate("collator.preference", examples)
    rows = [p + c for p, c, _ in triples] + [p + r for p, _, r in triples]
    ids, positions = shared["input_ids"][0].tolist(), shared["position_ids"][0].tolist()
    # every token of every row attends to exactly its own row's tokens up to it, at its own position
    seen = contexts(ids, positions)
    for i, row in enumerate(rows):
        for j, place in enumerate(shared["seq_index"][i, :len(row)].tolist()):
            assert positions[place] == j and seen[place] == row[:j + 1]
    # each distinct prompt once, but its last token in each later row that shares it (a rejected row
    # of only padding to read is laid out whole); rounding: one more sequence of padding
    pad_id, first = TOK.pad_token_id, {}
    for row, (p, _, _) in zip(rows, triples * 2):
        first.setdefault(tuple(p), row)
    held = sum(len(p) - 1 for row, (p, _, _) in zip(rows, triples * 2)
               if first[tuple(p)] is not row and len(p) > 1 and any(t != pad_id for t in row[len(p) - 1:]))
    total = sum(map(len, rows)) - held
    assert len(ids) == padded_length(total, multiple) and positions[total:] == list(range(len(ids) - total))
    torch.testing.assert_close(shared["completion_mask"], padded["completion_mask"])
    assert shared["seq_lengths"].tolist() == padded["attention_mask"].sum(1).tolist()
    back = rows_from_flat(shared["input_ids"], shared["seq_lengths"], padded["input_ids"].shape[1], index=shared["seq_index"])
    torch.testing.assert_close(back, padded["input_ids"] * padded["attention_mask"])
    assert shared["margin"].tolist() == [1.0 * i for i in range(len(triples))]


def test_rows_from_flat_by_hand_and_its_gradient():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0]], requires_grad=True)  # 9.0: rounding tail
    rows = rows_from_flat(values, torch.tensor([2, 1, 3]), width=4)
    assert rows.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 0]]
    (rows * torch.arange(1.0, 5.0)).sum().backward()
    assert values.grad.tolist() == [[1, 2, 1, 1, 2, 3, 0]]
    # a row may borrow another's tokens (a rejected row's prompt): gradients add up where they meet
    values.grad = None
    rows = rows_from_flat(values, torch.tensor([3, 3]), width=3, index=torch.tensor([[0, 1, 2], [0, 3, 4]]))
    assert rows.tolist() == [[1, 2, 3], [1, 4, 5]]
    (rows * torch.arange(1.0, 4.0)).sum().backward()
    assert values.grad.tolist() == [[2, 2, 3, 2, 3, 0, 0]]


def variable_pairs(n, seed=0):
    """Prompts and completions of very different lengths, so padding is a large share of a padded batch."""
    rng = random.Random(seed)
    words = "apple river stone cloud music garden window paper market forest".split()
    text = lambda k: " ".join(rng.choices(words, k=k))  # noqa: E731
    return Dataset.from_list([{"prompt": "Tell me " + text(rng.randint(1, 12)), "chosen": " " + text(rng.randint(1, 15)),
                               "rejected": " " + text(rng.randint(1, 15))} for _ in range(n)])


LAYOUTS = {"padded": {"padding_free": False}, "padding-free": {"padding_free": True, "prefix_sharing": False},
           "prompts shared": {"padding_free": True, "prefix_sharing": True}}


def trainer(tmp_path, layout, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3,
                  report_to="none", save_strategy="no", seed=0, max_length=64, logging_steps=1, **LAYOUTS[layout])
    # a reference other than the policy, so log-ratios and margins are not all zero
    return DPOTrainer(str(tiny_model_path()), ref_model=noisy_tiny_model(scale=0.05),
                      args=DPOConfig(**{**values, **overrides}), train_dataset=variable_pairs(8))


def loss_and_gradients(t):
    batch = t.data_collator([t.train_dataset[i] for i in range(len(t.train_dataset))])
    t.model.train()
    t.model.zero_grad()
    loss = t.compute_loss(t.model, batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in t.model.named_parameters()}, batch


@pytest.mark.parametrize("overrides", [
    {},
    {"loss_type": ["sigmoid", "sft", "ipo"], "loss_weights": [1.0, 0.5, 0.2]},  # summed log-probs and lengths
    {"ld_alpha": 0.5},  # per-token weights past the shorter completion
    {"use_weighting": True},  # WPO: per-token collision log-probs
    {"pad_to_multiple_of": 16},
], ids=["sigmoid", "composed", "ld_alpha", "wpo", "multiple"])
@pytest.mark.parametrize("layout", ["padding-free", "prompts shared"])
def test_dpo_loss_and_gradients_equal_the_padded_path(tmp_path, overrides, layout):
    padded_loss, padded_grads, padded_batch = loss_and_gradients(trainer(tmp_path, "padded", **overrides))
    free_loss, free_grads, free_batch = loss_and_gradients(trainer(tmp_path, layout, **overrides))
    # the layouts really differ: 2B padded rows against one row with no pad token (and each prompt once)
    assert padded_batch["input_ids"].shape[0] == 16 and free_batch["input_ids"].shape[0] == 1
    assert free_batch["seq_lengths"].sum() < 0.8 * padded_batch["input_ids"].numel()
    held = free_batch["seq_lengths"].sum() - free_batch["input_ids"].shape[1]  # tokens held once for two rows
    assert held >= 8 * 2 - 15 if layout == "prompts shared" else held <= 0  # 8 prompts of 3+ tokens; a rounding tail
    assert padded_loss.item() != pytest.approx(math.log(2), abs=1e-3)  # a real margin, not the zero-margin value
    torch.testing.assert_close(free_loss, padded_loss, atol=1e-5, rtol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(free_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert any(grad.abs().max() > 1e-3 for grad in padded_grads.values())


@pytest.mark.parametrize("layout", ["padding-free", "prompts shared"])
def test_training_steps_and_cached_reference_equal_the_padded_path(tmp_path, layout):
    runs = {}
    for name in ("padded", layout):
        t = trainer(tmp_path / name, name, precompute_ref_log_probs=True)
        runs[name] = t.train_dataset, t
        t.train()
    (padded_data, padded), (free_data, free) = runs["padded"], runs[layout]
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        torch.testing.assert_close(torch.tensor(free_data[column]), torch.tensor(padded_data[column]), atol=1e-5, rtol=0)
    logged = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (padded, free)]
    assert len(logged[0]) == 3 and logged[1] == pytest.approx(logged[0], abs=1e-5)
    for (name, a), b in zip(padded.model.named_parameters(), free.model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=name)


REFERENCE_FREE = {"orpo": (ORPOTrainer, ORPOConfig), "cpo": (CPOTrainer, CPOConfig)}


@pytest.mark.parametrize("layout", ["padding-free", "prompts shared"])
@pytest.mark.parametrize("method", sorted(REFERENCE_FREE))
def test_orpo_and_cpo_loss_gradients_and_metrics_equal_the_padded_path(tmp_path, method, layout):
    # ORPO's NLL reads the chosen rows' whole sequences (prompts included), CPO's their completions
    trainer_class, config_class = REFERENCE_FREE[method]
    runs = {}
    for name in ("padded", layout):
        args = config_class(output_dir=str(tmp_path / name), per_device_train_batch_size=4, report_to="none",
                            save_strategy="no", max_length=64, beta=0.5, **LAYOUTS[name])
        t = trainer_class(str(tiny_model_path()), args=args, train_dataset=variable_pairs(8))
        assert (t.padding_free, t.prefix_sharing) == (name != "padded", name == "prompts shared")
        runs[name] = loss_and_gradients(t), {k: v[-1] for k, v in t._metrics["train"].items()}
    ((padded_loss, padded_grads, padded_batch), padded_metrics), ((free_loss, free_grads, free_batch), free_metrics) = (
        runs.values())
    assert {"nll_loss", "logits/chosen", "rewards/margins"} <= padded_metrics.keys()  # logged alike: the mean logits too
    assert free_metrics == pytest.approx(padded_metrics, abs=1e-4)
    assert padded_batch["input_ids"].shape[0] == 16 and free_batch["input_ids"].shape[0] == 1
    assert free_batch["input_ids"].numel() < 0.8 * padded_batch["input_ids"].numel()
    torch.testing.assert_close(free_loss, padded_loss, atol=1e-5, rtol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(free_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert any(grad.abs().max() > 1e-3 for grad in padded_grads.values())


# Llama is the tiny model's architecture (and SmolLM2's: tied embeddings, 64-wide heads); the
# others read document boundaries from position_ids the same way in transformers 5.
ARCHITECTURES = {
    "smollm2-like llama": transformers.LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "qwen2": transformers.Qwen2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "mistral (sliding window)": transformers.MistralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


@pytest.mark.parametrize("attention", ["sdpa", "eager", "plait_sdpa", "plait_sdpa, prompts shared"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_packed_rows_give_each_sequence_its_own_log_probs(architecture, attention):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES[architecture],
                                                          attn_implementation=attention.removeprefix("plait_").split(",")[0])
    if attention.startswith("plait_sdpa"):
        assert packs_per_sequence(model) and model.config._attn_implementation == "plait_sdpa"
    sharing = attention.endswith("prompts shared")
    assert shares_prefixes(model) is (attention.startswith("plait_sdpa") and "sliding" not in architecture)
    if sharing and not shares_prefixes(model):
        pytest.skip("a sliding window's mask keeps each segment to itself: plait shares no prompt there")
    rng = random.Random(1)
    examples = [{"prompt_ids": [rng.randrange(5, 1000) for _ in range(rng.randint(1, 9))],
                 "chosen_ids": [rng.randrange(5, 1000) for _ in range(rng.randint(1, 12))],
                 "rejected_ids": [rng.randrange(5, 1000) for _ in range(rng.randint(1, 12))]} for _ in range(3)]
    padded = collate("collator.preference", examples)
    free = collate("collator.preference_prefix_shared" if sharing else "collator.preference_padding_free", examples)
    with torch.no_grad():
        expected = row_token_logprobs(token_logprobs, model, padded, with_entropy=True)
        got = row_token_logprobs(token_logprobs, model, free, with_entropy=True)
    # a row's first token has no log-prob in either layout, nor, prompts shared, a rejected row's prompt
    real = padded["completion_mask"].bool() if sharing else padded["attention_mask"].bool()
    real[:, 0] = False
    for field in ("logps", "entropy"):
        torch.testing.assert_close(getattr(got, field)[real], getattr(expected, field)[real], atol=1e-5, rtol=1e-5)


def test_discopop_tau_reaches_the_loss(tmp_path):
    t = DPOTrainer(str(tiny_model_path()), train_dataset=variable_pairs(4),
                   args=DPOConfig(output_dir=str(tmp_path), loss_type="discopop", discopop_tau=0.2, beta=0.5,
                                  report_to="none"))
    assert t.objective.params_of("dpo.discopop").discopop_tau == 0.2
    zero = torch.zeros(1)
    batch = PreferenceLogps(torch.tensor([-3.0]), torch.tensor([-5.0]), zero, zero, zero + 1, zero + 1)
    z = 0.5 * 2.0  # β·Δ
    m = 1 / (1 + math.exp(-z / 0.2))
    expected = (1 - m) * math.log1p(math.exp(-z)) + m * math.exp(-z)
    assert t.objective(batch)[0].item() == pytest.approx(expected, rel=1e-6)
    assert DPOConfig(output_dir=str(tmp_path)).discopop_tau == 0.05  # TRL 1.16's default


def unpaired_rows(n, seed=0, both_sides=False):
    """One row per pair (its chosen or its rejected completion), or (``both_sides``) both rows of each pair."""
    pairs = variable_pairs(n // 2 if both_sides else n, seed)
    sides = [(r, i % 2 == 1) for i, r in enumerate(pairs)] if not both_sides else [(r, good) for r in pairs for good in (True, False)]
    return Dataset.from_list([{"prompt": r["prompt"], "completion": r["chosen" if good else "rejected"], "label": good}
                              for r, good in sides])


def kto_trainer(tmp_path, padding_free, both_sides=False, **overrides):
    args = KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, report_to="none", save_strategy="no",
                     max_length=64, padding_free=padding_free, **overrides)
    return KTOTrainer(str(tiny_model_path()), ref_model=noisy_tiny_model(scale=0.05), args=args,
                      train_dataset=unpaired_rows(8, both_sides=both_sides))


def kto_trainer_unshared(tmp_path, padding_free):
    return kto_trainer(tmp_path, padding_free, prefix_sharing=False)


def kto_trainer_both_sides(tmp_path, padding_free):
    # rows of one prompt in one batch: each side (rows, mismatched pairs) shares it too
    return kto_trainer(tmp_path, padding_free, both_sides=True)


def reward_trainer_unshared(tmp_path, padding_free):
    return reward_trainer(tmp_path, padding_free, prefix_sharing=False)


def reward_trainer(tmp_path, padding_free, **overrides):
    args = RewardConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, report_to="none", save_strategy="no",
                        max_length=64, padding_free=padding_free, center_rewards_coefficient=0.01, **overrides)
    return RewardTrainer(str(tiny_model_path()), args=args, train_dataset=variable_pairs(8))


def reward_trainer_eos_as_pad(tmp_path, padding_free):
    # SmolLM2's case: EOS is the pad token, so the classifier reads the token before each row's EOS
    return reward_trainer(tmp_path, padding_free, pad_token="<|im_end|>")


def test_reward_pooled_positions_by_hand():
    from plait.plugins.methods.reward_model import pooled_positions

    ids = torch.tensor([5, 6, 2, 7, 2, 2, 8, 9, 2])  # sequences [5 6 2] [7 2] [2] [8 9 2 ...] of lengths 3, 2, 1, 3
    lengths = torch.tensor([3, 2, 1, 3])
    assert pooled_positions(ids, lengths, pad_id=2).tolist() == [1, 3, 5, 7]  # an all-pad sequence: its first token
    assert pooled_positions(ids, lengths, pad_id=None).tolist() == [2, 4, 5, 8]
    # prompts shared: [5 6 2 7] then the branch [6 2] of a row [5 6 2]; its pad-only end reads the 6 in the branch
    ids = torch.tensor([5, 6, 2, 7, 6, 2])
    index = torch.tensor([[0, 1, 2, 3], [0, 4, 5, 0]])
    assert pooled_positions(ids, torch.tensor([4, 3]), pad_id=2, index=index).tolist() == [3, 4]


@pytest.mark.parametrize("make", [kto_trainer, kto_trainer_unshared, kto_trainer_both_sides, reward_trainer,
                                  reward_trainer_unshared, reward_trainer_eos_as_pad],
                         ids=["kto", "kto, prompts not shared", "kto, both sides of each pair", "reward_model",
                              "reward_model, prompts not shared", "reward_model, EOS as pad"])
def test_kto_and_reward_model_losses_and_gradients_equal_the_padded_path(tmp_path, make):
    padded_loss, padded_grads, padded_batch = loss_and_gradients(make(tmp_path, False))
    free_trainer = make(tmp_path, None)
    assert free_trainer.padding_free  # the default, on the tiny Llama
    free_loss, free_grads, free_batch = loss_and_gradients(free_trainer)
    assert padded_batch["input_ids"].shape[0] > 1 and free_batch["input_ids"].shape[0] == 1
    assert free_batch["input_ids"].numel() < 0.8 * padded_batch["input_ids"].numel()
    torch.testing.assert_close(free_loss, padded_loss, atol=1e-5, rtol=0)
    if isinstance(free_trainer, KTOTrainer) and free_trainer.prefix_sharing:  # its reference reads a row and its pair over one prompt
        counts = collections.Counter(tuple(row["prompt_ids"]) for row in free_trainer.train_dataset)
        # every row and every mismatched pair whole, less each repeat of a prompt (all but its last token)
        held = free_batch["both_seq_lengths"].sum().item() - sum((2 * n - 1) * (len(p) - 1) for p, n in counts.items())
        assert free_batch["both_input_ids"].shape[1] == held
    for name, grad in padded_grads.items():
        torch.testing.assert_close(free_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert any(grad.abs().max() > 1e-3 for grad in padded_grads.values())


def test_reward_model_padding_free_needs_a_per_token_score_head(tmp_path):
    config = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, num_labels=1, pad_token_id=0)
    head = transformers.BertForSequenceClassification(config)  # pools through `classifier`, inside its forward
    assert reward_trainer_with(tmp_path, head, None).padding_free is False
    with pytest.raises(PlaitError, match=r"padding_free=True needs a classifier with a per-token `score` head; "
                                         r"BertForSequenceClassification has none: set padding_free=False"):
        reward_trainer_with(tmp_path, head, True)


def reward_trainer_with(tmp_path, model, padding_free):
    args = RewardConfig(output_dir=str(tmp_path), report_to="none", max_length=64, padding_free=padding_free)
    return RewardTrainer(model, args=args, train_dataset=variable_pairs(2), processing_class=TOK)


@pytest.mark.parametrize("overrides, message", [
    ({"padding_free": False, "prefix_sharing": True},
     r"prefix_sharing=True shares prompts within a padding-free batch, and this run's batches are padded: set "
     r"padding_free=True \(or None\), or prefix_sharing=None"),
    ({"padding_free": True, "prefix_sharing": True, "model_init_kwargs": {"attn_implementation": "eager"}},
     r"prefix_sharing=True needs attn_implementation='plait_sdpa' \(no sliding window\), which attends a branch to "
     r"its prompt; the model has 'eager': set prefix_sharing=None"),
])
def test_prefix_sharing_asked_for_where_it_cannot_run_is_one_line(tmp_path, overrides, message):
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", **overrides)
    with pytest.raises(PlaitError, match=message):
        DPOTrainer(str(tiny_model_path()), args=args, train_dataset=variable_pairs(2))
    eager = {"padding_free": True, "model_init_kwargs": {"attn_implementation": "eager"}}
    assert DPOTrainer(str(tiny_model_path()), args=DPOConfig(output_dir=str(tmp_path), report_to="none", **eager),
                      train_dataset=variable_pairs(2)).prefix_sharing is False  # None: shared only where it can be
