"""Dynamic sampling: rollout filters (plait.online.filtering, plugins/rollout_filters) and the refilled batch.

Each built-in filter's verdict on hand-made groups; the refill prompt stream and its state; the contract
check of the kind; refusals before any model loads; GRPO through the installed ``plait grpo`` command
with ``zero_variance`` dropping and refilling groups (metrics show it); RLOO with a filter; a GRPO run
with refills killed with SIGKILL and resumed from its checkpoint with the uninterrupted run's weights; and
GRESO's pre-rollout skip (``skip_dropped_prompts``): its draws, its joined batches, its refusals, and
``plait grpo`` sampling solved prompts less often and resuming exactly.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from safetensors.torch import load_file

import plait
from plait.errors import PlaitError
from plait.online.chassis import prompt_ids_of
from plait.online.filtering import PromptHistory, PromptStream, RolloutGroup, joined_prompt_batches, resolve_rollout_filters
from plait.testing import ContractViolation, check_rollout_filter
from plait.testing.tiny_model import tiny_model_path

PLAIT = Path(sys.executable).parent / "plait"  # the console script installed beside this python
WORDS = ("The river", "A good answer", "What is 7 plus 5?", "Python is", "The weather today", "Numbers such as",
         "The children", "Nobody could")
MISSING = "/nonexistent/model"  # loading it would fail: these errors must come first
NAN = math.nan


def group(rewards, lengths=None, truncated=None) -> RolloutGroup:
    rewards = torch.tensor(rewards, dtype=torch.float64)
    n = len(rewards)
    lengths = torch.tensor(lengths or [4] * n)
    truncated = torch.tensor(truncated or [False] * n)
    return RolloutGroup("p", rewards, rewards.float()[:, None], lengths, truncated)


def keeps(spec, g: RolloutGroup) -> bool:
    (rollout_filter,) = resolve_rollout_filters([spec])
    return rollout_filter.keeps(g)


# -- the built-in filters, by hand --------------------------------------------------------------


@pytest.mark.parametrize("rewards, kept", [
    ([1.0, 1.0, 1.0, 1.0], False),   # all equal: zero advantage, DAPO drops it
    ([0.0, 0.0, 0.0, 0.0], False),
    ([0.0, 1.0, 0.0, 0.0], True),
    ([0.5, NAN, 0.5, 0.5], False),   # the unscored completion does not make the group vary
    ([0.5, NAN, 0.7, NAN], True),
    ([NAN, NAN, 2.0, NAN], False),   # one scored completion: nothing to compare
])
def test_zero_variance_keeps_only_groups_whose_rewards_differ(rewards, kept):
    assert keeps("zero_variance", group(rewards)) is kept


def test_zero_variance_tolerance_counts_close_rewards_as_equal():
    assert keeps({"name": "zero_variance", "tolerance": 0.05}, group([0.50, 0.52, 0.54])) is False
    assert keeps({"name": "zero_variance", "tolerance": 0.05}, group([0.50, 0.52, 0.56])) is True


@pytest.mark.parametrize("params, truncated, lengths, kept", [
    ({}, [False, False, False, False], [3, 4, 5, 6], True),
    ({}, [False, True, False, False], [3, 4, 5, 6], False),        # default: no truncated completion
    ({"max_fraction": 0.25}, [False, True, False, False], [3, 4, 5, 6], True),
    ({"max_fraction": 0.25}, [True, True, False, False], [3, 4, 5, 6], False),
    ({"max_fraction": 1.0, "max_length": 5}, [False] * 4, [3, 4, 5, 6], False),  # 6 tokens > 5
    ({"max_fraction": 1.0, "max_length": 6}, [True] * 4, [3, 4, 5, 6], True),
])
def test_truncation_drops_groups_with_too_many_cut_completions(params, truncated, lengths, kept):
    assert keeps({"name": "truncation", **params}, group([0.0, 1.0, 0.0, 1.0], lengths, truncated)) is kept


@pytest.mark.parametrize("rewards, kept", [
    ([1.0, 1.0, 1.0, 1.0], False),   # pass rate 1.0 > 0.9
    ([0.0, 0.0, 0.0, 0.0], False),   # 0.0 < 0.25
    ([1.0, 0.0, 0.0, 0.0], True),    # 0.25, the low end is inside
    ([1.0, 1.0, 1.0, 0.0], True),    # 0.75
    ([1.0, NAN, NAN, NAN], True),    # unscored completions fail: 0.25
    ([0.9, 0.9, 0.9, 0.9], False),   # below success=1.0: none passed
])
def test_accuracy_band_keeps_groups_whose_pass_rate_is_in_the_band(rewards, kept):
    assert keeps({"name": "accuracy_band", "low": 0.25, "high": 0.9}, group(rewards)) is kept


def test_accuracy_band_success_threshold_is_a_parameter():
    assert keeps({"name": "accuracy_band", "low": 0.5, "high": 1.0, "success": 0.5}, group([0.6, 0.7, 0.1, 0.2]))
    assert not keeps({"name": "accuracy_band", "low": 0.5, "high": 1.0, "success": 0.65}, group([0.6, 0.7, 0.1, 0.2]))


@pytest.mark.parametrize("spec, message", [
    ({"name": "accuracy_band", "low": 0.9, "high": 0.1}, "low=0.9 is above high=0.1"),
    ({"name": "accuracy_band", "high": 1.5}, "high=1.5"),
    ({"name": "zero_varience"}, "unknown rollout filter 'zero_varience'.*did you mean 'filter.zero_variance'"),
    ({"low": 0.1}, r"rollout_filters\[0\] needs a name"),
])
def test_bad_filter_entries_are_one_line_errors(spec, message):
    with pytest.raises(PlaitError, match=message) as err:
        resolve_rollout_filters([spec])
    assert "\n" not in str(err.value)


# -- the refill stream ----------------------------------------------------------------------------


def test_prompt_stream_hands_out_every_prompt_once_per_pass_and_resumes_where_it_stood():
    stream = PromptStream(5, shuffle=True, seed=0)
    first = stream.take(3) + stream.take(2)
    assert sorted(first) == [0, 1, 2, 3, 4] and stream.state_dict() == {"epoch": 1, "position": 0}
    crossing = stream.take(4) + stream.take(3)  # the second pass, then into the third
    assert sorted(crossing[:5]) == [0, 1, 2, 3, 4] and crossing[:5] != first  # a fresh order each pass
    state = stream.state_dict()
    assert state == {"epoch": 2, "position": 2}
    ahead = stream.take(6)
    again = PromptStream(5, shuffle=True, seed=0)
    again.load_state_dict(state)
    assert again.take(6) == ahead
    assert PromptStream(4, shuffle=False, seed=0).take(6) == [0, 1, 2, 3, 0, 1]


# -- GRESO's pre-rollout skip -----------------------------------------------------------------------


def test_a_prompt_dropped_k_times_running_is_sampled_with_probability_p_to_the_k_until_a_group_is_kept():
    history = PromptHistory(0.5, seed=3)
    key = PromptHistory.key([5, 6, 7])
    assert key == PromptHistory.key([5, 6, 7]) != PromptHistory.key([5, 6, 8])
    slots = range(20_000)
    for k in range(4):
        share = sum(history.samples(key, 11, slot) for slot in slots) / len(slots)
        assert history.keep_probability(key) == 0.5 ** k
        assert abs(share - 0.5 ** k) < 0.012, (k, share)
        history.update(key, dropped=True)
    resumed = PromptHistory(0.5, seed=3)
    resumed.load_state_dict(history.state_dict())
    assert [resumed.samples(key, 11, s) for s in range(200)] == [history.samples(key, 11, s) for s in range(200)]
    assert [PromptHistory(0.5, seed=4).samples(key, 11, s) for s in range(200)] != [history.samples(key, 11, s)
                                                                                    for s in range(200)]
    history.update(key, dropped=False)  # a kept group: the prompt is sampled again for sure
    assert all(history.samples(key, 11, s) for s in range(200)) and history.state_dict()["dropped_in_a_row"] == {}


def test_joined_prompt_batches_repad_on_the_left_and_keep_every_prompt_and_column():
    narrow = {"input_ids": torch.tensor([[0, 7, 8], [9, 9, 9]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
              "answer": ["a", "b"]}
    wide = {"input_ids": torch.tensor([[0, 0, 0, 0, 4]]), "attention_mask": torch.tensor([[0, 0, 0, 0, 1]]),
            "answer": ["c"]}
    out = joined_prompt_batches([narrow, wide], pad_id=0)
    assert prompt_ids_of(out) == [[7, 8], [9, 9, 9], [4]]
    assert out["input_ids"].shape == (3, 5) and out["answer"] == ["a", "b", "c"]
    assert out["attention_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]


@pytest.mark.parametrize("trainer, config, overrides, message", [
    ("GRPOTrainer", "GRPOConfig", {"skip_dropped_prompts": 0.5},
     "skip_dropped_prompts=0.5 skips prompts the rollout_filters kept dropping, but no rollout_filters are set"),
    ("GRPOTrainer", "GRPOConfig", {"skip_dropped_prompts": 1.0, "rollout_filters": ["zero_variance"]},
     r"skip_dropped_prompts=1.0 must be in \(0.0, 1.0\)"),
    ("AsyncGRPOTrainer", "AsyncGRPOConfig", {"skip_dropped_prompts": 0.5, "rollout_filters": ["zero_variance"]},
     "AsyncGRPOTrainer's worker samples each batch's prompts ahead"),
])
def test_skips_that_cannot_work_are_refused_before_the_model_loads(trainer, config, overrides, message):
    with pytest.raises(PlaitError, match=message) as err:
        args = getattr(plait, config)(output_dir="/tmp/plait-test-skip", max_steps=1, **{**COMMON, **overrides})
        getattr(plait, trainer)(MISSING, reward_funcs=parity, args=args,
                                train_dataset=Dataset.from_list([{"prompt": w} for w in WORDS]))
    assert "\n" not in str(err.value)


# -- the contract check of the kind ----------------------------------------------------------------


def test_contract_check_passes_the_builtins_and_names_an_order_dependent_filter():
    for name in ("filter.zero_variance", "filter.truncation", "filter.accuracy_band"):
        assert "ignores the completions' order" in check_rollout_filter(name)
    from plait.registry import Component

    first_wins = Component(kind="rollout filter", name="filter.first_wins", obj=lambda g: bool(g.rewards[0] > 0))
    with pytest.raises(ContractViolation, match="ignores the completions' order"):
        check_rollout_filter(first_wins)
    says_maybe = Component(kind="rollout filter", name="filter.maybe", obj=lambda g: "maybe")
    with pytest.raises(ContractViolation, match="keeps or drops"):
        check_rollout_filter(says_maybe)


# -- refusals before any model loads ---------------------------------------------------------------


def parity(completion_ids, **kwargs):
    """1 when the first sampled token id is even: two completions of a prompt tie half the time."""
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


COMMON = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=4, learning_rate=1e-2,
              logging_steps=1, report_to="none", disable_tqdm=True, seed=0)


@pytest.mark.parametrize("trainer, config, overrides, streamed, message", [
    ("GRPOTrainer", "GRPOConfig", {"max_num_gen_batches": 0}, False, "max_num_gen_batches=0 must be an integer >= 1"),
    ("OnlineDPOTrainer", "OnlineDPOConfig", {}, False, "online DPO's judge ranks pairs, so there are no group rewards"),
    ("RLOOTrainer", "RLOOConfig", {}, True, "refill batches from the train_dataset by index, which a stream has not"),
])
def test_runs_that_cannot_refill_are_refused_before_the_model_loads(trainer, config, overrides, streamed, message):
    dataset = Dataset.from_list([{"prompt": w} for w in WORDS])
    with pytest.raises(PlaitError, match=message) as err:
        args = getattr(plait, config)(output_dir="/tmp/plait-test-filters", max_steps=1,
                                      **{**COMMON, "rollout_filters": ["zero_variance"], **overrides})
        getattr(plait, trainer)(MISSING, reward_funcs=parity, args=args,
                                train_dataset=dataset.to_iterable_dataset() if streamed else dataset)
    assert "\n" not in str(err.value)


# -- GRPO through the installed command, RLOO through the API -------------------------------------

REWARDS = '''
import os, time

def parity(completion_ids, trainer_state=None, **kwargs):
    """1 for an even first token; with PLAIT_TEST_HANG_AT set it hangs from that step on (the test kills there)."""
    hang = os.environ.get("PLAIT_TEST_HANG_AT")
    if hang and trainer_state.global_step >= int(hang):
        open(os.environ["PLAIT_TEST_HANG_MARKER"], "w").close()
        time.sleep(600)
    return [float(ids[0] % 2 == 0) if ids else 0.0 for ids in completion_ids]


def solved_or_parity(prompts, completion_ids, **kwargs):
    """1 for the first four prompts whatever was sampled (solved: every group ties), parity for the others;
    each prompt scored is appended to the file PLAIT_TEST_SEEN names."""
    with open(os.environ["PLAIT_TEST_SEEN"], "a") as seen:
        seen.writelines(p + "\\n" for p in prompts)
    return [1.0 if p in SOLVED else float(ids[0] % 2 == 0) for p, ids in zip(prompts, completion_ids)]


SOLVED = ("The river", "A good answer", "What is 7 plus 5?", "Python is")
'''


def plait_grpo(tmp_path: Path, output: Path, *extra: str, method: str = "grpo", reward: str = "parity",
               training: dict | None = None, **env: str) -> subprocess.Popen:
    (tmp_path / "filter_rewards.py").write_text(REWARDS)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS))
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump({
        "method": method, "model": str(tiny_model_path()),
        "dataset": {"path": "json", "data_files": "prompts.jsonl"},
        "reward_funcs": [f"filter_rewards:{reward}"],
        "training": {**COMMON, "max_steps": 6, "save_strategy": "steps", "save_steps": 3, "max_num_gen_batches": 3,
                     "rollout_filters": [{"name": "zero_variance"}], **(training or {})},
    }))
    command = [str(PLAIT), method, "--config", str(recipe), "--output_dir", str(output), *extra]
    return subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    out, _ = process.communicate(timeout=600)
    assert process.returncode == 0, out[-3000:]
    return out


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def history(checkpoint: Path, key: str) -> list:
    log = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return [(h["step"], h[key]) for h in log if key in h]


@pytest.mark.slow
def test_plait_grpo_drops_zero_variance_groups_refills_them_and_resumes_bit_identically_after_sigkill(tmp_path):
    # 2 prompts × 2 completions per step; parity ties a pair half the time, so most steps drop a group and
    # sample further prompts from the refill stream. Killed while scoring step 4 (after checkpoint-3), the
    # resumed run must draw the same refill prompts: the stream's place comes back from the checkpoint.
    straight = tmp_path / "straight"
    finish(plait_grpo(tmp_path, straight))
    logs = [m for m in metrics(straight) if "rollout_filter/rounds" in m]
    assert len(logs) == 6
    assert sum(m["rollout_filter/dropped_groups"] for m in logs) >= 3
    assert max(m["rollout_filter/rounds"] for m in logs) >= 2
    for m in logs:  # each round consumes 2 prompts; the trained batch holds only groups whose rewards differ
        assert m["rollout_filter/prompts"] == 2 * m["rollout_filter/rounds"]
        assert m["rollout_filter/dropped/filter.zero_variance"] == m["rollout_filter/dropped_groups"]
        assert m["frac_reward_zero_std"] == 0.0 or m["rollout_filter/padded_groups"] > 0
    generated = [m["rollout_filter/generated_tokens"] for m in logs]
    assert generated[-1] == 2 * 2 * 4 * sum(m["rollout_filter/rounds"] for m in logs)  # 4 tokens per completion

    marker = tmp_path / "hung"
    killed = plait_grpo(tmp_path, tmp_path / "killed", PLAIT_TEST_HANG_AT="4", PLAIT_TEST_HANG_MARKER=str(marker))
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert killed.poll() is None, killed.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.kill(killed.pid, signal.SIGKILL)
    killed.communicate()
    checkpoint = tmp_path / "killed" / "checkpoint-3"
    finish(plait_grpo(tmp_path, tmp_path / "killed", "--resume_from_checkpoint", str(checkpoint)))
    a, b = (load_file(run / "checkpoint-6" / "model.safetensors") for run in (straight, tmp_path / "killed"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    for key in ("loss", "rollout_filter/rounds", "rollout_filter/generated_tokens"):
        assert history(tmp_path / "killed" / "checkpoint-6", key) == history(straight / "checkpoint-6", key)


@pytest.mark.slow
def test_rloo_refills_dropped_groups_and_skips_prompts_dropped_before():
    args = plait.RLOOConfig(output_dir="/tmp/plait-test-filters-rloo", max_steps=4, save_strategy="no",
                            rollout_filters=["zero_variance"], max_num_gen_batches=4, skip_dropped_prompts=0.5,
                            **COMMON)
    t = plait.RLOOTrainer(str(tiny_model_path()), reward_funcs=parity, args=args,
                          train_dataset=Dataset.from_list([{"prompt": w} for w in WORDS]))
    t.train()
    logs = [h for h in t.state.log_history if "rollout_filter/rounds" in h]
    assert len(logs) == 4 and sum(h["rollout_filter/dropped_groups"] for h in logs) >= 1
    assert sum(h["rollout_filter/skipped_prompts"] for h in logs) >= 1
    assert all(h["frac_reward_zero_std"] == 0.0 or h["rollout_filter/padded_groups"] > 0 for h in logs)


@pytest.mark.slow
def test_plait_async_grpo_refills_dropped_groups_from_the_current_weights(tmp_path):
    # The worker samples each generation batch ahead; a refill round's prompts come from the stream only
    # once the batch is scored, so the trainer samples them itself, from its current weights (staleness 0).
    output = tmp_path / "async"
    finish(plait_grpo(tmp_path, output, "--max_steps", "4", "--save_strategy", "no", "--max_staleness", "1",
                      method="async_grpo"))
    logs = [m for m in metrics(output) if "rollout_filter/rounds" in m]
    assert len(logs) == 4
    assert sum(m["rollout_filter/dropped_groups"] for m in logs) >= 2
    assert max(m["rollout_filter/rounds"] for m in logs) >= 2
    for m in logs:
        assert m["frac_reward_zero_std"] == 0.0 or m["rollout_filter/padded_groups"] > 0
        assert m["async/staleness"] <= 1  # the worker's batches keep to max_staleness


@pytest.mark.slow
def test_plait_grpo_skips_prompts_the_filter_kept_dropping_and_resumes_exactly(tmp_path):
    # Four of the eight prompts always score 1, so zero_variance drops every group of theirs; with
    # skip_dropped_prompts 0.5 a solved prompt dropped k times running is sampled with probability 0.5**k and
    # the next prompt of the stream takes its place. Without the skip the solved prompts are half of those
    # sampled (each is sampled the same number of times); with it, far fewer. A run resumed from checkpoint-3
    # (the skip history comes back from it) ends with the straight run's weights and metrics.
    def run(name: str, skip: float | None, *extra: str) -> list[str]:
        seen = tmp_path / f"{name}.seen"
        finish(plait_grpo(tmp_path, tmp_path / name, *extra, reward="solved_or_parity", PLAIT_TEST_SEEN=str(seen),
                          training={"per_device_train_batch_size": 8, "num_generations": 4, "max_steps": 8,
                                    "save_steps": 4, "skip_dropped_prompts": skip}))
        return seen.read_text().splitlines()[::4]  # one line per group

    solved = {"The river", "A good answer", "What is 7 plus 5?", "Python is"}
    plain = run("plain", None)
    skipping = run("skipping", 0.5)
    share = {name: sum(p in solved for p in seen) / len(seen) for name, seen in (("plain", plain), ("skip", skipping))}
    assert 0.4 <= share["plain"] <= 0.6 and share["skip"] < share["plain"] - 0.1, share
    logs = [m for m in metrics(tmp_path / "skipping") if "rollout_filter/rounds" in m]
    assert len(logs) == 8 and sum(m["rollout_filter/skipped_prompts"] for m in logs) >= 4
    assert all("rollout_filter/skipped_prompts" not in m for m in metrics(tmp_path / "plain"))

    checkpoint = tmp_path / "skipping" / "checkpoint-4"
    resumed_seen = run("resumed", 0.5, "--resume_from_checkpoint", str(checkpoint))
    assert resumed_seen == skipping[len(skipping) - len(resumed_seen):]  # the same prompts after the checkpoint
    a, b = (load_file(tmp_path / run / "checkpoint-8" / "model.safetensors") for run in ("skipping", "resumed"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    for key in ("loss", "rollout_filter/skipped_prompts", "rollout_filter/generated_tokens"):
        assert history(tmp_path / "resumed" / "checkpoint-8", key) == history(tmp_path / "skipping" / "checkpoint-8", key)


@pytest.mark.slow
def test_two_processes_keep_one_skip_history(tmp_path):
    # Each process scores its own groups; the verdicts are gathered, so both processes hold the same
    # history (a prompt that lands on the other process next time is skipped there too), saved per process.
    output = tmp_path / "two"
    finish(plait_grpo(tmp_path, output, "--num_processes", "2", "--max_steps", "4", "--save_steps", "4",
                      training={"skip_dropped_prompts": 0.5}))
    first, second = (torch.load(output / "checkpoint-4" / f"plait_resume_state_{rank}.pt",
                                weights_only=True)["rollout_filters"]["history"] for rank in (0, 1))
    assert first == second and len(first["dropped_in_a_row"]) >= 2
    assert all("rollout_filter/skipped_prompts" in m for m in metrics(output) if "rollout_filter/rounds" in m)
