"""TRL 1.16's public Python surface under plait: `from trl import X` becomes `from plait import X`.

Expected parameter names and values below were written down from TRL 1.16 by running it in the
separate .venv-trl (inspect.signature on each name; the reward values by calling trl.rewards on
the same hand-made completions). This suite does not import TRL.
"""

from __future__ import annotations

import inspect
import math

import pytest

from plait.scoring import compute_rewards, resolve_reward_funcs


def message(text):
    return [{"role": "assistant", "content": text}]


def parameter_names(obj):
    return list(inspect.signature(obj).parameters)


# ---------------------------------------------------------------------------------------------
# Rewards: trl.rewards -> plait.rewards
# ---------------------------------------------------------------------------------------------

# inspect.signature(getattr(trl.rewards, name)).parameters in TRL 1.16
TRL_REWARD_PARAMETERS = {
    "accuracy_reward": ["completions", "solution", "log_extra", "kwargs"],
    "reasoning_accuracy_reward": ["completions", "solution", "reasoning_delimiters", "log_extra", "kwargs"],
    "think_format_reward": ["completions", "kwargs"],
    "get_soft_overlong_punishment": ["max_completion_len", "soft_punish_cache"],
    "get_repetition_penalty_reward": ["ngram_size", "max_penalty"],
    "get_cosine_scaled_reward": ["max_len", "min_value_wrong", "max_value_wrong", "min_value_correct", "max_value_correct"],
}


@pytest.mark.parametrize("name", sorted(TRL_REWARD_PARAMETERS))
def test_every_trl_reward_is_importable_with_trls_parameters(name):
    import plait.rewards

    assert parameter_names(getattr(plait.rewards, name)) == TRL_REWARD_PARAMETERS[name]
    assert name in plait.rewards.__all__


ACC_TEXT = [r"My answer is \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", r"so $\frac{1}{2}$", "The answer is 7",
            r"\boxed{5}", r"$3$ then \boxed{4}", r"\boxed{10\text{ cm}}"]
ACC_SOLUTION = [r"\frac{1}{3}", r"\frac{1}{3}", "0.5", "7", "no answer here", "4", "10"]
REASONING_TEXT = [r"<think>try \boxed{2}</think> The final answer is \boxed{\frac{1}{3}}",
                  r"<think>\boxed{1/3}</think> so \boxed{\frac{1}{2}}", r"<think>partial \boxed{\frac{1}{3}} no end",
                  r"<think>a</think>b</think> \boxed{3}", r"Reasoning END \boxed{3}"]
REASONING_SOLUTION = [r"\frac{1}{3}", r"\frac{1}{3}", r"\frac{1}{3}", "3", "3"]
THINK_TEXT = ["<think>\nreason\n</think>\nanswer", "<think>\nreason\nanswer", " <think>a</think>b", "<think>a</think>",
              "<think>a</think>b</think>c", "<think>a<think>b</think>c", "x<think>a</think>b", "<think>a</think>\n\n"]
IDS = [[1, 2, 3, 4], [5, 5, 5, 5, 5], [1, 2, 1, 2, 1, 2], [7], [], list(range(90)), list(range(100)) + [1], [3] * 85]

# TRL 1.16's outputs on the inputs above (run in .venv-trl: trl.rewards.<name>(...) on the same lists)
TRL_ACCURACY = [1.0, 0.0, 0.0, 0.0, None, 1.0, 1.0]  # plait's own reward.accuracy also takes "$\frac12$" and "7"
TRL_REASONING = [1.0, 0.0, 0.0, 1.0, 0.0]
TRL_REASONING_END_FIRST = [1.0, 0.0, 0.0, 1.0, 1.0]  # reasoning_delimiters=["END", "</think>"]
TRL_THINK = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
TRL_SOFT_OVERLONG_100_20 = [0.0, 0.0, 0.0, 0.0, 0.0, -0.5, -1.0, -0.25]
TRL_REPETITION_DEFAULT = [0.0, -0.6666666666666667, -0.5, 0.0, 0.0, 0.0, 0.0, -0.9879518072289156]
TRL_REPETITION_2_HALF = [0.0, -0.375, -0.3, 0.0, 0.0, 0.0, 0.0, -0.49404761904761907]
TRL_COSINE_100 = [0.75, -0.75, -1.0, -0.9877641290737884, None, 0.5, 0.9267766952966369]  # lengths 50,50,0,10,3,120,25


def same(actual, expected, tolerance=1e-12):
    return len(actual) == len(expected) and all(
        (a is None and e is None) or (a is not None and e is not None and a == pytest.approx(e, abs=tolerance))
        for a, e in zip(actual, expected))


def test_trl_rewards_as_plain_callables_give_trls_numbers():
    pytest.importorskip("math_verify")
    from plait.rewards import (accuracy_reward, get_cosine_scaled_reward, get_repetition_penalty_reward,
                               get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward)

    assert same(accuracy_reward([message(t) for t in ACC_TEXT], ACC_SOLUTION), TRL_ACCURACY)
    assert same(reasoning_accuracy_reward([message(t) for t in REASONING_TEXT], REASONING_SOLUTION), TRL_REASONING)
    assert same(reasoning_accuracy_reward([message(t) for t in REASONING_TEXT], REASONING_SOLUTION,
                                          reasoning_delimiters=["END", "</think>"]), TRL_REASONING_END_FIRST)
    assert think_format_reward([message(t) for t in THINK_TEXT]) == TRL_THINK
    assert get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)(IDS) == TRL_SOFT_OVERLONG_100_20
    assert same(get_repetition_penalty_reward()(IDS), TRL_REPETITION_DEFAULT)
    assert same(get_repetition_penalty_reward(ngram_size=2, max_penalty=-0.5)(IDS), TRL_REPETITION_2_HALF)
    cosine = get_cosine_scaled_reward(max_len=100)
    lengths = [50, 50, 0, 10, 3, 120, 25]
    assert same(cosine([message(t) for t in ACC_TEXT], ACC_SOLUTION, [[1] * n for n in lengths]), TRL_COSINE_100)
    # the names TRL logs these callables under (rewards/<name>/mean)
    assert [f.__name__ for f in (get_soft_overlong_punishment(100, 20), get_repetition_penalty_reward(), cosine)] == [
        "soft_overlong_punishment_reward", "repetition_penalty_reward", "cosine_scaled_reward"]


def test_accuracy_reward_hands_log_extra_what_trl_logs():
    pytest.importorskip("math_verify")
    from plait.rewards import accuracy_reward

    logged = {}
    accuracy_reward([message(t) for t in ACC_TEXT[:2]], ACC_SOLUTION[:2], log_extra=logged.__setitem__)
    # TRL 1.16 with the same inputs and a dict's __setitem__ as log_extra
    assert logged == {"solution": [r"\frac{1}{3}", r"\frac{1}{3}"],
                      "gold_parsed": ["[1/3, '\\\\frac{1}{3}']", "[1/3, '\\\\frac{1}{3}']"],
                      "answer_parsed": ["[1/3, '\\\\frac{1}{3}']", "[1/2, '\\\\frac{1}{2}']"]}


def test_trl_reward_names_resolve_in_reward_funcs_and_score_like_trl():
    pytest.importorskip("math_verify")
    funcs = resolve_reward_funcs([
        "accuracy_reward", "think_format_reward", "reasoning_accuracy_reward",
        {"name": "get_soft_overlong_punishment", "max_completion_len": 100, "soft_punish_cache": 20},
        {"name": "get_repetition_penalty_reward", "ngram_size": 2, "max_penalty": -0.5},
        {"name": "get_cosine_scaled_reward", "max_len": 100},
    ])
    assert [f.name for f in funcs] == ["accuracy_reward", "think_format_reward", "reasoning_accuracy_reward",
                                       "get_soft_overlong_punishment", "get_repetition_penalty_reward",
                                       "get_cosine_scaled_reward"]

    def column(func, completions, ids, **columns):  # scores come back as float32
        out = compute_rewards([func], prompts=["q"] * len(completions), completions=completions,
                              completion_ids=ids, columns=columns)[:, 0].tolist()
        return [None if math.isnan(v) else v for v in out]

    acc, think, reasoning, soft, repetition, cosine = funcs
    acc_ids = [[1] * n for n in [50, 50, 0, 10, 3, 120, 25]]
    assert same(column(acc, [message(t) for t in ACC_TEXT], acc_ids, solution=ACC_SOLUTION), TRL_ACCURACY)
    assert same(column(cosine, [message(t) for t in ACC_TEXT], acc_ids, solution=ACC_SOLUTION), TRL_COSINE_100, 1e-6)
    assert column(think, [message(t) for t in THINK_TEXT], [[1]] * len(THINK_TEXT)) == TRL_THINK
    assert same(column(reasoning, [message(t) for t in REASONING_TEXT], [[1]] * 5, solution=REASONING_SOLUTION),
                TRL_REASONING)
    assert column(soft, ["x"] * len(IDS), IDS) == TRL_SOFT_OVERLONG_100_20
    assert same(column(repetition, ["x"] * len(IDS), IDS), TRL_REPETITION_2_HALF, 1e-6)


def test_trl_factory_names_check_trls_parameter_names():
    from plait.errors import PlaitError

    # the bare name has the values TRL 1.16's `trl grpo --reward_funcs get_soft_overlong_punishment` uses
    (bare,) = resolve_reward_funcs(["get_soft_overlong_punishment"])
    assert (bare.fn.max_len, bare.fn.cache) == (1280, 256)
    with pytest.raises(PlaitError, match=r"soft_punish_cache=200 must be a whole number of tokens in \[0, max_completion_len=100\]"):
        resolve_reward_funcs([{"name": "get_soft_overlong_punishment", "max_completion_len": 100, "soft_punish_cache": 200}])
    with pytest.raises(PlaitError, match=r"unknown parameter 'ngram' \(did you mean 'ngram_size'\?\)"):
        resolve_reward_funcs([{"name": "get_repetition_penalty_reward", "ngram": 2}])
