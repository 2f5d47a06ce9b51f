"""Reward plugins against hand-computed cases, and the scoring engine (plait.online.scoring):
resolution of every kind of spec, concurrent async rewards, failure policies, metrics."""

import asyncio
import functools
import importlib
import logging
import math
import pickle
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from plait import hookimpl, make_plugins
from plait.errors import PlaitError
from plait.online.scoring import (
    RewardFunction,
    completion_text,
    compute_rewards,
    resolve_reward_funcs,
    reward_metrics,
    reward_weights,
)
from plait.testing.strategies import reward_inputs

BUILT_IN = ["accuracy", "reasoning_accuracy", "think_format", "soft_overlong", "repetition", "cosine_scaled"]
NAN = math.nan


@pytest.fixture(scope="module")
def plugins():
    return make_plugins()


def resolve_one(plugins, spec):
    (func,) = resolve_reward_funcs([spec], plugins)
    return func


def score(func, completions, ids=None, **columns):
    """One reward on a list of completions; NaN stands for None."""
    ids = ids if ids is not None else [[0] * 3 for _ in completions]
    out = compute_rewards([func], prompts=["q"] * len(completions), completions=completions,
                          completion_ids=ids, columns=columns)
    return out[:, 0].tolist()


def same(actual, expected):
    return len(actual) == len(expected) and all(
        (math.isnan(a) and math.isnan(e)) or a == pytest.approx(e, abs=1e-6) for a, e in zip(actual, expected))


def messages(text):
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------------------------------------
# think_format
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("<think>2 + 2 = 4</think>The answer is 4.", 1.0),
    ("  \n<think></think> 4", 1.0),                    # leading whitespace, empty thought
    ("<think>reasoning</think>", 0.0),                 # no answer
    ("<think>reasoning</think>   \n", 0.0),            # only whitespace after
    ("Sure. <think>x</think>4", 0.0),                  # text before the block
    ("<think>a</think><think>b</think>4", 0.0),        # two blocks
    ("<think>a <think> b</think>4", 0.0),              # nested open tag
    ("<think>a</think>4</think>", 0.0),                # second close tag
    ("<think>unfinished", 0.0),
    ("</think>4", 0.0),
    ("4", 0.0),
    ("", 0.0),
])
def test_think_format(plugins, text, expected):
    func = resolve_one(plugins, "think_format")
    assert score(func, [text]) == [expected]
    assert score(func, [messages(text)]) == [expected]


# ---------------------------------------------------------------------------------------------
# soft_overlong
# ---------------------------------------------------------------------------------------------

def test_soft_overlong_ramps_over_the_cache_window(plugins):
    func = resolve_one(plugins, {"name": "soft_overlong", "max_len": 10, "cache": 4})
    lengths = [0, 5, 6, 7, 8, 9, 10, 11, 50]
    # L − C = 6: no penalty up to 6 tokens, (6 − |y|)/4 up to 10, −1 beyond
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert same(score(func, ["x"] * len(lengths), ids=[[1] * n for n in lengths]), expected)


def test_soft_overlong_with_no_cache_is_a_step(plugins):
    func = resolve_one(plugins, {"name": "soft_overlong", "max_len": 4, "cache": 0})
    assert score(func, ["x"] * 3, ids=[[1] * 4, [1] * 5, []]) == [0.0, -1.0, 0.0]


@pytest.mark.parametrize("params, message", [
    ({"max_len": 0, "cache": 0}, "max_len=0"),
    ({"max_len": 10.5, "cache": 2}, "max_len=10.5"),
    ({"max_len": 10, "cache": 11}, "cache=11 must be a whole number of tokens in [0, max_len=10]"),
    ({"max_len": 10, "cache": -1}, "cache=-1"),
    ({"max_len": 10, "cache": 2, "cach": 3}, "did you mean 'cache'"),
])
def test_soft_overlong_validates_its_parameters(plugins, params, message):
    with pytest.raises(PlaitError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve_one(plugins, {"name": "soft_overlong", **params})


def test_a_factory_with_required_parameters_says_how_to_write_them(plugins):
    with pytest.raises(PlaitError, match=r"reward 'reward.soft_overlong' needs max_len, cache; write it as "
                                         r"\{name: soft_overlong, max_len: \.\.\., cache: \.\.\.\}"):
        resolve_reward_funcs(["soft_overlong"], plugins)


def test_shared_values_fill_factory_parameters(plugins):
    (func,) = resolve_reward_funcs([{"name": "soft_overlong", "cache": 2}], plugins, shared={"max_len": 4, "beta": 1})
    assert func.fn.max_len == 4
    (func,) = resolve_reward_funcs([{"name": "soft_overlong", "max_len": 8, "cache": 2}], plugins, shared={"max_len": 4})
    assert func.fn.max_len == 8  # an explicit value wins


# ---------------------------------------------------------------------------------------------
# repetition
# ---------------------------------------------------------------------------------------------

def test_repetition_penalty_hand_computed(plugins):
    func = resolve_one(plugins, {"name": "repetition", "max_penalty": -2.0})
    texts = [
        "the the the the the the",   # 4 trigrams, 1 unique: (1 − 1/4)·(−2)
        "a b c d e",                  # 3 trigrams, all unique
        "A b c a B C a b c",          # case-folded: 7 trigrams, 3 unique: (1 − 3/7)·(−2)
        "a b",                        # shorter than n: no trigram
        "",
    ]
    assert same(score(func, texts), [-1.5, 0.0, -8 / 7, 0.0, 0.0])
    assert same(score(func, [messages(t) for t in texts]), [-1.5, 0.0, -8 / 7, 0.0, 0.0])


def test_repetition_ngram_size_and_defaults(plugins):
    unigram = resolve_one(plugins, {"name": "repetition", "ngram": 1, "max_penalty": -1})
    assert score(unigram, ["a a b b"]) == [-0.5]  # 4 unigrams, 2 unique
    default = resolve_one(plugins, "repetition")
    assert (default.fn.ngram, default.fn.max_penalty) == (3, -1.0)
    zero = resolve_one(plugins, {"name": "repetition", "max_penalty": 0})
    assert score(zero, ["x x x x x"]) == [0.0]


@pytest.mark.parametrize("params, message", [
    ({"max_penalty": 0.5}, "max_penalty=0.5 must be a number <= 0"),
    ({"ngram": 0}, "ngram=0 must be a whole number >= 1"),
    ({"ngram": 2.0}, "ngram=2.0"),
])
def test_repetition_validates_its_parameters(plugins, params, message):
    with pytest.raises(PlaitError, match=f"reward 'reward.repetition': {message}"):
        resolve_one(plugins, {"name": "repetition", **params})


# ---------------------------------------------------------------------------------------------
# Math rewards (math-verify)
# ---------------------------------------------------------------------------------------------

def test_accuracy_compares_values_not_text(plugins):
    func = resolve_one(plugins, "accuracy")
    completions = [
        "The answer is $\\boxed{0.1575}$",                      # = 63/400
        "The answer is $\\boxed{0.1576}$",
        "so x is $\\frac{1}{2}$",                               # = 0.5
        "I first thought 3, but the answer is \\boxed{4}.",     # the boxed answer comes first
        "no answer here",
        "anything",                                             # gold unparseable -> None
    ]
    gold = ["$\\frac{63}{400}$", "$\\frac{63}{400}$", "0.5", "4", "4", "no number at all"]
    assert same(score(func, completions, solution=gold), [1.0, 0.0, 1.0, 1.0, 0.0, NAN])
    assert same(score(func, [messages(c) for c in completions], solution=gold), [1.0, 0.0, 1.0, 1.0, 0.0, NAN])


def test_accuracy_plain_function_and_column_parameter(plugins):
    from plait.rewards.accuracy import accuracy_reward

    assert accuracy_reward(["\\boxed{12}", "\\boxed{13}"], solution=["12", "12"]) == [1.0, 0.0]
    func = resolve_one(plugins, {"name": "accuracy", "column": "answer"})
    assert score(func, ["\\boxed{12}"], answer=["12"]) == [1.0]


def test_accuracy_without_its_column_names_it_under_any_error_policy(plugins):
    func = resolve_one(plugins, "accuracy")
    for policy in ("fail", "none"):
        with pytest.raises(PlaitError, match=r"reward 'accuracy' needs a dataset column 'solution'.*\['hint'\]"):
            compute_rewards([func], prompts=["q"], completions=["4"], completion_ids=[[1]],
                            columns={"hint": ["h"]}, on_error=policy)


def test_reasoning_accuracy_checks_only_the_answer_after_the_delimiter(plugins):
    func = resolve_one(plugins, "reasoning_accuracy")
    completions = [
        "<think>maybe \\boxed{3}</think>The answer is \\boxed{4}",
        "<think>it is \\boxed{4}</think>The answer is \\boxed{3}",   # right answer only while thinking
        "The answer is \\boxed{4}",                                   # never finished thinking
        "<think>x</think>\\boxed{4}",                                 # gold unparseable -> None
        "<think>x</think>",                                           # empty answer
    ]
    gold = ["4", "4", "4", "???", "4"]
    assert same(score(func, completions, solution=gold), [1.0, 0.0, 0.0, NAN, 0.0])
    custom = resolve_one(plugins, {"name": "reasoning_accuracy", "delimiter": "ANSWER:"})
    assert score(custom, ["thinking 3 ANSWER: 4"], solution=["4"]) == [1.0]
    with pytest.raises(PlaitError, match="delimiter='' must be a non-empty string"):
        resolve_one(plugins, {"name": "reasoning_accuracy", "delimiter": ""})


def test_cosine_scaled_hand_computed(plugins):
    func = resolve_one(plugins, {"name": "cosine_scaled", "max_len": 100})
    lengths = [0, 50, 100, 400, 0, 50, 100, 7]
    completions = ["\\boxed{4}"] * 4 + ["\\boxed{5}"] * 3 + ["\\boxed{4}"]
    gold = ["4"] * 7 + ["not a number"]
    # correct: 0.5 + 0.25·(1 + cos(π·t)); wrong: −0.5 − 0.25·(1 + cos(π·t)); t = min(|y|, L)/L
    expected = [1.0, 0.75, 0.5, 0.5, -1.0, -0.75, -0.5, NAN]
    assert same(score(func, completions, ids=[[1] * n for n in lengths], solution=gold), expected)


def test_cosine_scaled_validates_its_ranges(plugins):
    with pytest.raises(PlaitError, match="min_value_correct=2.0 must be <= max_value_correct=1.0"):
        resolve_one(plugins, {"name": "cosine_scaled", "min_value_correct": 2.0})
    with pytest.raises(PlaitError, match="max_len=0"):
        resolve_one(plugins, {"name": "cosine_scaled", "max_len": 0})


def test_missing_math_verify_fails_at_resolution_naming_the_extra(plugins, monkeypatch):
    for module in [m for m in sys.modules if m.startswith(("plait.rewards.", "math_verify"))]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    importlib.import_module("plait.rewards.accuracy")  # importing the plugin does not need it
    fresh = make_plugins()
    for name in ("accuracy", "reasoning_accuracy", "cosine_scaled"):
        with pytest.raises(PlaitError, match=rf"reward '{name}' needs math-verify.*pip install 'plait\[math\]'"):
            resolve_reward_funcs([name], fresh)
    assert resolve_reward_funcs(["think_format"], fresh)[0].name == "think_format"


# ---------------------------------------------------------------------------------------------
# Every built-in reward: any input shape, picklable
# ---------------------------------------------------------------------------------------------

def built_ins(plugins):
    return resolve_reward_funcs(BUILT_IN[:3] + [{"name": "soft_overlong", "max_len": 8, "cache": 4}] + BUILT_IN[4:], plugins)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=reward_inputs(completion_format="any", columns=["solution"]))
def test_every_built_in_returns_one_float_or_none_per_completion(plugins, inputs):
    for func in built_ins(plugins):
        values = func(**inputs, trainer_state=None)
        assert len(values) == len(inputs["completions"])
        assert all(v is None or (isinstance(v, float) and math.isfinite(v)) for v in values), (func.name, values)


def test_every_built_in_pickles_and_scores_the_same_after(plugins):
    inputs = dict(prompts=["q", "q"], completions=["<think>a</think>\\boxed{4} 4 4 4 4", "the the the the"],
                  completion_ids=[[1] * 3, [1] * 9], solution=["4", "5"], trainer_state=None)
    for func in built_ins(plugins):
        copy = pickle.loads(pickle.dumps(func))
        assert copy.name == func.name
        assert copy(**inputs) == func(**inputs)


def test_completion_text_reads_strings_and_messages():
    assert completion_text("hi") == "hi"
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"},
                            {"role": "assistant", "content": "b"}]) == "b"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]) == "xy"
    assert completion_text([]) == ""
    with pytest.raises(PlaitError, match="neither a string nor a list of messages"):
        completion_text(42)


# ---------------------------------------------------------------------------------------------
# The engine: calling, concurrency, failures
# ---------------------------------------------------------------------------------------------

def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


async def slow_one(completions, **kwargs):
    await asyncio.sleep(0.2)
    return [1.0] * len(completions)


async def slow_two(completions, **kwargs):
    await asyncio.sleep(0.2)
    return [2.0] * len(completions)


def test_async_rewards_run_concurrently(plugins):
    funcs = resolve_reward_funcs([slow_one, length_reward, slow_two], plugins)
    assert [f.is_async for f in funcs] == [True, False, True]
    start = time.perf_counter()
    out = compute_rewards(funcs, prompts=["p", "p"], completions=["ab", "c"], completion_ids=[[1], [2]])
    assert time.perf_counter() - start < 0.35
    assert out.tolist() == [[1.0, 2.0, 2.0], [1.0, 1.0, 2.0]]


def test_async_detection_sees_through_partials_and_callable_objects():
    class Judge:
        async def __call__(self, completions, **kwargs):
            return [0.5] * len(completions)

    assert RewardFunction("a", functools.partial(slow_one)).is_async
    assert RewardFunction("b", Judge()).is_async
    assert not RewardFunction("c", length_reward).is_async
    out = compute_rewards([RewardFunction("b", Judge())], prompts=["p"], completions=["x"], completion_ids=[[1]])
    assert out.tolist() == [[0.5]]


def test_reward_functions_receive_every_argument_and_column(plugins):
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, solution, log_extra, log_metric, **rest):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, state=trainer_state,
                    solution=solution, rest=rest)
        return [None, 1]

    compute_rewards([RewardFunction("spy", spy)], prompts=["p0", "p1"], completions=["c0", "c1"],
                    completion_ids=[[1], [2, 3]], columns={"solution": ["s0", "s1"], "level": [1, 2]},
                    trainer_state={"global_step": 7})
    assert seen == dict(prompts=["p0", "p1"], completions=["c0", "c1"], ids=[[1], [2, 3]],
                        state={"global_step": 7}, solution=["s0", "s1"], rest={"level": [1, 2]})


def test_none_becomes_nan_and_numbers_of_any_kind_are_accepted():
    import numpy as np

    def mixed(completions, **kwargs):
        return [None, 1, True, np.float64(0.25), torch.tensor(2.0), float("nan")]

    out = compute_rewards([RewardFunction("mixed", mixed)], prompts=["p"] * 6, completions=["c"] * 6,
                          completion_ids=[[1]] * 6)
    assert out.dtype == torch.float32 and out.shape == (6, 1)
    assert same(out[:, 0].tolist(), [NAN, 1.0, 1.0, 0.25, 2.0, NAN])
    tensor_out = compute_rewards([RewardFunction("t", lambda completions, **k: torch.ones(len(completions)))],
                                 prompts=["p"] * 2, completions=["c"] * 2, completion_ids=[[1]] * 2)
    assert tensor_out.tolist() == [[1.0], [1.0]]


def picky(completions, **kwargs):
    for c in completions:
        if c == "bad":
            raise ValueError(f"cannot score {c!r}")
    return [1.0] * len(completions)


async def picky_async(completions, **kwargs):
    await asyncio.sleep(0)
    return picky(completions)


@pytest.mark.parametrize("fn", [picky, picky_async])
def test_a_raising_reward_fails_naming_itself_and_the_example(fn):
    func = RewardFunction("picky", fn)
    with pytest.raises(PlaitError, match=r"reward 'picky' raised on example 2 of 4 \(ValueError: cannot score 'bad'\)") as info:
        compute_rewards([func], prompts=["p"] * 4, completions=["a", "b", "bad", "c"], completion_ids=[[1]] * 4)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("fn", [picky, picky_async])
def test_on_error_none_scores_only_the_failing_example_as_none_and_warns_once(fn, caplog):
    func = RewardFunction(f"picky_{fn.__name__}", fn)
    kwargs = dict(prompts=["p"] * 4, completions=["a", "bad", "b", "bad"], completion_ids=[[1]] * 4)
    with caplog.at_level(logging.DEBUG, logger="plait"):
        first = compute_rewards([func, RewardFunction("length", length_reward)], on_error="none", **kwargs)
        again = compute_rewards([func], on_error="none", **kwargs)
    assert same(first[:, 0].tolist(), [1.0, NAN, 1.0, NAN]) and first[:, 1].tolist() == [1.0, 3.0, 1.0, 3.0]
    assert same(again[:, 0].tolist(), [1.0, NAN, 1.0, NAN])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"reward '{func.name}' raised on example(s) [1, 3] of 4 (ValueError: cannot score 'bad')" in warnings[0].message


def test_a_reward_that_fails_only_on_the_whole_batch_is_reported_as_such():
    def pairs_only(completions, **kwargs):
        if len(completions) % 2:
            raise RuntimeError("needs pairs")
        return [0.0] * len(completions)

    def not_singles(completions, **kwargs):
        if len(completions) < 3:
            raise RuntimeError("needs a crowd")
        if len(completions) == 3:
            raise RuntimeError("three is odd")
        return [0.0] * len(completions)

    with pytest.raises(PlaitError, match=r"raised on example 0 of 3 \(RuntimeError: needs pairs\)"):
        compute_rewards([RewardFunction("p", pairs_only)], prompts=["p"] * 3, completions=["c"] * 3, completion_ids=[[1]] * 3)
    with pytest.raises(PlaitError, match=r"raised on example 0 of 3"):
        compute_rewards([RewardFunction("n", not_singles)], prompts=["p"] * 3, completions=["c"] * 3, completion_ids=[[1]] * 3)

    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("too many")
        return [0.5]

    with pytest.raises(PlaitError, match=r"reward 'b' raised on the batch of 2 completions but on no single one"):
        compute_rewards([RewardFunction("b", batch_only)], prompts=["p"] * 2, completions=["c"] * 2, completion_ids=[[1]] * 2)
    out = compute_rewards([RewardFunction("b2", batch_only)], prompts=["p"] * 2, completions=["c"] * 2,
                          completion_ids=[[1]] * 2, on_error="none")
    assert out.tolist() == [[0.5], [0.5]]


@pytest.mark.parametrize("returned, message", [
    ([1.0], r"reward 'bad' returned length 1 for 2 completions"),
    (5.0, r"reward 'bad' returned float for 2 completions"),
    ([1.0, "high"], r"reward 'bad' returned 'high' for example 1"),
    ([1.0, float("inf")], r"reward 'bad' returned inf for example 1; return a finite float or None"),
])
@pytest.mark.parametrize("policy", ["fail", "none"])
def test_malformed_output_always_fails(returned, message, policy):
    func = RewardFunction("bad", lambda completions, **kwargs: returned)
    with pytest.raises(PlaitError, match=message):
        compute_rewards([func], prompts=["p"] * 2, completions=["c"] * 2, completion_ids=[[1]] * 2, on_error=policy)


def test_engine_argument_errors():
    func = RewardFunction("length", length_reward)
    with pytest.raises(PlaitError, match="on_error='skip' is not valid; use 'fail' or 'none'"):
        compute_rewards([func], prompts=["p"], completions=["c"], completion_ids=[[1]], on_error="skip")
    with pytest.raises(PlaitError, match="dataset column 'completions' clashes"):
        compute_rewards([func], prompts=["p"], completions=["c"], completion_ids=[[1]], columns={"completions": ["x"]})
    with pytest.raises(PlaitError, match="solution has 2 values for 1 completions"):
        compute_rewards([func], prompts=["p"], completions=["c"], completion_ids=[[1]], columns={"solution": ["a", "b"]})


def test_compute_rewards_works_inside_a_running_event_loop():
    async def main():
        return compute_rewards([RewardFunction("s", slow_one)], prompts=["p"], completions=["c"], completion_ids=[[1]])

    assert asyncio.run(main()).tolist() == [[1.0]]


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------

def test_names_resolve_bare_dotted_and_with_weights(plugins):
    funcs = resolve_reward_funcs(["think_format", "reward.think_format", {"name": "repetition", "weight": 0.5}], plugins)
    assert [f.name for f in funcs] == ["think_format", "think_format_2", "repetition"]
    assert [f.weight for f in funcs] == [1.0, 1.0, 0.5]
    assert reward_weights(funcs).tolist() == [1.0, 1.0, 0.5]
    assert reward_weights(funcs, [2, 0, 1]).tolist() == [2.0, 0.0, 1.0]
    with pytest.raises(PlaitError, match=r"reward_weights has 2 values for 3 reward functions"):
        reward_weights(funcs, [1.0, 2.0])
    assert resolve_reward_funcs("think_format", plugins)[0].name == "think_format"  # one entry, not a list


def test_unknown_name_suggests_the_closest(plugins):
    with pytest.raises(PlaitError, match=r"reward_funcs\[1\]: unknown reward 'think_fromat' \(did you mean "
                                         r"'reward.think_format'\?\).*available: .*reward.accuracy.*'pkg.module:func'"):
        resolve_reward_funcs(["accuracy", "think_fromat"], plugins)
    with pytest.raises(PlaitError, match=r"did you mean 'reward.repetition'"):
        resolve_reward_funcs(["reward.repetiton"], plugins)


@pytest.mark.parametrize("spec, message", [
    ([], r"reward_funcs is empty"),
    ([{"weight": 1.0}], r"reward_funcs\[0\] has no 'name'"),
    ([{"name": "think_format", "weight": "high"}], r"reward_funcs\[0\].weight='high' must be a finite number"),
    ([{"name": "think_format", "strict": True}], r"reward 'reward.think_format' takes no parameters"),
    ([{"name": length_reward, "scale": 2}], r"parameters \['scale'\] apply only to registered reward factories"),
    ([42], r"reward_funcs\[0\]: cannot use int 42 as a reward"),
])
def test_malformed_specs(plugins, spec, message):
    with pytest.raises(PlaitError, match=message):
        resolve_reward_funcs(spec, plugins)


def test_callables_keep_their_names(plugins):
    class Judge:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    funcs = resolve_reward_funcs(
        [length_reward, functools.partial(length_reward), Judge(), {"name": slow_one, "weight": 3}], plugins)
    assert [f.name for f in funcs] == ["length_reward", "length_reward_2", "Judge", "slow_one"]
    assert funcs[3].weight == 3.0 and funcs[3].is_async


def test_import_paths(plugins, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def shouting(completions, **kwargs):\n    return [float(c.isupper()) for c in completions]\n"
        "class NotAReward:\n    pass\n"
        "value = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    funcs = resolve_reward_funcs(["my_rewards:shouting", "my_rewards.shouting",
                                  "plait.rewards.think_format:think_format_reward"], plugins)
    assert [f.name for f in funcs] == ["shouting", "shouting_2", "think_format_reward"]
    assert score(funcs[0], ["LOUD", "quiet"]) == [1.0, 0.0]
    for spec, message in [
        ("my_rewards:missing", r"reward 'my_rewards:missing': module 'my_rewards' has no attribute 'missing'"),
        ("my_rewards:NotAReward", r"is type .* not a reward function"),
        ("my_rewards.value", r"is int 3, not a reward function"),
        ("no_such_package.mod:fn", r"no module 'no_such_package.mod' can be imported"),
    ]:
        with pytest.raises(PlaitError, match=message):
            resolve_reward_funcs([spec], plugins)
    # a dotted string whose module does not exist is a misspelt name, not an import path
    with pytest.raises(PlaitError, match=r"unknown reward 'no_such_package.fn'"):
        resolve_reward_funcs(["no_such_package.fn"], plugins)


def test_a_third_party_reward_source_answers_the_hook():
    class Judges:
        @hookimpl
        def resolve_reward(self, spec, processing_class):
            if isinstance(spec, str) and spec.startswith("judge://"):
                return RewardFunction(spec[len("judge://"):], length_reward)
            return None

    fresh = make_plugins(plugins=[Judges()])
    (func,) = resolve_reward_funcs([{"name": "judge://gpt", "weight": 2.0}], fresh)
    assert (func.name, func.weight, func.fn) == ("gpt", 2.0, length_reward)


# ---------------------------------------------------------------------------------------------
# Sequence-classification reward models
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reward_model_folder(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from plait.testing.tiny_model import tiny_model_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path_factory.mktemp("rm") / "tiny-rm"
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def single_scores(folder, texts, special_tokens=True):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return [model(**tokenizer(t, return_tensors="pt", add_special_tokens=special_tokens)).logits[0, 0].item()
                for t in texts]


def test_a_reward_model_folder_scores_prompt_plus_completion(plugins, reward_model_folder):
    (func,) = resolve_reward_funcs([str(reward_model_folder)], plugins)
    assert func.name == "tiny-rm" and not func.is_async
    prompts, completions = ["What is 7 plus 5?", "Say hi"], [" The answer is 12.", " hi there, how are you today"]
    out = compute_rewards([func], prompts=prompts, completions=completions, completion_ids=[[1], [1]])
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(reward_model_folder).eos_token  # as the RM saw completions in training
    expected = single_scores(reward_model_folder, [p + c + eos for p, c in zip(prompts, completions)])
    assert out[:, 0].tolist() == pytest.approx(expected, abs=1e-4)  # padding in the batch changes nothing
    assert out[0, 0] != out[1, 0]


def test_a_reward_model_applies_its_chat_template_to_conversations(plugins, reward_model_folder):
    from transformers import AutoTokenizer

    (func,) = resolve_reward_funcs([reward_model_folder], plugins)  # a Path works too
    prompts = [[{"role": "user", "content": "What is 9 times 8?"}], [{"role": "user", "content": "Hello"}]]
    completions = [messages("It is 72."), "Hi!"]
    out = compute_rewards([func], prompts=prompts, completions=completions, completion_ids=[[1], [1]])
    tokenizer = AutoTokenizer.from_pretrained(reward_model_folder)
    texts = [tokenizer.apply_chat_template(p + messages(completion_text(c)), tokenize=False)
             for p, c in zip(prompts, completions)]
    assert "<|im_start|>assistant\nIt is 72.<|im_end|>" in texts[0]
    assert out[:, 0].tolist() == pytest.approx(single_scores(reward_model_folder, texts, special_tokens=False), abs=1e-4)


def test_a_loaded_reward_model_is_accepted_and_pickles(plugins, reward_model_folder):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_model_folder)
    (func,) = resolve_reward_funcs([{"name": model, "weight": 0.5}], plugins)
    assert (func.name, func.weight) == ("tiny-rm", 0.5)
    inputs = dict(prompts=["a"], completions=["b"], completion_ids=[[1]], trainer_state=None)
    assert pickle.loads(pickle.dumps(func))(**inputs) == pytest.approx(func(**inputs))


def test_a_reward_model_uses_the_processing_class_it_is_given(plugins, reward_model_folder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_model_folder)
    (by_path,) = resolve_reward_funcs([str(reward_model_folder)], plugins, tokenizer)
    assert by_path.fn.tokenizer is tokenizer
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_folder)
    (by_model,) = resolve_reward_funcs([model], plugins, processing_class=tokenizer)
    assert by_model.fn.tokenizer is tokenizer and by_model.fn.model is model


def test_reward_model_errors(plugins, reward_model_folder, tmp_path):
    from transformers import AutoConfig, LlamaForSequenceClassification

    from plait.testing.tiny_model import tiny_model_path

    with pytest.raises(PlaitError, match=r"is a \['LlamaForCausalLM'\] checkpoint, not a …ForSequenceClassification"):
        resolve_reward_funcs([str(tiny_model_path())], plugins)
    with pytest.raises(PlaitError, match=r"reward model folder './no/such/folder' does not exist"):
        resolve_reward_funcs(["./no/such/folder"], plugins)
    two = LlamaForSequenceClassification(AutoConfig.from_pretrained(reward_model_folder, num_labels=2))
    with pytest.raises(PlaitError, match=r"has num_labels=2; a reward model has one output"):
        resolve_reward_funcs([two], plugins)
    with pytest.raises(PlaitError, match=r"reward model 'someone/no-such-model' could not be loaded"):
        resolve_reward_funcs(["someone/no-such-model"], plugins)  # the hub is offline in tests


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------

def test_reward_metrics_hand_computed():
    rewards = torch.tensor([[1.0, 0.0], [0.0, NAN], [1.0, 1.0], [1.0, 1.0]])
    metrics = reward_metrics(rewards, ["f", "g"], group_size=2, weights=[1.0, 2.0])
    # R = [1, 0, 3, 3]; f: mean 0.75, unbiased std 0.5; g over its 3 scores [0, 1, 1]
    assert metrics["rewards/f/mean"] == pytest.approx(0.75)
    assert metrics["rewards/f/std"] == pytest.approx(0.5)
    assert metrics["rewards/g/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/g/std"] == pytest.approx(math.sqrt(1 / 3))
    assert metrics["reward"] == pytest.approx(7 / 4)
    assert metrics["reward_std"] == pytest.approx(math.sqrt(0.5) / 2)  # groups: std √½ and 0
    assert metrics["frac_reward_zero_std"] == pytest.approx(0.5)


def test_reward_metrics_skip_completions_no_reward_scored():
    rewards = torch.tensor([[NAN], [2.0], [NAN], [NAN]])
    metrics = reward_metrics(rewards, ["f"], group_size=2)
    assert metrics["reward"] == 2.0 and metrics["rewards/f/std"] == 0.0
    assert metrics["reward_std"] == 0.0 and metrics["frac_reward_zero_std"] == 1.0
    with pytest.raises(PlaitError, match="4 completions do not split into groups of 3"):
        reward_metrics(rewards, ["f"], group_size=3)
