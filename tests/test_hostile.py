"""The last hostile cases, through the installed ``plait`` command: a plugin that exits, a reward
that is no reward, and a disk that fills during a checkpoint save."""

import json
import os
import resource
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from plait.engine.run_folder import is_complete_checkpoint
from plait.errors import PlaitError
from plait.online.scoring import REWARD_TIMEOUT, RewardChoice, resolve_reward_funcs
from plait.testing.tiny_model import tiny_model_path

PLAIT = Path(sys.executable).parent / "plait"  # the console script installed beside this python
DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "demo_sft.jsonl"


def plait(tmp_path: Path, *argv: str, preexec_fn=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(PLAIT), *argv], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
                          preexec_fn=preexec_fn)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The error plait printed: exit status 2, no traceback, one line."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "plait: error:" in line]
    return line[line.index("plait: error:"):]


def grpo_recipe(tmp_path: Path, reward: str) -> Path:
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump({
        "method": "grpo", "model": str(tiny_model_path()),
        "dataset": {"path": "json", "data_files": str(DATA)},
        "reward_funcs": [reward],
        "training": {"output_dir": str(tmp_path / "out"), "num_generations": 4, "per_device_train_batch_size": 8,
                     "max_completion_length": 4, "max_steps": 2, "save_strategy": "no", "report_to": "none"},
    }))
    return recipe


# ---------------------------------------------------------------------------------------------
# A plugin's SystemExit is that plugin's error
# ---------------------------------------------------------------------------------------------

def test_a_reward_raising_system_exit_0_ends_plait_grpo_with_exit_2_naming_it(tmp_path):
    (tmp_path / "judge.py").write_text("def quits(completions, **kwargs):\n    raise SystemExit(0)\n")
    line = one_error_line(plait(tmp_path, "grpo", "--config", str(grpo_recipe(tmp_path, "judge:quits"))))
    assert line.startswith("plait: error: reward 'quits' raised on example 0 of 8 (PluginExit: SystemExit(0) would "
                           "end the process; a reward must raise an exception instead)")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_system_exit_anywhere_else_in_plugin_code_is_named_with_its_place(tmp_path):
    (tmp_path / "judge.py").write_text("import sys\nsys.exit(0)\n")  # at import, while the recipe is checked
    line = one_error_line(plait(tmp_path, "grpo", "--config", str(grpo_recipe(tmp_path, "judge:score")), "--check"))
    assert line.startswith("plait: error: <module> (judge.py:2) raised SystemExit(0) during 'plait grpo'")


@pytest.mark.parametrize("reward_module", [
    "async def quits(completions, **kwargs):\n    raise SystemExit(0)\n",
    "import time\ndef quits(completions, **kwargs):\n    raise SystemExit(0)\n",
])
def test_a_reward_exiting_sync_async_or_under_a_deadline_is_an_error_of_that_reward(reward_module, tmp_path,
                                                                                      monkeypatch):
    from plait.online.scoring import compute_rewards

    (tmp_path / "exiting.py").write_text(reward_module)
    monkeypatch.syspath_prepend(str(tmp_path))
    (func,) = resolve_reward_funcs(["exiting:quits"])
    for timeout in (None, 5):
        with pytest.raises(PlaitError, match=r"reward 'quits' raised on example 0 of 1 \(PluginExit: SystemExit\(0\)"):
            compute_rewards([func], prompts=["q"], completions=["a"], completion_ids=[[1]], timeout=timeout)


# ---------------------------------------------------------------------------------------------
# --check says "valid" only for callables that take a reward's arguments
# ---------------------------------------------------------------------------------------------

def test_check_refuses_an_importable_callable_that_is_no_reward(tmp_path):
    line = one_error_line(plait(tmp_path, "grpo", "--config", str(grpo_recipe(tmp_path, "os:system")), "--check"))
    assert line == ("plait: error: reward_funcs[0]: system(command) does not take a reward's arguments: plait calls "
                    "fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=..., "
                    "log_metric=..., <dataset column>=...); give it **kwargs, e.g. def system(completions, **kwargs)")


def keywords(completions, **kwargs):
    return [0.0] * len(completions)


def every_argument_named(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, weight=1.0):
    return [weight] * len(completions)


def completions_only(completions):
    return [0.0] * len(completions)


def positional_only(completions, /, **kwargs):
    return [0.0] * len(completions)


def test_a_reward_takes_keyword_arguments_or_names_every_one():
    assert [f.name for f in resolve_reward_funcs([keywords, every_argument_named])] == ["keywords",
                                                                                       "every_argument_named"]
    for no_reward in (completions_only, positional_only):
        with pytest.raises(PlaitError, match=f"{no_reward.__name__}.* does not take a reward's arguments"):
            resolve_reward_funcs([no_reward])


def test_a_reward_call_has_a_finite_deadline_unless_lifted():
    assert RewardChoice().reward_timeout == REWARD_TIMEOUT == 300.0
    assert RewardChoice(reward_timeout=None).reward_timeout is None  # TRL's behaviour, on request


# ---------------------------------------------------------------------------------------------
# A full disk during a checkpoint save
# ---------------------------------------------------------------------------------------------

def test_a_checkpoint_save_that_hits_the_file_size_limit_says_so_and_keeps_the_last_good_one(tmp_path):
    out = tmp_path / "sft"
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump({
        "method": "sft", "model": str(tiny_model_path()), "dataset": {"path": "json", "data_files": str(DATA)},
        "training": {"output_dir": str(out), "max_steps": 2, "per_device_train_batch_size": 8, "max_length": 64,
                     "save_strategy": "steps", "save_steps": 2, "report_to": "none"},
    }))

    def umask_027():
        os.umask(0o027)

    first = plait(tmp_path, "sft", "--config", str(recipe), preexec_fn=umask_027)
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (out / ".staging").exists()  # the staged save moved out, and its folder went with it
    for written in (out / "model.safetensors", out / "checkpoint-2" / "model.safetensors",
                    out / "checkpoint-2" / "optimizer.pt"):
        assert stat.S_IMODE(written.stat().st_mode) == 0o640, written

    def one_megabyte_files():  # a full disk as one process sees it: writes past 1 MB fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, resource.RLIM_INFINITY))

    resumed = plait(tmp_path, "sft", "--config", str(recipe), "--max_steps", "4", "--resume_from_checkpoint",
                    str(out / "checkpoint-2"), preexec_fn=one_megabyte_files)
    line = one_error_line(resumed)
    assert line.startswith(f"plait: error: step 4: could not save checkpoint-4 in {out}: optimizer.pt reached the "
                           "file size limit (ulimit -f) of 1,000,000 bytes; about ")
    assert line.endswith(f" bytes were to be written; the last good checkpoint {out / 'checkpoint-2'} is kept; free "
                         "space or lift the limit, then resume")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-2"]  # no .staging, no checkpoint-4
    assert is_complete_checkpoint(out / "checkpoint-2")
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
