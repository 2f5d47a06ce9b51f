"""Padding-free rollouts (GRPO, RLOO, online DPO): a rollout's rows, left-padded prompts then
right-padded completions, computed with their real tokens back to back in one row; log-probs,
losses and gradients equal the padded path, and training follows the same course."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import plait
from plait import PlaitError
from plait.engine.logprobs import token_logprobs
from plait.online.buffer import pack
from plait.online.chassis import packed_token_logprobs
from plait.testing.tiny_model import noisy_tiny_model, tiny_model_path

PROMPTS = [{"prompt": p} for p in ("The river", "A good answer to the question of the day", "What is 7 plus 5?",
                                   "Python is", "The weather today in the mountains north of here", "Numbers",
                                   "The children of the village by the sea", "Nobody could")]
MODEL = AutoModelForCausalLM.from_pretrained(tiny_model_path()).eval()
ids = st.lists(st.integers(5, 999), min_size=0, max_size=10)


def low_tokens(completion_ids, **kwargs):
    return [float(sum(t < 100 for t in row)) for row in completion_ids]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(ids.filter(bool), ids), min_size=1, max_size=4), st.sampled_from([None, 4]))
def test_packed_rows_give_the_padded_rows_log_probs_and_entropies(rows, multiple):
    batch = pack([p for p, _ in rows], [c for _, c in rows], pad_id=0, device="cpu", multiple=multiple)
    width = batch["prompt_length"]
    select = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    select[:, width:] = True
    kwargs = dict(temperature=0.7, with_entropy=True, select=select)
    padded = token_logprobs(MODEL, batch["input_ids"], batch["attention_mask"], **kwargs)
    flat = packed_token_logprobs(token_logprobs, MODEL, batch["input_ids"], batch["attention_mask"], **kwargs)
    mask = batch["completion_mask"].bool()
    for name in ("logps", "entropy"):
        mine, theirs = getattr(flat, name)[:, width:], getattr(padded, name)[:, width:]
        torch.testing.assert_close(mine[mask], theirs[mask], atol=2e-5, rtol=1e-5)
        assert torch.all(mine[~mask] == 0)  # padding holds nothing



@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(ids.filter(bool), st.lists(ids, min_size=1, max_size=3)), min_size=1, max_size=3))
def test_a_groups_prompt_is_computed_once_for_the_same_log_probs(groups):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path()).eval()
    assert plait.engine.attention.packs_per_sequence(model)  # plait_sdpa: it reads a branch
    prompts = [p for p, completions in groups for _ in completions]
    completions = [c for _, completions in groups for c in completions]
    batch = pack(prompts, completions, pad_id=0, device="cpu")
    width = batch["prompt_length"]
    select = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    select[:, width:] = True
    kwargs = dict(temperature=0.7, with_entropy=True, select=select)
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    with torch.no_grad():
        padded = token_logprobs(model, batch["input_ids"], batch["attention_mask"], **kwargs)
        flat = packed_token_logprobs(token_logprobs, model, batch["input_ids"], batch["attention_mask"],
                                     share_prompts=True, **kwargs)
    handle.remove()
    # each distinct prompt once, and its last token once more in each further completion of it
    distinct = {tuple(p): len(p) for p in prompts}
    assert seen[-1] == sum(distinct.values()) + len(prompts) - len(distinct) + sum(map(len, completions))
    mask = batch["completion_mask"].bool()
    for name in ("logps", "entropy"):
        mine, theirs = getattr(flat, name)[:, width:], getattr(padded, name)[:, width:]
        torch.testing.assert_close(mine[mask], theirs[mask], atol=2e-5, rtol=1e-5)
        assert torch.all(mine[~mask] == 0)

def test_one_forward_over_the_real_tokens_with_positions_restarting():
    seen = {}

    def record(module, args, kwargs):
        seen.update(input_ids=kwargs["input_ids"], position_ids=kwargs.get("position_ids"),
                    attention_mask=kwargs.get("attention_mask"))

    batch = pack([[7, 8, 9], [5]], [[10, 11], [12, 13, 14]], pad_id=0, device="cpu")
    handle = MODEL.register_forward_pre_hook(record, with_kwargs=True)
    try:
        packed_token_logprobs(token_logprobs, MODEL, batch["input_ids"], batch["attention_mask"])
    finally:
        handle.remove()
    assert seen["input_ids"].tolist() == [[7, 8, 9, 10, 11, 5, 12, 13, 14]]
    assert seen["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]] and seen["attention_mask"] is None


def trainer(method="GRPO", padding_free=None, model=None, **overrides):
    values = dict(output_dir="/tmp/plait-test-padding-free-online", per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=8, learning_rate=1e-2, max_steps=2, logging_steps=1, report_to=[],
                  save_strategy="no", disable_tqdm=True, seed=0, padding_free=padding_free, beta=0.04)
    config, cls = getattr(plait, f"{method}Config"), getattr(plait, f"{method}Trainer")
    return cls(model or str(tiny_model_path()), reward_funcs=low_tokens, args=config(**{**values, **overrides}),
               train_dataset=PROMPTS * 2)


def test_on_by_default_where_attention_runs_per_sequence_and_forced_either_way():
    assert trainer().padding_free and trainer("RLOO").padding_free
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_path(), attn_implementation="eager")
    assert not trainer(model=eager).padding_free  # eager would attend the whole packed row
    assert not trainer(padding_free=False).padding_free
    assert trainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path(), attn_implementation="eager"),
                   padding_free=True).padding_free


@pytest.mark.parametrize("method, overrides", [("GRPO", {}), ("GRPO", {"loss_type": "grpo", "num_iterations": 2}),
                                               ("RLOO", {})])
def test_rollout_and_loss_and_gradients_equal_the_padded_path(method, overrides):
    t = trainer(method, **overrides)
    assert t.padding_free
    t.model.train()
    t.current_gradient_accumulation_steps = 1  # train() sets it
    rows = t.data_collator([t.train_dataset[i] for i in range(8)])
    torch.manual_seed(0)
    flat = t.rollout(rows)
    t.padding_free = False
    torch.manual_seed(0)
    padded = t.rollout(rows)
    assert torch.equal(flat["input_ids"], padded["input_ids"])  # the same samples: generation is plain sdpa
    assert flat["attention_mask"].sum(-1).min() < flat["attention_mask"].shape[1]  # rows are padded
    for key in ("ref_logps", "old_logps", "advantages"):
        if key in padded:
            torch.testing.assert_close(flat[key], padded[key], atol=2e-5, rtol=1e-5)

    def loss_and_grads(padding_free):
        t.padding_free = padding_free
        t.model.zero_grad()
        loss = t.compute_loss(t.model, padded)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in t.model.parameters() if p.grad is not None]

    (loss_flat, grads_flat), (loss_padded, grads_padded) = loss_and_grads(True), loss_and_grads(False)
    torch.testing.assert_close(loss_flat, loss_padded, atol=1e-6, rtol=1e-5)
    for mine, theirs in zip(grads_flat, grads_padded, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


def test_online_dpo_pairs_equal_the_padded_path():
    pairs = [{"prompt": p["prompt"]} for p in PROMPTS]
    args = plait.OnlineDPOConfig(output_dir="/tmp/plait-test-padding-free-online-dpo", per_device_train_batch_size=4,
                                 max_new_tokens=8, report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
    t = plait.OnlineDPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=args, train_dataset=pairs,
                               ref_model=noisy_tiny_model(scale=0.05))
    assert t.padding_free
    batch = pack([[7, 8, 9], [5], [7, 8, 9], [5]], [[10, 11], [12, 13, 14], [15], []], pad_id=0, device="cpu")
    flat = t.logps_of(t.model, batch)
    t.padding_free = False
    padded = t.logps_of(t.model, batch)
    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(flat[mask], padded[mask], atol=2e-5, rtol=1e-5)


def test_training_follows_the_padded_course():
    runs = {}
    for padding_free in (True, False):
        t = trainer(padding_free=padding_free)
        t.train()
        runs[padding_free] = ([h["loss"] for h in t.state.log_history if "loss" in h],
                              [p.detach().clone() for p in t.model.parameters()])
    (losses_flat, weights_flat), (losses_padded, weights_padded) = runs[True], runs[False]
    assert len(losses_flat) == 2
    assert losses_flat == pytest.approx(losses_padded, abs=1e-5)
    # Adam divides each step by the gradient's own scale, so a rounding-level gradient difference
    # on a near-zero gradient moves its weight by up to a fraction of lr (0.01): 1.2e-5 seen once
    for mine, theirs in zip(weights_flat, weights_padded, strict=True):
        torch.testing.assert_close(mine, theirs, atol=5e-5, rtol=1e-4)


def test_images_refuse_padding_free_before_training():
    from plait.testing.tiny_vlm import tiny_vlm_path  # noqa: PLC0415 - only this test needs a VLM

    with pytest.raises(PlaitError, match="padding_free=True cannot hold images.*set padding_free=False"):
        trainer(model=str(tiny_vlm_path()), padding_free=True)
