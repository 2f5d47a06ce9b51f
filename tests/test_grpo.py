"""GRPO: construction-time validation, the generation buffer, references, and learning on the tiny model."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import plait
from plait.errors import PlaitError
from plait.online.buffer import GenerationSizes, GroupSampler, generation_sizes
from plait.online.importance_sampling import importance_weights
from plait.testing.tiny_model import tiny_model_path

PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is",
                                   "The weather today", "Numbers such as", "The children", "Nobody could")]
LOW = 100  # ids below this (~10% of the tiny vocabulary) are "rewarded"


def low_tokens(completion_ids, **kwargs):
    """A verifiable reward: the number of completion tokens with id < 100 (about 10% by chance)."""
    return [float(sum(t < LOW for t in ids)) for ids in completion_ids]


def config(**overrides):
    values = dict(output_dir="/tmp/plait-test-grpo", per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=6, learning_rate=1e-2, max_steps=2, logging_steps=1, report_to=[],
                  save_strategy="no", disable_tqdm=True, seed=0)
    return plait.GRPOConfig(**{**values, **overrides})


def trainer(model=None, reward_funcs=low_tokens, **overrides):
    return plait.GRPOTrainer(model or str(tiny_model_path()), reward_funcs=reward_funcs, args=config(**overrides),
                             train_dataset=PROMPTS * 4)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


# -- construction-time validation (before any model loads) ---------------------------------------

MISSING = "/nonexistent/model"  # loading it would fail: these errors must come first


def test_indivisible_generation_batch_names_both_numbers_and_two_fixes():
    with pytest.raises(PlaitError) as err:
        plait.GRPOTrainer(MISSING, reward_funcs=low_tokens,
                          args=config(per_device_train_batch_size=3, gradient_accumulation_steps=2, num_generations=4))
    message = str(err.value)
    assert "generation batch of 6 completions" in message and "num_generations=4" in message
    assert "set num_generations to a divisor of 6" in message and "generation_batch_size to a multiple of 12" in message
    assert "\n" not in message


def test_generation_batch_size_and_steps_per_generation():
    sizes = generation_sizes(config(per_device_train_batch_size=4, generation_batch_size=16))
    assert sizes == GenerationSizes(per_device=4, processes=1, steps_per_generation=4, num_generations=4)
    assert (sizes.local, sizes.total, sizes.prompts) == (16, 16, 4)
    assert generation_sizes(config(gradient_accumulation_steps=3, num_generations=2)).steps_per_generation == 3
    with pytest.raises(PlaitError, match="generation_batch_size=10 is not a multiple of per_device_train_batch_size 4"):
        generation_sizes(config(per_device_train_batch_size=4, generation_batch_size=10))
    with pytest.raises(PlaitError, match="both set the generation batch"):
        generation_sizes(config(generation_batch_size=16, steps_per_generation=2))


@pytest.mark.parametrize("overrides, message", [
    ({"num_generations": 1}, "num_generations=1 must be an integer >= 2"),
    ({"reward_weights": [1.0, 2.0]}, "reward_weights has 2 values for 1 reward functions"),
    ({"loss_type": "dapoo"}, "unknown loss 'dapoo' .did you mean 'grpo.dapo'"),
    ({"scale_rewards": "groups"}, "scale_rewards='groups' is not valid"),
    ({"epsilon": 0.0}, "epsilon=0.0 must be a number > 0"),
    ({"importance_sampling_level": "seq"}, "importance_sampling_level='seq'"),
    ({"generation_backend": "vlm"}, "unknown generation backend 'vlm'"),
    ({"reward_error_policy": "skip"}, "reward_error_policy='skip' must be one of fail, none"),
    ({"remove_unused_columns": True}, "remove_unused_columns=True would drop the prompt"),
])
def test_bad_settings_fail_before_the_model_loads(overrides, message):
    with pytest.raises(PlaitError, match=message):
        plait.GRPOTrainer(MISSING, reward_funcs=low_tokens, args=config(**overrides))


def test_reward_funcs_are_required_once():
    with pytest.raises(PlaitError, match="needs reward_funcs"):
        plait.GRPOTrainer(MISSING, args=config())
    with pytest.raises(PlaitError, match="both as the reward_funcs argument and in the config"):
        plait.GRPOTrainer(MISSING, reward_funcs=low_tokens, args=config(reward_funcs="think_format"))
    with pytest.raises(PlaitError, match="unknown reward 'no_such_reward'"):
        plait.GRPOTrainer(MISSING, reward_funcs="no_such_reward", args=config())


@pytest.mark.parametrize("overrides, estimator", [
    ({}, "advantage.group"), ({"scale_rewards": True}, "advantage.group"), ({"scale_rewards": "batch"}, "advantage.batch"),
    ({"scale_rewards": "none"}, "advantage.none"), ({"scale_rewards": False}, "advantage.none"),
    ({"multi_objective_aggregation": "normalize_then_sum"}, "advantage.normalize_then_sum"),
    ({"advantage_estimator": "rloo"}, "advantage.rloo"),
])
def test_scale_rewards_picks_a_registered_estimator(overrides, estimator):
    assert config(**overrides).params.advantage_spec() in (estimator, estimator.removeprefix("advantage."))


def test_method_knobs_reach_the_loss_parameters():
    t = trainer(loss_type=["sapo", "luspo"], loss_weights=[1.0, 0.5], epsilon=0.3, sapo_temperature_neg=2.0)
    sapo, luspo = t.objective.params_of("grpo.sapo"), t.objective.params_of("grpo.luspo")
    assert (sapo.epsilon, sapo.sapo_temperature_neg, sapo.importance_sampling_level) == (0.3, 2.0, "token")
    assert luspo.importance_sampling_level == "token"  # TRL 1.16's default for every loss type, luspo too
    assert luspo.use_bias_correction_kl and sapo.use_bias_correction_kl  # TRL 1.16's default
    assert [term.weight for term in t.objective.terms] == [1.0, 0.5]
    assert t.objective.params_of("grpo.sapo").beta == 0.0


# -- pieces of the chassis -------------------------------------------------------------------------


def test_group_sampler_repeats_each_prompt_and_each_batch():
    sampler = GroupSampler(5, group_size=2, prompts_per_batch=2, repeat=3, shuffle=False)
    rows = list(sampler)
    assert rows == [0, 0, 1, 1] * 3 + [2, 2, 3, 3] * 3  # the fifth prompt makes no whole batch
    assert len(sampler) == len(rows)
    shuffled = GroupSampler(8, group_size=2, prompts_per_batch=4, shuffle=True, seed=3)
    first, second = list(shuffled), list(shuffled)
    assert sorted(first[::2]) == list(range(8)) and first[::2] == first[1::2]
    assert first != second  # a new order each pass
    with pytest.raises(PlaitError, match="has 3 prompts but one generation batch needs 4"):
        GroupSampler(3, 2, 4)


def test_importance_weights_modes_by_hand():
    trainer_logps = torch.tensor([[-1.0, -2.0, -1.0]])
    sampler_logps = torch.tensor([[-1.5, -1.0, -9.0]])  # log ratios 0.5, -1.0, (8.0 masked)
    mask = torch.tensor([[1, 1, 0]])
    e = math.exp
    token = importance_weights(trainer_logps, sampler_logps, mask, "token_truncate", cap=1.5)
    assert torch.allclose(token, torch.tensor([[1.5, e(-1.0), 1.0]]))  # e^0.5 = 1.65 capped; masked -> ratio 1
    assert torch.allclose(importance_weights(trainer_logps, sampler_logps, mask, "token_mask", cap=1.5),
                          torch.tensor([[0.0, e(-1.0), 1.0]]))
    seq = e(-0.5)  # exp(0.5 − 1.0)
    assert torch.allclose(importance_weights(trainer_logps, sampler_logps, mask, "sequence_truncate", cap=3.0),
                          torch.full((1, 3), seq))
    assert torch.allclose(importance_weights(trainer_logps, sampler_logps, mask, "sequence_mask", cap=0.5),
                          torch.zeros(1, 3))


# -- the rollout, the buffer, references ----------------------------------------------------------


def test_rollout_scores_groups_and_counts_tokens():
    t = trainer(gradient_accumulation_steps=2, steps_per_generation=2)
    rows = t.data_collator([t.train_dataset[i] for i in [0, 0, 0, 0, 1, 1, 1, 1]] * 2)
    out = t.rollout(rows)
    n = 16
    assert out["input_ids"].shape[0] == n and out["advantages"].shape == (n,)
    mask = out["completion_mask"]
    assert out["old_logps"].shape == mask.shape if "old_logps" in out else True
    # dapo's normaliser: the generation batch's tokens, scaled to one optimizer step (GAS / spg = 1)
    assert out["num_items_in_batch"].item() == mask.sum().item()
    groups = out["advantages"].view(-1, 4)
    assert torch.allclose(groups.sum(-1), torch.zeros(4), atol=1e-4)  # group-centred
    assert "old_logps" not in out  # used within one optimizer step: π_old is the detached current policy


def test_mask_truncated_completions_drops_unfinished_rows():
    t = trainer(mask_truncated_completions=True, max_completion_length=3)
    rows = t.data_collator([t.train_dataset[i] for i in range(8)])
    out = t.rollout(rows)
    finished = (out["input_ids"][:, out["prompt_length"]:] == t.processing_class.eos_token_id).any(-1)
    assert torch.equal(out["completion_mask"].sum(-1) > 0, finished)
    assert out["num_items_in_batch"].item() == out["completion_mask"].sum().item()


def test_buffer_is_generated_once_per_generation_batch_and_reused():
    calls = []

    def counting(completion_ids, **kwargs):
        calls.append(len(completion_ids))
        return low_tokens(completion_ids)

    # 2 optimizer steps × 2 accumulation micro-steps; one generation feeds 2 micro-steps × 2 iterations
    t = trainer(reward_funcs=counting, gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2, max_steps=2)
    t.train()
    assert calls == [16]  # 4 micro-steps, one generation of 8 × 2 completions
    assert t.needs_old_logps()
    assert max(logged(t, "clip_ratio/region_mean")) > 0  # the second pass sees a changed policy: clipping happens


def test_beta_zero_constructs_no_reference_and_logs_no_kl():
    t = trainer()
    assert not t.reference.available and t.reference.model is None
    t.train()
    assert not logged(t, "kl")


def test_beta_positive_loads_a_frozen_reference_and_logs_kl():
    t = trainer(beta=0.04)
    assert t.reference.model is not None and t.reference.model is not t.model
    assert all(not p.requires_grad for p in t.reference.model.parameters())
    t.train()
    kl = logged(t, "kl")
    assert kl and kl[-1] > 0


def test_a_loss_entry_with_its_own_beta_also_gets_a_reference():
    t = trainer(loss=[{"name": "dapo", "beta": 0.1}])
    assert t.args.params.beta == 0.0 and t.reference.model is not None


def test_peft_reference_is_the_policy_with_adapters_off():
    from peft import LoraConfig

    t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=config(beta=0.1, learning_rate=0.05),
                          train_dataset=PROMPTS * 4, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert t.reference.adapters_off and t.reference.model is None
    # no second copy: the only full-size weights are the policy's (base + adapters)
    base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_path()).parameters())
    adapters = sum(p.numel() for n, p in t.model.named_parameters() if "lora_" in n)
    assert sum(p.numel() for p in t.model.parameters()) == base + adapters
    t.train()
    assert logged(t, "kl")[-1] > 0
    # the reference still computes the base model's log-probs after training moved the adapters
    rows = t.data_collator([t.train_dataset[i] for i in range(4)])
    ids, mask = rows["input_ids"], rows["attention_mask"]
    from plait.engine.logprobs import token_logprobs

    ref = t.reference(t.model, lambda m: token_logprobs(m, ids, mask).logps)
    base_model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    with torch.no_grad():
        expected = token_logprobs(base_model, ids, mask).logps
        policy = token_logprobs(t.model, ids, mask).logps
    assert torch.allclose(ref, expected, atol=1e-5)
    assert not torch.allclose(policy, expected, atol=1e-3)


def test_reward_errors_follow_the_policy():
    def broken(completion_ids, **kwargs):
        raise ValueError("boom")

    with pytest.raises(PlaitError, match="broken"):
        trainer(reward_funcs=[low_tokens, broken], max_steps=1).train()
    t = trainer(reward_funcs=[low_tokens, broken], reward_error_policy="none", max_steps=1)
    t.train()
    assert logged(t, "rewards/low_tokens/mean") and math.isnan(logged(t, "rewards/broken/mean")[0])


def test_log_completions_prints_a_table(capsys):
    t = trainer(log_completions=True, num_completions_to_print=3, max_steps=1)
    t.train()
    printed = capsys.readouterr().out
    assert "prompt" in printed and "completion" in printed and "low_tokens" in printed and "advantage" in printed


def test_conversational_prompts_get_message_completions():
    seen = []

    def record(prompts, completions, **kwargs):
        seen.append((prompts[0], completions[0]))
        return [0.0] * len(completions)

    data = [{"prompt": [{"role": "user", "content": p["prompt"]}]} for p in PROMPTS]
    t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=record, args=config(max_steps=1), train_dataset=data)
    t.train()
    prompt, completion = seen[0]
    assert prompt[0]["role"] == "user"
    assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)


def test_evaluation_generates_and_reports_a_loss():
    t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=config(eval_strategy="no"),
                          train_dataset=PROMPTS * 4, eval_dataset=PROMPTS)
    metrics = t.evaluate()
    assert "eval_loss" in metrics and "eval_reward" in metrics and "eval_completions/mean_length" in metrics


# -- learning ----------------------------------------------------------------------------------------


def test_grpo_raises_the_reward_on_the_tiny_model():
    torch.manual_seed(0)
    t = trainer(per_device_train_batch_size=16, num_generations=8, max_completion_length=8, max_steps=30,
                logging_steps=5)
    t.train()
    rewards = logged(t, "reward")
    print("GRPO reward per 5 steps:", [round(r, 3) for r in rewards])
    assert rewards[0] < 1.5  # about 10% of 8 tokens by chance
    assert rewards[-1] > 3.0 and rewards[-1] > 3 * rewards[0]


DDP_SCRIPT = '''
import json, os, sys
import plait
from plait.testing.tiny_model import tiny_model_path

rank = int(os.environ["RANK"])
log = open(os.path.join(sys.argv[1], f"rank{rank}.jsonl"), "w")

def low_tokens(prompts, completion_ids, **kwargs):
    log.write(json.dumps(prompts) + "\\n")
    log.flush()
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]

prompts = [{"prompt": p} for p in ["a b", "c d", "e f", "g h", "i j", "k l"]] * 4
args = plait.GRPOConfig(output_dir=sys.argv[1], per_device_train_batch_size=2, num_generations=4, max_completion_length=4,
                        max_steps=3, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True,
                        learning_rate=1e-2)
t = plait.GRPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, args=args, train_dataset=prompts)
t.train()
weights = sum(p.detach().double().sum().item() for p in t.model.parameters())
json.dump({"weights": weights, "processes": t.accelerator.num_processes,
           "rewards": [h["reward"] for h in t.state.log_history if "reward" in h]},
          open(os.path.join(sys.argv[1], f"result{rank}.json"), "w"))
'''


@pytest.mark.slow
def test_two_processes_share_groups_and_stay_in_sync(tmp_path):
    """per_device 2 × 2 processes with groups of 4: each group straddles both processes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "ddp_grpo.py"
    script.write_text(DDP_SCRIPT)
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["processes"] == 2
    assert results[0]["weights"] == results[1]["weights"]  # DDP kept the replicas identical
    assert results[0]["rewards"] == results[1]["rewards"]  # metrics are gathered over both processes
    calls = [[json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert len(calls[0]) == len(calls[1]) == 3
    for mine, theirs in zip(*calls):  # one group = this process's 2 rows + the other's 2 rows
        assert len(set(mine)) == 1 and mine == theirs


@pytest.mark.parametrize("method", ["rloo", "online_dpo", "ppo", "distill", "gkd", "async_grpo"])
def test_online_methods_refuse_auto_find_batch_size(tmp_path, method):
    """Halving the batch after an out-of-memory error would split a rollout's groups: every method that
    learns from its own samples refuses it when its recipe is checked, before a model loads."""
    from pathlib import Path

    from plait.recipes.run import check_recipe, load_recipe

    recipe = Path(__file__).resolve().parents[1] / "examples" / "recipes" / f"{method}_tiny.yaml"
    config = load_recipe(recipe, {"auto_find_batch_size": True, "output_dir": str(tmp_path)}, method=method)
    with pytest.raises(PlaitError, match="^auto_find_batch_size=True: halving"):
        check_recipe(config)


def test_grpo_refuses_auto_find_batch_size_at_check(tmp_path):
    """The same through the installed command: one line at --check."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([str(Path(sys.executable).parent / "plait"), "grpo", "--config",
                             "examples/recipes/grpo_tiny.yaml", "--model", str(tiny_model_path()),
                             "--output_dir", str(tmp_path / "out"), "--auto_find_batch_size", "--check"],
                            capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("plait: error: auto_find_batch_size=True: halving")
