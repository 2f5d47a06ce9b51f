"""The command line's manners (issue 32), each through the installed ``plait`` console script as a user
types it: ``--version``; did-you-mean for a misspelt command; dash and underscore spellings of commands
and flags; a positional recipe; a flag without its value; grouped ``--help`` and ``--help-all``; an
unknown loss suggested within its family; listings that survive a broken third-party plugin; a reward
module named from the working directory; and what a run leaves behind: the model card's paths, the
``--overwrite_output_dir`` refusal, ``metrics.jsonl`` and ``plait report``."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import plait
from plait.cli import _only_lists, main
from plait.manager import make_plugins
from plait.plugins.callbacks.metrics_log import METRICS_FILE, MetricsLog, read_metrics
from plait.testing.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
PLAIT = Path(sys.executable).parent / "plait"  # the console script installed beside this python
DATA = ROOT / "examples" / "data"


def plait_command(*args: str, cwd: Path | None = None, pythonpath: Path | None = None,
                  env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), full_env.get("PYTHONPATH", "")])
    return subprocess.run([str(PLAIT), *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=900)


def plait_main(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``plait ARGS`` through the console script's own entry point, :func:`plait.cli.main`, in this process:
    the argument-level manners below need no fresh interpreter (~10 s each); each family keeps one case
    through the installed script."""
    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd or previous)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as stop:  # argparse's --help and usage errors
                code = stop.code
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess(["plait", *args], code, out.getvalue(), err.getvalue())


def error_line(done: subprocess.CompletedProcess) -> str:
    """The one line a refused command prints (besides plait's own warnings and libraries' noise)."""
    lines = [line for line in done.stderr.splitlines() if line.startswith("plait: error:")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A user's folder: a DPO recipe whose paths are its own (the model by absolute path, the data beside it)."""
    folder = tmp_path_factory.mktemp("user")
    shutil.copy(DATA / "demo_preferences.jsonl", folder / "prefs.jsonl")
    shutil.copy(DATA / "demo_sft.jsonl", folder / "sft.jsonl")
    (folder / "recipe.yaml").write_text(textwrap.dedent(f"""\
        method: dpo
        model: {tiny_model_path()}
        dataset: prefs.jsonl
        training: {{output_dir: out, max_steps: 1, report_to: none}}
        """))
    return folder


# -- 1. --version -----------------------------------------------------------------------------------


def test_version_names_plaits_version_and_where_it_is_installed():
    done = plait_command("--version")
    assert done.returncode == 0, done.stderr
    where = os.path.dirname(os.path.abspath(plait.__file__))
    assert done.stdout.startswith(f"plait {plait.__version__} ({where}, Python ")
    assert done.stdout.count("\n") == 1


# -- 2. did you mean ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("typed", "meant"), [("dpoo", "dpo"), ("grpoo", "grpo"), ("vllm-serv", "vllm-serve"),
                                              ("onlinedpo", "online_dpo")])
def test_a_misspelt_command_is_one_line_naming_the_closest(typed, meant):
    assert error_line(plait_command(typed)) == f"plait: error: unknown command {typed!r}; did you mean 'plait {meant}'?"


def test_a_command_like_no_other_points_at_the_list():
    assert error_line(plait_command("zzzzzz")) == ("plait: error: unknown command 'zzzzzz'; "
                                                   "'plait --help' lists the commands")


# -- 3. dash and underscore spellings -----------------------------------------------------------------


@pytest.mark.parametrize(("typed", "command"), [("online-dpo", "online_dpo"), ("online_dpo", "online_dpo"),
                                                ("vllm_serve", "vllm-serve"), ("vllm-serve", "vllm-serve"),
                                                ("reward-model", "reward_model")])
def test_commands_answer_to_dashes_and_underscores(typed, command):
    done = (plait_command if typed == "online-dpo" else plait_main)(typed, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: plait {command} ")


def third_party(site: Path, name: str, source: str) -> Path:
    """A distribution as pip leaves it: ``name``.py and a dist-info whose entry point (group ``plait``) loads it."""
    site.mkdir(exist_ok=True)
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[plait]\n{name} = {name}\n")
    (site / f"{name}.py").write_text(textwrap.dedent(source))
    return site


def test_a_third_party_commands_name_is_spelt_either_way(tmp_path):
    site = third_party(tmp_path / "site", "plait_hello", """
        from plait import hookimpl
        from plait.cli import Command

        @hookimpl
        def register_commands(register):
            register("command.say-hello", Command(run=lambda args, plugins: print("hello") or 0, help="greets"))
        """)
    env = {"PLAIT_CACHE_DIR": str(tmp_path / "cache")}
    for spelling in ("say-hello", "say_hello"):
        done = plait_command(spelling, pythonpath=site, env=env)
        assert (done.returncode, done.stdout) == (0, "hello\n"), done.stderr


def test_dashed_flags_name_the_underscored_fields(workdir):
    # --max-steps is --max_steps: its value reaches the field, whose range check names it
    done = plait_main("sft", "--model", str(tiny_model_path()), "--dataset", "sft.jsonl", "--max-steps", "0",
                         "--num-train-epochs", "0", "--check", cwd=workdir)
    assert "max_steps=0" in error_line(done)


# -- 4. a positional recipe, a flag without its value ------------------------------------------------


def test_a_positional_recipe_suggests_config(workdir):
    assert error_line(plait_main("dpo", "recipe.yaml", cwd=workdir)) == (
        "plait: error: unexpected argument 'recipe.yaml'; a recipe is given as --config recipe.yaml")


@pytest.mark.parametrize("after", [["--check"], []])
def test_a_flag_without_its_value_says_the_value_is_missing(workdir, after):
    done = (plait_command if after else plait_main)("dpo", "--config", "recipe.yaml", "--beta", *after, cwd=workdir)
    assert error_line(done) == "plait: error: --beta: the value is missing; write --beta VALUE (float)"


# -- 5. grouped --help, --help-all ----------------------------------------------------------------------

def help_rows(text: str) -> dict[str, str]:
    rows = {}
    for line in text.splitlines():
        parts = line.split(None, 1)
        if line.startswith("  --") and len(parts) == 2:
            rows.setdefault(parts[0], parts[1])
    return rows


@pytest.mark.parametrize("method", ["dpo", "grpo", "sft"])
def test_help_is_short_grouped_and_described(method):
    done = (plait_command if method == "grpo" else plait_main)(method, "--help")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) <= 80
    titles = [line.split(" (")[0] for line in lines if line.endswith(":") and " (" in line and line[0] != " "]
    assert titles == ["model", "data", "method", *(["generation"] if method == "grpo" else []), "training",
                      "launching"]
    rows = help_rows(done.stdout)
    # TrainingArguments' own help, first sentence, and the method's default
    assert rows["--learning_rate"].startswith("The initial learning rate for the optimizer (default: ")
    assert f"plait {method} --help-all" in done.stdout


def test_help_all_lists_every_field_once():
    done = plait_main("dpo", "--help-all")
    assert done.returncode == 0, done.stderr
    from plait.engine.config import config_fields

    config = make_plugins().methods.get("method.dpo").obj.config
    flags = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  --")]
    missing = {f"--{name}" for name in config_fields(config)} - set(flags)
    assert not missing
    listed = [flag for flag in flags if flag not in ("--help", "--help-all", "--config", "--check")]
    assert len(listed) == len(set(listed))  # each in one group
    assert help_rows(done.stdout)["--beta"].endswith("(default: 0.1)") and len(done.stdout.splitlines()) > 150


# -- 6. an unknown loss, within its family -----------------------------------------------------------------


def test_an_unknown_loss_type_lists_its_family_only(workdir):
    line = error_line(plait_main("dpo", "--config", "recipe.yaml", "--loss_type", "sigmoidd", "--check",
                                    cwd=workdir))
    assert line.startswith("plait: error: unknown loss 'sigmoidd' (did you mean 'dpo.sigmoid'?); available: dpo.")
    listed = line.split("available: ")[1].split(" (the dpo losses")[0].split(", ")
    assert listed == sorted(c.name for c in make_plugins().losses.family("dpo"))
    assert "'plait list losses' lists all" in line


# -- 7. a broken third-party plugin ---------------------------------------------------------------------------


@pytest.fixture
def broken_site(tmp_path) -> Path:
    return third_party(tmp_path / "site", "plait_broken", 'raise RuntimeError("this plugin is broken")\n')


def test_every_listing_command_is_answered_without_a_run_s_plugin_load():
    """The listings below, `plait --help` and `plait env` take the warning path (the script runs three of them)."""
    assert all(_only_lists(argv) for argv in (["--help"], ["plugins"], ["list", "losses"], ["env"], []))
    assert not any(_only_lists(argv) for argv in (["dpo", "--help"], ["report", "out"]))


@pytest.mark.parametrize("argv", [["plugins"], ["list", "losses"], []])
def test_a_broken_plugin_is_warned_about_and_the_listing_goes_on(broken_site, tmp_path, argv):
    done = plait_command(*argv, pythonpath=broken_site, env={"PLAIT_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == (2 if not argv else 0), done.stderr  # bare `plait` asks for a command, as before
    warning = [line for line in done.stderr.splitlines() if line.startswith("plait: warning:")]
    assert len(warning) == 1
    assert ("plait plugin 'plait_broken' (entry point 'plait_broken', distribution plait-broken 0.1) failed to load: "
            "RuntimeError: this plugin is broken") in warning[0]
    if argv[:2] == ["list", "losses"]:
        assert "dpo.sigmoid" in done.stdout
    if argv == ["plugins"]:
        assert "method_dpo" in done.stdout and "plait_broken" not in done.stdout


def test_running_a_method_still_refuses_a_broken_plugin(broken_site, tmp_path, workdir):
    done = plait_command("dpo", "--config", "recipe.yaml", "--check", cwd=workdir, pythonpath=broken_site,
                         env={"PLAIT_CACHE_DIR": str(tmp_path / "cache")})
    assert "plugin 'plait_broken'" in error_line(done)


# -- 8. a reward module of the working directory ---------------------------------------------------------------


@pytest.mark.slow  # two one-step GRPO runs in fresh interpreters: ~1 min
@pytest.mark.parametrize("path", ["my_rewards.short", "my_rewards:short"])
def test_a_reward_module_in_the_working_directory_is_found(tmp_path, path):
    shutil.copy(DATA / "demo_preferences.jsonl", tmp_path / "prefs.jsonl")
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        import os
        import sys

        def short(completions, **kwargs):
            with open("called.txt", "a") as record:  # whether the working directory is on the path now
                record.write(f"{os.getcwd() in sys.path}\\n")
            return [-float(len(str(completion))) for completion in completions]
        """))
    done = plait_command("grpo", "--model", str(tiny_model_path()), "--dataset", "prefs.jsonl", "--reward_funcs",
                         path, "--max_steps", "1", "--num_generations", "2", "--per_device_train_batch_size", "2",
                         "--max_completion_length", "4", "--output_dir", "out", "--report_to", "none",
                         "--save_strategy", "no", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # called while training, with the working directory off sys.path again: only the named module came from it
    assert (tmp_path / "called.txt").read_text().split() == ["False"]
    record = json.loads((tmp_path / "out" / METRICS_FILE).read_text().splitlines()[-1])
    assert record["rewards/short/mean"] < 0


# -- 9 and 10. what a run leaves behind -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """``plait sft --config recipes/sft.yaml`` whose dataset is ``../data/demo_sft.jsonl`` (relative to the
    recipe), saving a checkpoint each step."""
    folder = tmp_path_factory.mktemp("run")
    (folder / "recipes").mkdir()
    (folder / "data").mkdir()
    shutil.copy(DATA / "demo_sft.jsonl", folder / "data" / "demo_sft.jsonl")
    (folder / "recipes" / "sft.yaml").write_text(textwrap.dedent(f"""\
        method: sft
        model: {tiny_model_path()}
        dataset: ../data/demo_sft.jsonl
        training:
          output_dir: runs/sft-out
          max_steps: 3
          per_device_train_batch_size: 2
          logging_steps: 1
          save_steps: 1
          report_to: none
        """))
    done = plait_command("sft", "--config", "recipes/sft.yaml", cwd=folder)
    assert done.returncode == 0, done.stderr
    return folder


@pytest.mark.slow
def test_the_model_card_loads_the_folder_and_names_the_data_plainly(sft_run):
    card = (sft_run / "runs" / "sft-out" / "README.md").read_text()
    assert "model = AutoModelForCausalLM.from_pretrained('runs/sft-out')" in card
    assert "on `data/demo_sft.jsonl`" in card and "../" not in card


@pytest.mark.slow
def test_the_overwrite_refusal_names_the_flag(sft_run):
    done = plait_command("sft", "--config", "recipes/sft.yaml", "--max_steps", "4", cwd=sft_run)
    line = error_line(done)
    assert "pass --overwrite_output_dir to train over it, or pick another --output_dir" in line
    assert "--resume_from_checkpoint latest" in line  # the folder holds checkpoints


@pytest.mark.slow
def test_every_run_writes_metrics_and_a_resumed_run_continues_them(sft_run):
    out = sft_run / "runs" / "sft-out"
    records = list(read_metrics(out))
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert all(isinstance(r["epoch"], float) and r["learning_rate"] > 0 for r in records if "loss" in r)
    assert records[-1]["step"] == 3 and "train_loss" in records[-1]
    first_loss = records[0]["loss"]
    done = plait_command("sft", "--config", "recipes/sft.yaml", "--resume_from_checkpoint",
                         str(out / "checkpoint-1"), cwd=sft_run)
    assert done.returncode == 0, done.stderr
    resumed = list(read_metrics(out))
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2, 3]  # steps 2 and 3 again, not twice
    assert resumed[0]["loss"] == first_loss  # step 1's line is the first run's


@pytest.mark.slow
def test_report_summarises_and_draws(sft_run):
    out = sft_run / "runs" / "sft-out"
    losses = [r["loss"] for r in read_metrics(out) if "loss" in r]
    done = plait_command("report", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("steps: 3 ")
    assert lines[1] == (f"loss: first {losses[0]:.4g} (step 1), last {losses[-1]:.4g} (step 3), "
                        f"min {min(losses):.4g} (step {losses.index(min(losses)) + 1})")
    assert lines[2].startswith("learning_rate: last ")
    assert lines[-1] == f"plot: {out / 'report.png'}"
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_report_without_matplotlib_says_how_to_install_it(sft_run, tmp_path):
    hidden = tmp_path / "hide"
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    done = plait_command("report", str(sft_run / "runs" / "sft-out"), pythonpath=hidden)
    assert done.returncode == 0, done.stderr
    assert "matplotlib is not installed; pip install matplotlib" in done.stdout


def test_report_of_a_folder_without_metrics_is_one_line(tmp_path):
    assert error_line(plait_command("report", str(tmp_path))) == (
        f"plait: error: plait report {str(tmp_path)!r}: no {METRICS_FILE} there (every run writes one into its "
        "output_dir); pass the output_dir of a run")


# -- the metrics file itself, in process ---------------------------------------------------------------------------


@dataclasses.dataclass
class State:
    global_step: int
    epoch: float = 0.0
    is_world_process_zero: bool = True


@dataclasses.dataclass
class Args:
    output_dir: str


def test_a_line_cut_by_a_crash_is_skipped_and_the_next_run_resumes_past_it(tmp_path):
    log, args = MetricsLog(), Args(str(tmp_path))
    log.on_train_begin(args, State(0), None)
    for step in (1, 2, 3):
        log.on_log(args, State(step, step / 10), None, logs={"loss": 1.0 / step})
    with open(tmp_path / METRICS_FILE, "a") as handle:
        handle.write('{"step": 4, "loss": 0.2')  # the crash
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    log.on_train_begin(args, State(2), None)  # resumed from checkpoint-2
    log.on_log(args, State(3, 0.3), None, logs={"loss": 0.3})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 0.5), (3, 0.3)]


def test_only_the_main_process_writes_and_values_are_json(tmp_path):
    args = Args(str(tmp_path))
    MetricsLog().on_log(args, State(1, is_world_process_zero=False), None, logs={"loss": 1.0})
    assert not (tmp_path / METRICS_FILE).exists()
    import torch

    MetricsLog().on_log(args, State(1), None, logs={"loss": torch.tensor(0.5), "grad_norm": float("nan")})
    assert list(read_metrics(tmp_path)) == [{"step": 1, "epoch": 0.0, "loss": 0.5, "grad_norm": "nan"}]


def test_a_help_line_is_its_first_sentence_and_e_g_does_not_end_it():
    from plait.recipes.run import _first_sentence

    assert _first_sentence("options for apply_chat_template, e.g. {enable_thinking: false}") == \
        "options for apply_chat_template, e.g. {enable_thinking: false}"
    assert _first_sentence("The initial learning rate. More words.") == "The initial learning rate"
