"""Environments as plugins (``register_environments``, ``env.<name>``), TRL's environment_factory and
rollout_func, and the check_environment contract: multi-turn episodes driven through the
transformers backend on the tiny model taught the calculator's call format."""

from __future__ import annotations

import pytest

import plait
from plait.errors import PlaitError
from plait.manager import make_plugins
from plait.online.rollouts import Environment, Step
from plait.online.tools import ToolCall
from plait.plugins.environments.arithmetic import ArithmeticEnvironment, ArithmeticParams, correct_answer
from plait.testing import ContractViolation, check_environment
from plait.testing.tool_model import QUESTION

QUESTION_ROW = {"prompt": [{"role": "user", "content": QUESTION}], "answer": 7}


def config(**overrides):
    values = dict(output_dir="/tmp/plait-test-envs", per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=96, learning_rate=1e-3, max_steps=1, logging_steps=1, report_to=[],
                  save_strategy="no", disable_tqdm=True, seed=0, temperature=0.5)
    return plait.GRPOConfig(**(values | overrides))


def test_built_in_environments_and_parsers_are_registered_under_env():
    names = make_plugins().environments.names()
    assert {"env.arithmetic", "env.calculator", "env.python", "env.parser.hermes"} <= set(names)


def test_the_arithmetic_environment_runs_tools_and_rewards_the_kth_right_attempt():
    env = ArithmeticEnvironment(ArithmeticParams(attempts=3))
    assert env.reset(QUESTION_ROW) == QUESTION_ROW["prompt"]
    step = env.step("", [ToolCall("calculator", {"expression": "3 + 4"})])
    assert step == Step([{"role": "tool", "name": "calculator", "content": "7"}], done=False, calls=1, failures=0)
    step = env.step("It is 8", [])
    assert not step.done and step.messages == [{"role": "user", "content": "That is not right, try again."}]
    assert env.step("The answer is 7.", []).done and env.reward() == 0.5
    assert correct_answer([[{"role": "assistant", "content": "7"}], "it is 9"], [7, 7]) == [1.0, 0.0]


def test_the_python_environment_runs_code_in_a_sandbox_and_reports_its_errors():
    component = make_plugins().environments.get("env.python")
    env = component.obj(component.make_params(timeout=2.0, memory_mb=128))
    step = env.step("", [ToolCall("run_python", {"code": "print(2 + 2)"}), ToolCall("run_python", {"code": "1 / 0"}),
                         ToolCall("run_python", {"code": "while True: pass"})])
    assert [m["content"] for m in step.messages[:2]] == ["4\n", "error: RuntimeError: ZeroDivisionError: division by zero"]
    assert "did not finish within 2.0 s" in step.messages[2]["content"] and (step.calls, step.failures) == (3, 2)


def test_check_environment_passes_built_ins_and_an_environment_only_the_turn_limit_ends(tool_model):
    model, tokenizer = tool_model
    kwargs = dict(model=model, processing_class=tokenizer, temperature=0.5, max_completion_length=96)
    assert len(check_environment("env.arithmetic", [QUESTION_ROW] * 2, **kwargs)) == 5
    check_environment("calculator", [QUESTION_ROW], **kwargs)

    class Overlong(Environment):  # never ends by itself: the turn limit must end it
        def step(self, text, calls):
            return Step([{"role": "user", "content": "again"}])

    check_environment(Overlong, [QUESTION_ROW], max_turns=2, **kwargs)


def test_an_environment_drives_grpo_episodes_and_its_reward_is_a_reward_function(tool_model):
    model, tokenizer = tool_model
    trainer = plait.GRPOTrainer(model, args=config(environment={"name": "arithmetic", "attempts": 2}),
                                train_dataset=[QUESTION_ROW] * 8, processing_class=tokenizer)
    assert [f.name for f in trainer.reward_funcs] == ["environment"]  # reward_funcs may be omitted
    batch = trainer.rollout(next(iter(trainer.get_train_dataloader())))
    metrics = trainer._metrics["eval"]
    assert metrics["episodes/tool_calls"][0] > 0 and metrics["episodes/turns"][0] > 1
    assert batch["tool_mask"].sum() > 0
    assert (batch["tool_mask"] * batch["completion_mask"]).sum() == 0
    assert 0 < metrics["rewards/environment/mean"][0] <= 1


class Counter:
    """TRL's environment_factory contract: public methods are tools, reset(**row), get_reward()."""

    def __init__(self):
        self.total = 0

    def reset(self, **row):
        self.total = 0
        return " Use the tools."

    def add(self, amount: int) -> int:
        """Add to the counter.

        Args:
            amount: how much
        """
        self.total += amount
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


def test_trl_environment_factory_exposes_methods_as_tools_and_owns_the_reward(tool_model):
    model, tokenizer = tool_model
    trainer = plait.GRPOTrainer(model, args=config(max_completion_length=16), train_dataset=[QUESTION_ROW] * 8,
                                processing_class=tokenizer, environment_factory=Counter)
    batch = trainer.rollout(next(iter(trainer.get_train_dataloader())))
    prompt = tokenizer.decode(batch["input_ids"][0][:batch["prompt_length"]], skip_special_tokens=False)
    assert '"name": "add"' in prompt and f"{QUESTION} Use the tools.<|im_end|>" in prompt
    assert trainer._metrics["eval"]["rewards/environment/mean"] == [0.0]  # the model called no add()


def fixed_rollout(prompts, trainer):
    """A rollout_func: two completions per prompt, token 5 the environment's (env_mask 0)."""
    assert len(prompts) == 4  # each prompt once
    ids = [[10, 11, 5, 12, 2]] * 8
    return {"prompt_ids": [[1, 3]] * 4, "completion_ids": ids, "logprobs": None, "env_mask": [[1, 1, 0, 1, 1]] * 8,
            "secret": list(range(8))}


SEEN: dict = {}


def remember(completions, secret, **kwargs):
    SEEN["secret"] = list(secret)
    return [float(s) for s in secret]


def test_a_rollout_func_gives_the_tokens_its_mask_and_columns_for_the_rewards(tool_model):
    model, tokenizer = tool_model
    trainer = plait.GRPOTrainer(model, reward_funcs=remember, args=config(num_generations=2),
                                train_dataset=[QUESTION_ROW] * 8, processing_class=tokenizer,
                                rollout_func=f"{__name__}:fixed_rollout")
    batch = trainer.rollout(next(iter(trainer.get_train_dataloader())))
    assert batch["prompt_length"] == 2 and batch["input_ids"][0].tolist() == [1, 3, 10, 11, 5, 12, 2]
    assert batch["completion_mask"][0].tolist() == [1, 1, 0, 1, 1] and batch["tool_mask"][0].tolist() == [0, 0, 1, 0, 0]
    assert SEEN["secret"] == list(range(8))


def test_bad_agent_settings_fail_before_any_model_loads_naming_the_fix():
    missing = "/nonexistent/model"
    with pytest.raises(PlaitError, match="arithmetc.*arithmetic"):
        plait.GRPOTrainer(missing, args=config(environment="arithmetc"))
    with pytest.raises(PlaitError, match="attemps"):
        plait.GRPOTrainer(missing, args=config(environment={"name": "arithmetic", "attemps": 2}))
    with pytest.raises(PlaitError, match="rollout_func generates the completions itself"):
        plait.GRPOTrainer(missing, reward_funcs=remember, args=config(tools=["plait.plugins.environments.calculator:calculator"]),
                          rollout_func=fixed_rollout)
    with pytest.raises(PlaitError, match="needs reward_funcs"):  # the calculator environment scores nothing itself
        plait.GRPOTrainer(missing, args=config(environment="calculator"))
    with pytest.raises(PlaitError, match="without a reset method"):
        plait.GRPOTrainer(missing, reward_funcs=remember, args=config(), environment_factory=lambda: object())


def test_the_contract_names_a_broken_environment(tool_model):
    model, tokenizer = tool_model

    class Scrambled(Environment):
        def reset(self, row):
            return row["prompt"]

        def reward(self):
            return float("nan")

    with pytest.raises(ContractViolation, match="reward is None or finite"):
        check_environment(Scrambled, [QUESTION_ROW], model=model, processing_class=tokenizer, max_completion_length=8)
