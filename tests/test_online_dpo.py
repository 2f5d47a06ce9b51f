"""Online DPO: the judges on hand-made pairs, the pairing and the loss on a real rollout by hand,
ties, validation before anything loads, and learning what the judge prefers on the tiny model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import plait
from plait.errors import PlaitError
from plait.manager import default_plugins, make_plugins
from plait.plugins.judges.pairwise import parse_choice
from plait.plugins.methods.online_dpo import resolve_judge
from plait.testing.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [{"prompt": p} for p in ("The river", "A good answer", "What is 7 plus 5?", "Python is",
                                   "The weather today", "Numbers such as", "The children", "Nobody could")]


def low_tokens(completion_ids, **kwargs):
    return [float(sum(t < 100 for t in ids)) for ids in completion_ids]


def shorter(completions, **kwargs):
    return [-float(len(c)) for c in completions]


def config(**overrides):
    values = dict(output_dir="/tmp/plait-test-online-dpo", per_device_train_batch_size=4, max_new_tokens=6,
                  learning_rate=1e-2, max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
                  disable_tqdm=True, seed=0, use_cpu=True)
    return plait.OnlineDPOConfig(**{**values, **overrides})


def trainer(judge=None, reward_funcs=None, **overrides):
    if judge is None and reward_funcs is None:
        reward_funcs = low_tokens
    return plait.OnlineDPOTrainer(str(tiny_model_path()), judge=judge, reward_funcs=reward_funcs,
                                  args=config(**overrides), train_dataset=PROMPTS * 4)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


# -- config -------------------------------------------------------------------------------------


def test_defaults_follow_trl_online_dpo_config():
    args = config(max_new_tokens=64)
    p = args.params
    # TRL 1.16's OnlineDPOConfig (trl.experimental.online_dpo), read by running it
    assert (p.max_new_tokens, p.max_length, p.temperature, p.top_p, p.top_k, p.min_p) == (64, 512, 0.9, 1.0, 0, None)
    assert (p.beta, p.loss_type, p.missing_eos_penalty, p.reward_model_path, p.reward_weights) == (0.1, None, None, None, None)
    assert (p.use_vllm, p.vllm_mode, args.vllm_gpu_memory_utilization, p.num_generations) == (False, "colocate", 0.55, 2)
    fresh = plait.OnlineDPOConfig(output_dir="/tmp/x", use_cpu=True)
    assert (fresh.learning_rate, fresh.logging_steps, fresh.remove_unused_columns, fresh.disable_dropout) == (5e-7, 10, False, True)
    assert fresh.gradient_checkpointing is True  # TRL's, as for every method
    # plait's own, as for every online method (docs/trl-differences.md): TRL says 'vllm', '0.0.0.0'
    assert (args.vllm_model_impl, args.vllm_server_host) == ("auto", "127.0.0.1")
    assert p.max_completion_length == 64  # the online base's name for the same length
    assert p.beta_at(0) == 0.1 and config(beta=[0.3, 0.2]).params.beta_at(5.0) == 0.2  # TRL's per-epoch list


@pytest.mark.parametrize("overrides, message", [
    ({"num_generations": 3}, "exactly 2 completions"),
    ({"max_length": 6, "max_new_tokens": 6}, "max_length=6 leaves no room"),
    ({"steps_per_generation": 2}, "steps_per_generation=2: online DPO samples"),
    ({"beta": [0.1, -1.0]}, "beta=.* must be a number > 0"),
    ({"max_completion_length": 8, "max_new_tokens": 16}, "give only max_new_tokens"),
])
def test_config_refusals(overrides, message):
    with pytest.raises(PlaitError, match=message):
        config(**overrides)


def validate(judge=None, reward_funcs=None, **overrides):
    """What plait online_dpo --check runs: the trainer's validate(), with no model loaded."""
    t = plait.OnlineDPOTrainer.__new__(plait.OnlineDPOTrainer)
    t.plugins, t._judge_spec, t._reward_specs = default_plugins(), judge, reward_funcs
    t.validate(config(**overrides))
    return t


@pytest.mark.parametrize("kwargs, message", [
    ({}, "needs a judge to rank its pairs"),
    ({"judge": "rules", "reward_funcs": [low_tokens]}, "not both"),
    ({"judge": "rulez"}, "unknown judge 'rulez' .did you mean 'judge.rules'"),
    ({"judge": "rules"}, "judge 'judge.rules' needs rewards; write it as {name: rules, rewards: ...}"),
    ({"judge": {"rewards": ["think_format"]}}, "judge has no 'name'"),
    ({"judge": {"name": "rules", "rewards": ["think_format"], "weight": 2}}, "unknown parameter 'weight'.*'weights'"),
    ({"judge": {"name": "rules", "rewards": ["think_format"], "weights": [1, 2]}}, "weights has 2 values for 1"),
    ({"judge": {"name": "pairwise", "model": "/nonexistent/judge"}}, "judge.model='/nonexistent/judge': no such folder"),
    ({"judge": {"name": "reward_model", "model": "think_format"}}, "is a reward function's name"),
    ({"judge": lambda prompts, pairs: [0] * len(pairs), "missing_eos_penalty": 1.0}, "only ranks pairs"),
    ({"judge": {"name": "rules", "rewards": ["think_format"]}, "loss_type": "dapo"}, "unknown loss 'dapo'"),
])
def test_refused_before_any_model_loads(kwargs, message):
    with pytest.raises(PlaitError, match=message):
        validate(**kwargs)


def test_losses_compose_by_name_and_reward_funcs_become_a_rules_judge():
    t = validate(reward_funcs=[low_tokens, shorter], reward_weights=[1.0, 0.5],
                 loss=[{"name": "sigmoid"}, {"name": "dpo.sft", "weight": 0.5}])
    assert t.objective.names == ["dpo.sigmoid", "dpo.sft"]
    assert [f.name for f in t.judge.reward_funcs] == ["low_tokens", "shorter"] and t.judge.weights == [1.0, 0.5]
    t = validate(judge={"name": "rules", "rewards": ["think_format"]}, loss_type="ipo", beta=0.25)
    assert t.objective.names == ["dpo.ipo"] and t.objective.terms[0].params.beta == 0.25


# -- judges on hand-made pairs ------------------------------------------------------------------


def test_rules_judge_prefers_the_higher_reward_and_ties_equal_scores():
    judge = resolve_judge({"name": "rules", "rewards": ["think_format"]}, default_plugins())
    pairs = [("<think>so</think>yes", "yes"), ("yes", "<think>a</think>b"), ("a", "b"),
             ("<think>x</think>y", "<think>z</think>w")]
    assert judge(["q"] * 4, pairs) == [0, 1, -1, -1]
    weighted = resolve_judge({"name": "rules", "rewards": ["think_format", shorter], "weights": [10.0, 1.0]},
                             default_plugins())
    # think_format pays 10, each character costs 1: "<think>so</think>yes" (20 chars) scores 10 − 20 = −10 < −3
    assert weighted(["q"] * 2, [("<think>so</think>yes", "yes"), ("<think>a</think>b", "<think>a</think>bc")]) == [1, 0]
    assert weighted.scores(["q"], ["<think>a</think>b"]).tolist() == [10.0 - 17.0]


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory):
    """A sequence classifier (a random score head on the tiny model), saved as plait reward_model saves one."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("classifier")
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(folder)
    return folder


def test_reward_model_judge_prefers_what_the_classifier_scores_higher(classifier_folder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    judge = resolve_judge({"name": "reward_model", "model": str(classifier_folder)}, default_plugins())
    prompts = ["The river", "Python is", "A good answer", "The children"]
    pairs = [(" flows to the sea", " is"), (" a language", " a snake"), (" helps", " helps"), (" play", " sleep")]
    model = AutoModelForSequenceClassification.from_pretrained(classifier_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier_folder)

    def score(prompt, completion):  # the reward model reads prompt + completion + EOS
        with torch.no_grad():
            return model(**tokenizer(prompt + completion + tokenizer.eos_token, return_tensors="pt")).logits[0, 0].item()

    expected = []
    for prompt, (a, b) in zip(prompts, pairs):
        sa, sb = score(prompt, a), score(prompt, b)
        expected.append(0 if sa > sb else 1 if sb > sa else -1)
    assert judge(prompts, pairs) == expected and expected[2] == -1 and {0, 1} <= set(expected)
    assert judge(prompts, [(b, a) for a, b in pairs]) == [1 - e if e >= 0 else -1 for e in expected]


@pytest.fixture(scope="module")
def judge_says_one(tmp_path_factory):
    """The tiny model trained (a few dozen Adam steps) to answer "1" to the pairwise judge's question."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.online.generation import encode_prompts
    from plait.plugins.judges.pairwise import TEMPLATE

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    texts = [TEMPLATE.format(prompt=p, response0=a, response1=b) for p, a, b in
             [("The river", "flows", "is wet"), ("Python is", "a language", "fast"), ("Two plus two", "4", "five")]]
    prompts = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in texts])
    answer = tokenizer("1", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        for ids in prompts:
            logits = model(torch.tensor([ids + answer])).logits[0, len(ids) - 1:-1]
            F.cross_entropy(logits, torch.tensor(answer)).backward()
        optimizer.step()
        optimizer.zero_grad()
    folder = tmp_path_factory.mktemp("judge-one")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_pairwise_judge_parses_the_answer_and_undoes_its_shuffle(judge_says_one):
    prompts = ["What is 7 plus 5?", "The weather today", "Name a colour", "Nobody could"]
    pairs = [("12", "75"), ("sunny", "rain"), ("blue", "seven"), ("swim", "fly")]
    plain = resolve_judge({"name": "pairwise", "model": str(judge_says_one), "shuffle_order": False}, default_plugins())
    assert plain(prompts, pairs) == [1, 1, 1, 1]  # it always names the second answer shown
    shuffled = resolve_judge({"name": "pairwise", "model": str(judge_says_one), "seed": 3}, default_plugins())
    verdict = shuffled(prompts, pairs)
    assert set(shuffled.swaps) == {True, False}  # this seed shows some pairs swapped
    assert verdict == [0 if swap else 1 for swap in shuffled.swaps]  # "1" of a swapped pair is its first completion
    request = shuffled.requests(["Q?"], [("yes", "no")])[0]
    assert request[0]["role"] == "user" and "Q?" in request[0]["content"]
    assert request[0]["content"].index("yes" if not shuffled.swaps[0] else "no") < request[0]["content"].index(
        "no" if not shuffled.swaps[0] else "yes")


@pytest.mark.parametrize("text, choice", [("0", 0), (" 1\n", 1), ("1 because", 1), ("the first", -1), ("", -1),
                                          ("2", -1)])
def test_pairwise_answer_parsing(text, choice):
    assert parse_choice(text) == choice


def test_pairwise_template_must_name_its_fields():
    with pytest.raises(PlaitError, match="template lacks {response1}"):
        resolve_judge({"name": "pairwise", "model": str(tiny_model_path()), "template": "{prompt} {response0}"},
                      default_plugins())


def test_an_api_judge_is_a_third_party_plugin_without_network():
    spec = importlib.util.spec_from_file_location("api_judge", ROOT / "examples" / "judges" / "api_judge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plugins = make_plugins(plugins=[module])
    judge = resolve_judge({"name": "api_pairwise", "base_url": "http://judge.invalid/v1", "model": "m",
                           "shuffle_order": False}, plugins)
    body = judge.body("Is it?", "yes", "no")
    assert body["model"] == "m" and body["temperature"] == 0
    content = body["messages"][0]["content"]
    assert content.index("Is it?") < content.index("yes") < content.index("no")
    assert [judge.answer({"choices": [{"message": {"content": c}}]}) for c in ("1", " 0.", "maybe")] == [1, 0, -1]
    assert judge.answer({}) == -1


# -- the pairing and the loss on a real rollout ---------------------------------------------------


def completion_ids(out, row):
    width = out["prompt_length"]
    return out["input_ids"][row, width:][out["completion_mask"][row].bool()].tolist()


def full_logits_logps(model, out):
    """Σ_t log π(y_t) of each row from the full logits: an independent path to the same numbers."""
    width = out["prompt_length"]
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).logits.float()
    logps = logits[:, width - 1:-1].log_softmax(-1).gather(-1, out["input_ids"][:, width:, None]).squeeze(-1)
    return (logps * out["completion_mask"]).sum(-1)


def test_chosen_rows_are_the_judged_better_and_the_loss_matches_by_hand():
    t = trainer(max_new_tokens=8, per_device_train_batch_size=8)
    torch.manual_seed(0)
    t.model.train()
    out = t.rollout(next(iter(t.get_train_dataloader())))
    n = out["input_ids"].shape[0] // 2
    scores = low_tokens([completion_ids(out, i) for i in range(2 * n)])
    decided = out["decided"][:n]
    for i in range(n):  # chosen (row i) is never judged worse than rejected (row n + i); ties stay out
        assert scores[i] > scores[n + i] if decided[i] else scores[i] == scores[n + i]
    assert 0 < decided.sum() < n  # this seed's batch holds both decided pairs and ties
    # the reference's log-probs belong to the reordered rows
    ref = full_logits_logps(t.reference.model, out)
    assert torch.allclose((out["ref_logps"] * out["completion_mask"]).sum(-1), ref, atol=1e-4)
    # the loss: −log σ(β·[(c − c_ref) − (r − r_ref)]) averaged over the decided pairs
    policy = full_logits_logps(t.model, out)
    margin = (policy[:n] - ref[:n]) - (policy[n:] - ref[n:])
    expected = -F.logsigmoid(0.1 * margin[decided]).mean()
    t.model.train()
    loss = t.compute_loss(t.model, out)
    assert torch.allclose(loss, expected, atol=1e-5)
    loss.backward()
    metrics = {k: v[-1] for k, v in t._metrics["train"].items()}
    assert metrics["logps/chosen"] == pytest.approx(policy[:n].mean().item(), abs=1e-4)
    assert metrics["objective/kl"] == pytest.approx((policy - ref).mean().item(), abs=1e-4)
    assert metrics["objective/entropy"] == pytest.approx(-policy.mean().item(), abs=1e-3)
    assert metrics["judge/ties"] == pytest.approx(1 - decided.float().mean().item())
    assert metrics["objective/scores_margin"] == pytest.approx(
        (sum(scores[:n]) - sum(scores[n:])) / n, abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "val/contain_eos_token", "objective/non_score_reward", "logps/rejected", "objective/rlhf_reward"):
        assert name in metrics


def test_ties_stay_out_of_the_loss_and_missing_eos_is_penalised():
    t = trainer(judge=lambda prompts, pairs: [-1] * len(pairs))
    out = t.rollout(next(iter(t.get_train_dataloader())))
    t.model.train()
    loss = t.compute_loss(t.model, out)
    loss.backward()
    assert loss.item() == 0.0 and all(p.grad is None or not p.grad.any() for p in t.model.parameters())
    t = trainer(reward_funcs=[shorter], missing_eos_penalty=100.0)
    finished = torch.tensor([True, False, False, True])
    winners, scores = t.judge_pairs(["p", "p", "q", "q"], ["abcd", "a", "ab", "abc"], [[1]] * 4, {}, finished)
    assert scores.tolist() == [-4.0, -101.0, -102.0, -3.0] and winners.tolist() == [0, 1]


def test_a_judge_returning_nonsense_is_named():
    t = trainer(judge=lambda prompts, pairs: [2] * len(pairs))
    with pytest.raises(PlaitError, match="returned .2, 2.*one of 0, 1"):
        t.rollout(next(iter(t.get_train_dataloader())))


# -- learning -----------------------------------------------------------------------------------


def test_the_judged_behaviour_becomes_more_frequent_on_the_tiny_model():
    """A rule judge prefers completions with more low-id tokens (< 100, about 10% of the tiny
    model's samples at the start); within 30 steps of 4 pairs they become several times as frequent."""
    torch.manual_seed(0)
    t = trainer(judge={"name": "rules", "rewards": [low_tokens]}, per_device_train_batch_size=4, max_new_tokens=8,
                max_steps=30, logging_steps=5, learning_rate=3e-2, temperature=1.0)
    t.train()
    scores = logged(t, "objective/scores")  # low-id tokens per 8-token completion, per 5 steps
    print("online DPO: low-id tokens per completion, per 5 steps:", [round(s, 2) for s in scores])
    assert scores[0] < 1.5
    assert scores[-1] > 3.0 and scores[-1] > 3 * scores[0]  # seed 0: 0.68 -> 3.85 (seeds 1, 2: -> 7.8, 8.0)
    assert logged(t, "rewards/margins")[-1] > 0


# -- the generation backend, adapters, evaluation ------------------------------------------------


@pytest.mark.parametrize("fields, backend", [({}, "generation.transformers"),
                                             ({"use_vllm": True}, "generation.vllm_colocate"),
                                             ({"use_vllm": True, "vllm_mode": "server"}, "generation.vllm_server"),
                                             ({"generation_backend": "transformers"}, "generation.transformers")])
def test_the_backend_is_grpos_generation_choice(fields, backend):
    assert validate(judge={"name": "rules", "rewards": ["think_format"]}, **fields).backend_component.name == backend


def test_lora_reference_accumulation_and_evaluation():
    from peft import LoraConfig

    t = plait.OnlineDPOTrainer(str(tiny_model_path()), reward_funcs=low_tokens, train_dataset=PROMPTS, eval_dataset=PROMPTS,
                               args=config(gradient_accumulation_steps=2, per_device_train_batch_size=2,
                                           per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=2),
                               peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert t.reference.model is None and t.reference.adapters_off  # the policy with its adapters off
    t.train()
    assert len(logged(t, "loss")) == 2 and logged(t, "eval_rewards/margins") and logged(t, "eval_objective/kl")
