"""RLOO: the KL-penalised reward with a leave-one-out baseline, by hand, and learning on the tiny model."""

import pytest
import torch

import plait
from plait.errors import PlaitError
from plait.testing.tiny_model import tiny_model_path

PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is",
                                   "The weather today", "Numbers such as", "The children", "Nobody could")]


def low_tokens(completion_ids, **kwargs):
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]


def config(**overrides):
    values = dict(output_dir="/tmp/plait-test-rloo", per_device_train_batch_size=8, max_completion_length=6,
                  learning_rate=1e-2, max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
                  disable_tqdm=True, seed=0)
    return plait.RLOOConfig(**{**values, **overrides})


def trainer(**overrides):
    return plait.RLOOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=config(**overrides),
                             train_dataset=PROMPTS * 4)


def test_defaults_follow_trl():
    p = config().params
    assert (p.num_generations, p.beta, p.epsilon, p.normalize_advantages, p.reward_clip_range) == (2, 0.05, 0.2, False, None)
    with pytest.raises(PlaitError, match="reward_clip_range=.1, 0. must be .low, high."):
        config(reward_clip_range=[1, 0])
    with pytest.raises(PlaitError, match="num_generations=1"):
        config(num_generations=1)


def test_kl_penalised_leave_one_out_advantages_by_hand():
    t = trainer(num_generations=2, beta=0.5)
    assert t.reference.model is not None and t.objective.names == ["rloo.clip"]
    rewards = torch.tensor([[1.0], [3.0], [2.0], [2.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    old = torch.tensor([[-1.0, -1.0], [-2.0, -7.0], [-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.5], [-1.0, -9.0], [-1.0, -1.0], [-2.0, -2.0]])
    # Σ_t m·(old − ref) = 1.0, −1.0 (the masked token does not count), 0.0, 2.0
    # R − β·KL = 0.5, 3.5, 2.0, 1.0; leave-one-out with G = 2: A_i = R_i − R_j
    advantages = t.advantages(rewards, batch={"completion_mask": mask}, old_logps=old, ref_logps=ref)
    assert torch.allclose(advantages, torch.tensor([-3.0, 3.0, 1.0, -1.0]))


def test_reward_clip_range_and_normalisation():
    t = trainer(num_generations=2, beta=0.0, reward_clip_range=[0.0, 2.5], normalize_advantages=True)
    assert t.reference.model is None  # beta = 0: no reference
    rewards = torch.tensor([[-4.0], [1.0], [5.0], [2.0]])  # clipped to 0, 1, 2.5, 2 -> A = −1, 1, 0.5, −0.5
    advantages = t.advantages(rewards, batch={}, old_logps=None, ref_logps=None)
    raw = torch.tensor([-1.0, 1.0, 0.5, -0.5])
    assert torch.allclose(advantages, (raw - raw.mean()) / (raw.std() + 1e-4), atol=1e-5)


def test_old_log_probs_are_computed_for_the_kl_penalty():
    t = trainer(num_generations=2)
    assert t.needs_old_logps()
    out = t.rollout(t.data_collator([t.train_dataset[i] for i in [0, 0, 1, 1, 2, 2, 3, 3]]))
    assert out["old_logps"].shape == out["ref_logps"].shape == out["completion_mask"].shape


def test_rloo_raises_the_reward_on_the_tiny_model():
    torch.manual_seed(0)
    t = trainer(per_device_train_batch_size=16, num_generations=8, max_completion_length=8, max_steps=30,
                logging_steps=5)
    t.train()
    rewards = [h["reward"] for h in t.state.log_history if "reward" in h]
    print("RLOO reward per 5 steps:", [round(r, 3) for r in rewards])
    assert rewards[0] < 1.5
    assert rewards[-1] > 2.0 and rewards[-1] > 2.5 * rewards[0]
    assert [h["kl"] for h in t.state.log_history if "kl" in h][-1] > 0
