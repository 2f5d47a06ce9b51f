"""The ``plait`` command: introspection, plugin-contributed subcommands, and error reporting."""

import importlib.metadata
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import attrs
import pytest

import plait
import plait.losses.dpo_sigmoid
from plait.cli import Command, main
from plait.errors import PlaitError
from plait.testing.tiny_model import tiny_model_path

PLAIT = Path(sys.executable).parent / "plait"  # the console script installed beside this python
SIGMOID_SUMMARY = plait.losses.dpo_sigmoid.__doc__.strip().splitlines()[0]


def plugin(name: str, **hooks) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(module, hook_name, plait.hookimpl(fn))
    return module


def commands_plugin(name="greeter", **commands: Command) -> types.ModuleType:
    def register_commands(register):
        for command_name, command in commands.items():
            register(f"command.{command_name}", command)

    return plugin(name, register_commands=register_commands)


def rows(text: str, columns: int) -> dict[str, list[str]]:
    """A table printed by the CLI, as {first cell: cells}; the last column may contain spaces."""
    lines = text.strip().splitlines()
    assert set(lines[1]) <= {"-", " "}, "second line should underline the header"
    return {cells[0]: cells for cells in (line.split(None, columns - 1) for line in lines[2:])}


def test_plugins_table_lists_dpo_sigmoid_with_its_distribution_and_hooks(capsys):
    assert main(["plugins"], plugins=plait.make_plugins()) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["plugin", "distribution", "version", "hooks"]
    assert rows(out, 4)["dpo_sigmoid"] == ["dpo_sigmoid", "plait", plait.__version__, "register_losses"]


def test_plugins_json(capsys):
    assert main(["plugins", "--json"], plugins=plait.make_plugins()) == 0
    entries = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert entries["dpo_sigmoid"] == {"name": "dpo_sigmoid", "distribution": "plait",
                                      "version": plait.__version__, "hooks": ["register_losses"]}


def test_list_losses_shows_name_plugin_and_one_line_summary(capsys):
    assert main(["list", "losses"], plugins=plait.make_plugins()) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["name", "plugin", "summary"]
    name, plugin_cell = "dpo.sigmoid", f"dpo_sigmoid (plait {plait.__version__})"
    row = rows(out, 2)[name][1]
    assert row.startswith(plugin_cell) and row[len(plugin_cell):].strip() == SIGMOID_SUMMARY


def test_list_json_and_an_empty_kind(capsys):
    rewards = plugin("lengthy", register_rewards=lambda register: register("reward.length", len, doc="Longer is better."))
    plugins = plait.make_plugins(autoload=False, plugins=[rewards])
    assert main(["list", "rewards", "--json"], plugins=plugins) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["name"] == "reward.length" and entry["summary"] == "Longer is better."
    assert entry["plugin"].startswith("lengthy ")
    assert main(["list", "backends"], plugins=plugins) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2  # header and rule only


def test_list_rejects_an_unknown_kind(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["list", "lossess"], plugins=plait.make_plugins(autoload=False))
    assert exit_.value.code == 2 and "invalid choice: 'lossess'" in capsys.readouterr().err


def test_env_prints_versions(capsys):
    assert main(["env"], plugins=plait.make_plugins(autoload=False)) == 0
    info = dict(line.strip().split(": ", 1) for line in capsys.readouterr().out.splitlines())
    for dist in ("plait", "torch", "transformers", "accelerate", "peft", "datasets", "pluggy"):
        assert info[dist] == importlib.metadata.version(dist)
    assert {"python", "vllm", "cuda", "cpu_threads"} <= set(info)


def test_plugin_command_becomes_a_subcommand(capsys):
    seen = []

    def hello(args, plugins):
        seen.append(plugins)
        print(f"hello {args.who}")
        return 0

    greet = Command(hello, lambda parser: parser.add_argument("--who", default="world"), help="say hello")
    plugins = plait.make_plugins(autoload=False, plugins=[commands_plugin(hello=greet)])
    assert main(["hello", "--who", "plait"], plugins=plugins) == 0
    assert capsys.readouterr().out == "hello plait\n" and seen == [plugins]

    with pytest.raises(SystemExit) as exit_:
        main(["--help"], plugins=plugins)
    assert exit_.value.code == 0
    assert "say hello" in capsys.readouterr().out


def test_unknown_flags_reach_only_commands_that_accept_them(capsys):
    def echo(args, plugins):
        print(args.extra)
        return 0

    plugins = plait.make_plugins(autoload=False, plugins=[commands_plugin(
        loose=Command(echo, accepts_extra=True), strict=Command(echo))])
    assert main(["loose", "--beta", "0.2"], plugins=plugins) == 0
    assert capsys.readouterr().out == "['--beta', '0.2']\n"
    with pytest.raises(SystemExit) as exit_:
        main(["strict", "--beta", "0.2"], plugins=plugins)
    assert exit_.value.code == 2 and "unrecognized arguments: --beta 0.2" in capsys.readouterr().err


def test_plait_error_becomes_one_line_on_stderr_with_exit_code_2(capsys):
    def fail(args, plugins):
        raise PlaitError("training.beta: -1 must be a number > 0; set beta: 0.1")

    plugins = plait.make_plugins(autoload=False, plugins=[commands_plugin(fail=Command(fail))])
    assert main(["fail"], plugins=plugins) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "plait: error: training.beta: -1 must be a number > 0; set beta: 0.1\n"


def test_a_plugin_command_cannot_replace_a_built_in(capsys):
    plugins = plait.make_plugins(autoload=False, plugins=[commands_plugin("clash", list=Command(lambda a, p: 0))])
    assert main(["list", "losses"], plugins=plugins) == 2
    assert "plait: error: command 'command.list' from plugin clash would replace 'plait list'" in capsys.readouterr().err


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([], plugins=plait.make_plugins(autoload=False))
    assert exit_.value.code == 2 and "usage: plait" in capsys.readouterr().err


# -- the installed console script ------------------------------------------------------------------


def run_plait(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PLAIT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_console_script_plugins():
    result = run_plait("plugins")
    assert result.returncode == 0, result.stderr
    assert rows(result.stdout, 4)["dpo_sigmoid"] == ["dpo_sigmoid", "plait", plait.__version__, "register_losses"]


def test_console_script_reports_a_bad_switch_as_a_plait_error():
    result = run_plait("plugins", PLAIT_ON_PLUGIN_ERROR="maybe")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "plait: error: plugins.on_import_error='maybe' is not valid; use 'fail' or 'skip'\n"


def test_list_methods_shows_each_methods_own_summary():
    result = run_plait("list", "methods", "--json")
    assert result.returncode == 0, result.stderr
    listed = {entry["name"]: entry["summary"] for entry in json.loads(result.stdout)}
    assert listed == {c.name: c.obj.summary for c in plait.make_plugins().methods}
    assert len(set(listed.values())) == len(listed) and "" not in listed.values()  # one line each, none shared


def test_list_commands_shows_each_commands_help(capsys):
    greeter = commands_plugin(hello=Command(lambda args, plugins: 0, help="say hello"))
    assert main(["list", "commands", "--json"], plugins=plait.make_plugins(autoload=False, plugins=[greeter])) == 0
    assert [entry["summary"] for entry in json.loads(capsys.readouterr().out)] == ["say hello"]


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_console_script_checks_an_online_recipe(method, tmp_path):
    # --check builds the trainer without __init__; the online trainers' validate() used to read an
    # attribute only __init__ sets (AttributeError: ... '_reward_specs')
    data = Path(__file__).resolve().parents[1] / "examples" / "data" / "demo_preferences.jsonl"
    recipe = tmp_path / f"{method}.yaml"
    recipe.write_text(f"method: {method}\nmodel: {tiny_model_path()}\ndataset: {data}\n"
                      "reward_funcs: [{name: soft_overlong, max_len: 16, cache: 8}]\n"
                      "training: {num_generations: 4, per_device_train_batch_size: 4}\n")
    result = run_plait(method, "--config", str(recipe), "--check")
    # on stderr only the checks --check reports, one line each; no warning, no traceback
    others = [line for line in result.stderr.splitlines() if not line.startswith("plait: checked ")]
    assert (result.returncode, others) == (0, [])
    assert result.stdout == f"plait: {recipe} is a valid {method} recipe\n"


def test_a_method_whose_validate_needs_init_is_named_in_one_line(capsys, tmp_path):
    from plait.engine.config import method_config
    from plait.engine.trainer import PlaitTrainer

    @attrs.define
    class Params:
        pass

    class NeedyTrainer(PlaitTrainer):
        method = "needy"
        config_class = method_config("NeedyConfig", Params)

        def validate(self, args):
            return self.set_by_init

    methods = plugin("needy", register_methods=lambda register: register(
        "method.needy", plait.Method(config=NeedyTrainer.config_class, trainer=NeedyTrainer)))
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hi"}\n')
    argv = ["needy", "--model", "m", "--dataset", str(data), "--output_dir", str(tmp_path / "out"), "--check"]
    assert main(argv, plugins=plait.make_plugins(autoload=False, plugins=[methods])) == 2
    error = capsys.readouterr().err
    assert error.startswith("plait: error: method 'needy' from plugin needy (") and error.count("\n") == 1
    assert error.endswith("NeedyTrainer.validate() reads self.set_by_init, which only __init__ sets; validate() must "
                          "work before __init__ runs (plait --check); report this to its authors\n")


@pytest.mark.slow  # two processes: ~50 s on 2 busy cores
def test_relaunched_processes_never_import_from_the_working_directory(tmp_path, monkeypatch, capfd):
    from plait.recipes.launch import launch

    # `python -m` puts the working directory first on sys.path: this pluggy.py used to run in every process
    (tmp_path / "pluggy.py").write_text("import pathlib, os\n"
                                        "pathlib.Path(__file__).with_name(f'imported-{os.getpid()}').touch()\n"
                                        "raise SystemExit('the pluggy.py in the working directory ran')\n")
    monkeypatch.chdir(tmp_path)
    assert launch(["plugins", "--json"], num_processes=2, accelerate_config="cpu_ddp") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pluggy.py"]
    out = capfd.readouterr().out
    assert out.count('"name": "dpo_sigmoid"') == 2  # each process loaded the real plugins


def test_check_reads_a_reward_model_folder_without_loading_its_weights(tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from plait.online.scoring import resolve_reward_funcs

    good, broken = tmp_path / "rm", tmp_path / "rm-broken"
    for folder in (good, broken):
        AutoModelForSequenceClassification.from_pretrained(tiny_model_path(), num_labels=1).save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(folder)
    (broken / "model.safetensors").write_bytes(b"not weights")  # --check must never read it
    data = Path(__file__).resolve().parents[1] / "examples" / "data" / "demo_preferences.jsonl"
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(f"method: grpo\nmodel: {tiny_model_path()}\ndataset: {data}\nreward_funcs: [{broken}]\n"
                      "training: {num_generations: 4, per_device_train_batch_size: 4}\n")
    assert main(["grpo", "--config", str(recipe), "--check"]) == 0
    assert "is a valid grpo recipe" in capsys.readouterr().out
    # the weights load when the reward first scores: the same numbers as the model loaded by hand
    reward, = resolve_reward_funcs([str(good)])
    scored = reward(prompts=["Hello", "Hi"], completions=[" there", " you"])
    model = AutoModelForSequenceClassification.from_pretrained(good)
    tokenizer = AutoTokenizer.from_pretrained(good)
    by_hand, = resolve_reward_funcs([model], processing_class=tokenizer)
    assert scored == by_hand(prompts=["Hello", "Hi"], completions=[" there", " you"])
