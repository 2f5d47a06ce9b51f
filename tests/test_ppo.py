"""PPO: the clipped policy and value losses by hand, the kit's contracts, reward shaping in a rollout,
the adaptive KL controller, bad inputs, checkpoints, learning on the tiny model, and the CLI."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from plait import PlaitError, hookimpl, make_plugins
from plait.cli import main
from plait.engine.batches import PolicyTokens, ValueTokens
from plait.engine.logprobs import token_logprobs
from plait.engine.objective import Objective
from plait.losses.ppo_policy import PPOPolicyParams, ppo_policy
from plait.losses.ppo_value import PPOValueParams, ppo_value
from plait.plugins.methods.ppo import AdaptiveKLController, KLController, PPOConfig, PPOTrainer, whiten
from plait.testing import check_loss
from plait.testing.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
           "objective/scores", "policy/approxkl", "policy/clipfrac", "loss/policy_avg", "loss/value_avg",
           "val/clipfrac", "val/ratio", "val/num_eos_tokens")


# ---------------------------------------------------------------------------------------------
# The losses by hand
# ---------------------------------------------------------------------------------------------


def test_policy_loss_takes_the_pessimistic_branch():
    # ε = 0.2. (A, ρ): (1, 1.5) clipped to 1.2 → −1.2; (−1, 0.5) clipped to 0.8 → 0.8;
    # (1, 0.5) → max(−0.5, −0.8) = −0.5 unclipped; (−1, 1.5) → max(1.5, 1.2) = 1.5 unclipped.
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    logps = ratio.log().requires_grad_(True)
    batch = PolicyTokens(logps=logps, old_logps=torch.zeros(1, 4), advantages=torch.tensor([[1.0, -1.0, 1.0, -1.0]]),
                         mask=torch.ones(1, 4, dtype=torch.bool))
    loss = ppo_policy(batch, PPOPolicyParams(0.2))
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 0.8, -0.5, 1.5]]))
    loss.sum().backward()
    # clipped branches pass no gradient; unclipped ones pass −A·ρ (d/dlogπ of −A·exp(logπ − logπ_old))
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0, -0.5, 1.5]]))


def test_value_loss_clipping_cases():
    # ε_v = 0.2, V_old = 0.5 everywhere.
    # V=1.0, R=1.0: clip(V) = 0.7 → max(0, 0.09)/2 = 0.045 (moving past the clip gains nothing)
    # V=0.6, R=1.0: inside the range → 0.16/2 = 0.08
    # V=0.0, R=1.0: clip(V) = 0.3 → max(1.0, 0.49)/2 = 0.5
    # V=1.5, R=0.0: clip(V) = 0.7 → max(2.25, 0.49)/2 = 1.125
    values = torch.tensor([[1.0, 0.6, 0.0, 1.5]], requires_grad=True)
    batch = ValueTokens(values=values, old_values=torch.full((1, 4), 0.5), returns=torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
                        mask=torch.ones(1, 4, dtype=torch.bool))
    loss = ppo_value(batch, PPOValueParams(0.2))
    torch.testing.assert_close(loss, torch.tensor([[0.045, 0.08, 0.5, 1.125]]))
    loss.sum().backward()
    # the clipped branch is flat in V; the unclipped one has slope V − R
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.4, -1.0, 1.5]]))


def test_the_method_averages_each_loss_over_completion_tokens():
    plugins = make_plugins()
    objective = Objective.build([{"name": "value"}], plugins.losses, family="ppo", consumes=ValueTokens,
                                shared={"cliprange_value": 10.0})
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    batch = ValueTokens(values=torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]]), old_values=torch.zeros(2, 3),
                        returns=torch.zeros(2, 3), mask=mask)
    total, _ = objective(batch, mask=mask)
    torch.testing.assert_close(total, torch.tensor((0.5 + 2.0 + 4.5) / 3))  # ½V² over the three kept tokens


@pytest.mark.parametrize("name", ["ppo.policy", "ppo.value"])
def test_the_losses_pass_the_kits_contract(name):
    checked = check_loss(name, make_plugins())
    assert {"masked tokens ignored", "gradient reaches the policy", "finite output (float16 inputs)"} <= set(checked)


def test_whiten_over_the_mask():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = whiten(values, mask)
    kept = out[mask]
    assert abs(kept.mean().item()) < 1e-6 and abs(kept.std().item() - 1.0) < 1e-4 and bool((out[~mask] == 0).all())
    kept_mean = whiten(values, mask, shift_mean=False)[mask]
    assert abs(kept_mean.mean().item() - 2.0) < 1e-5 and abs(kept_mean.std().item() - 1.0) < 1e-4


def test_the_adaptive_kl_controller_follows_ziegler_et_al():
    controller = AdaptiveKLController(0.1, target=1.0, horizon=100)
    controller.observe(kl=2.0, episodes=10)  # error clip(2/1 − 1, ±0.2) = 0.2 → β·(1 + 0.2·10/100)
    assert controller.kl_coef == 0.1  # nothing changes inside a rollout...
    controller.on_step_end(None, None, None)
    assert controller.kl_coef == pytest.approx(0.102)  # ...only at the next step's end
    controller.on_step_end(None, None, None)
    assert controller.kl_coef == pytest.approx(0.102)
    controller.observe(kl=0.95, episodes=50)  # error −0.05 → β·(1 − 0.05·0.5)
    controller.on_step_end(None, None, None)
    assert controller.kl_coef == pytest.approx(0.102 * 0.975)


# ---------------------------------------------------------------------------------------------
# The method on the tiny model
# ---------------------------------------------------------------------------------------------


def prompts(start: int, stop: int) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say something about number {i}."}]}
                              for i in range(start, stop)])


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1,
                  max_steps=1, response_length=5, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                  report_to="none", seed=0, temperature=1.0)
    return PPOConfig(**{**values, **overrides})


def noisy_model():
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return model


def first_rollout(trainer) -> dict:
    inputs = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    return trainer.rollout(inputs)


@pytest.mark.parametrize("estimator, whiten_rewards", [("k1", False), ("k3", False), ("k1", True)])
def test_per_token_rewards_are_the_kl_penalty_plus_the_score_on_the_last_token(tmp_path, estimator, whiten_rewards):
    """With γ = λ = 1, GAE's returns are the rewards still to come: R_t = Σ_{k≥t} r_k, where
    r_k = −β·KL_k plus the score (less the missing-EOS penalty) on the last completion token."""
    kl_coef, penalty = 0.3, 0.25
    args = config(tmp_path, gamma=1.0, lam=1.0, kl_coef=kl_coef, kl_estimator=estimator, missing_eos_penalty=penalty,
                  whiten_rewards=whiten_rewards)
    trainer = PPOTrainer(str(tiny_model_path()), ref_model=noisy_model(), reward_model=constant_reward, args=args,
                         train_dataset=prompts(0, 8))
    buffer = first_rollout(trainer)
    width, mask = buffer["prompt_length"], buffer["completion_mask"].bool()
    ids, attention = buffer["input_ids"], buffer["attention_mask"]
    with torch.no_grad():
        policy = token_logprobs(trainer._policy, ids, attention).logps[:, width:]
        reference = token_logprobs(trainer.reference.model, ids, attention).logps[:, width:]
    r = reference - policy
    kl = (-r if estimator == "k1" else torch.exp(r) - 1 - r) * mask
    finished = ids[:, width:].eq(trainer.processing_class.eos_token_id).any(-1)
    rewards = -kl_coef * kl
    last = mask.sum(-1) - 1
    rewards[torch.arange(len(last)), last] += 1.0 - penalty * (~finished).float()
    if whiten_rewards:
        rewards = whiten(rewards, mask, shift_mean=False)
    expected = rewards.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(buffer["returns"] * mask, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(buffer["old_logps"], policy * mask, rtol=1e-5, atol=1e-6)
    advantages = buffer["advantages"][mask]
    assert abs(advantages.mean().item()) < 1e-5 and abs(advantages.std().item() - 1.0) < 1e-3  # whitened


def test_one_rollout_serves_epochs_times_minibatches_optimizer_steps(tmp_path):
    args = config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2, num_mini_batches=2,
                  num_ppo_epochs=2, total_episodes=8, max_steps=-1, response_length=3)
    trainer = PPOTrainer(str(tiny_model_path()), reward_model=constant_reward, args=args, train_dataset=prompts(0, 8))
    rollouts = []
    original = trainer.rollout
    trainer.rollout = lambda inputs: rollouts.append(len(inputs["prompt"])) or original(inputs)
    trainer.train()
    # a rollout is 1 × 2 × 2 = 4 prompts; 8 episodes are 2 rollouts of 2 minibatches × 2 epochs each
    assert trainer.state.global_step == 8 and rollouts == [4, 4]
    logged = {k for h in trainer.state.log_history for k in h}
    assert set(METRICS) <= logged and {"objective/kl_coef", "episode"} <= logged


@pytest.mark.slow
def test_ppo_raises_the_score_of_a_reward_that_favours_target_tokens(tmp_path):
    start = time.time()
    targets = set(range(500, 600))  # a tenth of the vocabulary

    class TargetTokens:
        @hookimpl
        def register_rewards(self, register):
            def target_tokens(completion_ids, **kwargs):
                return [sum(t in targets for t in ids) / max(1, len(ids)) for ids in completion_ids]

            register("reward.target_tokens", target_tokens)

    args = config(tmp_path, per_device_train_batch_size=16, num_mini_batches=2, num_ppo_epochs=2, max_steps=24,
                  response_length=6, learning_rate=1e-2, logging_steps=4, kl_coef=0.01, reward_funcs=["target_tokens"])
    trainer = PPOTrainer(str(tiny_model_path()), args=args, train_dataset=prompts(0, 64),
                         plugins=make_plugins(plugins=[TargetTokens()]))
    probe = torch.tensor([trainer.train_dataset[i]["prompt_ids"] for i in range(8)])  # equal lengths here

    def expected_score() -> float:
        """The reward's expectation at a completion's first token: the policy's mass on the targets."""
        with torch.no_grad():
            probs = (trainer._policy(probe).logits[:, -1].float() / 1.0).softmax(-1)
        return probs[:, sorted(targets)].sum(-1).mean().item()

    before = expected_score()
    trainer.train()
    after = expected_score()
    scores = [h["objective/scores"] for h in trainer.state.log_history if "objective/scores" in h]
    assert after > before + 0.03, (before, after)
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.02, scores  # the sampled rewards rise too
    print(f"target mass {before:.3f} -> {after:.3f}; rollout scores {[round(s, 3) for s in scores]}; "
          f"{time.time() - start:.1f} s")


def test_with_peft_the_reference_is_the_policy_without_adapters(tmp_path):
    trainer = PPOTrainer(str(tiny_model_path()), reward_model=constant_reward, args=config(tmp_path, max_steps=2),
                         train_dataset=prompts(0, 8), peft_config=LoraConfig(r=4, target_modules="all-linear"))
    assert trainer.reference.model is None and trainer.reference.adapters_off
    trainable = {n.split(".")[0] for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable == {"policy", "value_model"}  # LoRA weights of the policy and the whole value model
    value_before = {n: p.detach().clone() for n, p in trainer.value_model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, value_before[n]) for n, p in trainer.value_model.named_parameters())


def test_checkpoints_hold_the_policy_and_the_value_model_and_resume(tmp_path):
    args = config(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    trainer = PPOTrainer(str(tiny_model_path()), reward_model=constant_reward, args=args, train_dataset=prompts(0, 8))
    trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "value_model" / "model.safetensors").exists()
    reloaded = AutoModelForSequenceClassification.from_pretrained(checkpoint / "value_model")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.parameters(), trainer.value_model.parameters()))
    saved = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.zero_()
    trainer._load_from_checkpoint(str(checkpoint))
    assert all(torch.equal(p, saved[n]) for n, p in trainer.model.named_parameters())
    assert AutoModelForCausalLM.from_pretrained(checkpoint) is not None  # the policy folder loads as a causal LM


def test_an_adaptive_kl_controller_comes_through_the_lifecycle_hook(tmp_path):
    args = config(tmp_path, max_steps=2, target_kl=0.001, kl_horizon=10)
    trainer = PPOTrainer(str(tiny_model_path()), ref_model=noisy_model(), reward_model=constant_reward, args=args,
                         train_dataset=prompts(0, 8))
    assert isinstance(trainer.kl_controller, AdaptiveKLController)
    assert trainer.kl_controller in trainer.callback_handler.callbacks
    trainer.train()
    coefs = [h["objective/kl_coef"] for h in trainer.state.log_history if "objective/kl_coef" in h]
    # KL to a different reference is far above target: each rollout raises β by the full 20% × n/horizon
    assert coefs[0] == pytest.approx(0.05) and coefs[1] == pytest.approx(0.05 * (1 + 0.2 * 4 / 10))


def test_a_plugin_can_replace_the_kl_controller(tmp_path):
    class Halving(KLController):
        def observe(self, kl, episodes):
            self.kl_coef /= 2

    class Plugin:
        @hookimpl
        def trainer_callbacks(self, method, args):
            return [Halving(args.params.kl_coef)] if method == "ppo" else []

    trainer = PPOTrainer(str(tiny_model_path()), reward_model=constant_reward, args=config(tmp_path, max_steps=2),
                         train_dataset=prompts(0, 8), plugins=make_plugins(plugins=[Plugin()]))
    trainer.train()
    assert isinstance(trainer.kl_controller, Halving) and trainer.kl_controller.kl_coef == pytest.approx(0.05 / 4)


@pytest.mark.parametrize("kwargs, overrides, match", [
    ({"value_model": "causal"}, {}, "value_model is a LlamaForCausalLM without a scalar head"),
    ({}, {"total_episodes": 3}, "total_episodes=3 is smaller than one rollout batch of 8 prompts"),
    ({}, {"total_episodes": 64, "max_steps": 5}, "both set the length of training"),
    ({"reward_model": None}, {}, "needs exactly one reward source"),
    ({}, {"reward_funcs": ["think_format"]}, "got reward_model and reward_funcs"),
    ({}, {"advantage_estimator": "group"}, "PPO needs a token-level estimator"),
    ({}, {"advantage_estimator": "turn_return"}, "PPO samples one episode per prompt"),
    ({}, {"kl_estimator": "k2"}, "kl_estimator='k2' must be one of k1, k3"),
    ({}, {"loss": ["dapo"]}, "unknown loss 'dapo'"),
    ({}, {"num_ppo_epochs": 0}, "num_ppo_epochs=0 must be an integer >= 1"),
])
def test_bad_inputs_are_refused_with_the_fix(tmp_path, kwargs, overrides, match):
    kwargs = {"reward_model": constant_reward, **kwargs}
    if kwargs.get("value_model") == "causal":
        kwargs["value_model"] = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    with pytest.raises(PlaitError, match=match):
        PPOTrainer(str(tiny_model_path()), args=config(tmp_path, per_device_train_batch_size=4,
                                                       gradient_accumulation_steps=2, **overrides),
                   train_dataset=prompts(0, 8), **kwargs)


@pytest.mark.parametrize("given_as", ["path", "model"])
def test_a_reward_model_scores_and_initialises_the_value_model(tmp_path, given_as):
    reward_path = tmp_path / "reward"
    reward = AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1)
    reward.save_pretrained(reward_path)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(reward_path)
    if given_as == "path":
        args, kwargs = config(tmp_path, reward_model_path=str(reward_path)), {}
    else:
        args, kwargs = config(tmp_path), {"reward_model": AutoModelForSequenceClassification.from_pretrained(reward_path)}
    trainer = PPOTrainer(str(tiny_model_path()), args=args, train_dataset=prompts(0, 8), **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(trainer.value_model.parameters(), reward.parameters()))
    assert all(a is not b for a, b in zip(trainer.value_model.parameters(), reward.parameters()))
    trainer.train()
    assert any(key.startswith("rewards/") for key in trainer.state.log_history[0])


# ---------------------------------------------------------------------------------------------
# Registry and CLI
# ---------------------------------------------------------------------------------------------


def test_ppo_is_registered_with_its_parts_and_gets_a_command(capsys):
    plugins = make_plugins()
    assert plugins.methods.get("method.ppo").obj.loss_family == "ppo"
    assert {"ppo.policy", "ppo.value"} <= set(plugins.losses.names())
    assert "advantage.gae" in plugins.advantage_estimators
    with pytest.raises(SystemExit):
        main(["--help"], plugins=plugins)
    assert "ppo" in capsys.readouterr().out


@pytest.mark.slow
def test_plait_ppo_runs_the_recipe(tmp_path):
    reward_path = tmp_path / "reward"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1).save_pretrained(reward_path)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(reward_path)
    data = yaml.safe_load((ROOT / "examples" / "recipes" / "ppo_tiny.yaml").read_text())
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": f"Say something about {i}."}) + "\n" for i in range(16)))
    data.update(model=str(tiny_model_path()), reward_funcs=[str(reward_path)])
    data["dataset"]["data_files"] = str(data_file)
    data["training"].pop("max_steps")  # the length is given as episodes here
    data["training"].update(output_dir=str(tmp_path / "out"), total_episodes=16, response_length=4)
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["ppo", "--config", str(path), "--num_ppo_epochs", "1"], plugins=make_plugins()) == 0
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists() and (out / "value_model" / "model.safetensors").exists()
    assert json.loads((out / "plait_run.json").read_text())["config"]["num_ppo_epochs"] == 1
