"""Pre-flight: every input a user owns is refused in one line, before any weights load.

Each bad input is one row of ``BAD``: it runs through ``plait <method> ... --check`` (the same
entry point as the console script, in-process; a few rows also through the installed ``plait``
command in a subprocess) and must exit non-zero with a single line naming the field and the
value, and no traceback. Runs that leave checkpoints behind are real tiny SFT runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from safetensors.torch import load_file

from plait.cli import main
from plait.recipes.run import check_recipe, load_recipe
from plait.testing.tiny_model import tiny_model_path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
PLAIT = Path(sys.executable).parent / "plait"
ROW = {"prompt": "Say hi.", "chosen": " Hi!", "rejected": " No."}


class Inputs:
    """What a case builds its command from: the tiny model, a scratch folder, a finished run."""

    def __init__(self, tmp: Path, run: Path):
        self.tmp, self.run, self.tiny = tmp, run, tiny_model_path()

    def file(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    def model_copy(self, name: str, drop: tuple[str, ...] = (), **replace: str | bytes) -> str:
        """The tiny model's folder, copied, without ``drop`` and with some files rewritten."""
        folder = self.tmp / name
        shutil.copytree(self.tiny, folder, ignore=shutil.ignore_patterns(*drop))
        for file, content in replace.items():
            self.file(f"{name}/{file.replace('__', '.')}", content)
        return str(folder)

    def run_copy(self, name: str = "copy", checkpoints: bool = False) -> str:
        """The finished SFT run's folder, copied (with or without its checkpoint-N folders)."""
        shutil.copytree(self.run, self.tmp / name, ignore=None if checkpoints else shutil.ignore_patterns("checkpoint-*"))
        return str(self.tmp / name)

    def only_checkpoints(self) -> str:
        """A folder holding the run's checkpoint-N folders and nothing else."""
        for checkpoint in self.run.glob("checkpoint-*"):
            shutil.copytree(checkpoint, self.tmp / "checkpoints" / checkpoint.name)
        return str(self.tmp / "checkpoints")

    def half_written(self, output_dir: str, step: int) -> str:
        """A checkpoint folder whose save stopped before transformers wrote trainer_state.json."""
        folder = Path(output_dir) / f"checkpoint-{step}"
        shutil.copytree(self.run / "checkpoint-1", folder)
        (folder / "trainer_state.json").unlink()
        return str(folder)

    def with_half_written(self, step: int) -> str:
        """A scratch output_dir whose only checkpoint is half-written."""
        self.half_written(str(self.tmp), step)
        return str(self.tmp)

    def dpo(self, *extra: str) -> list[str]:
        return ["dpo", "--config", str(RECIPES / "dpo_tiny.yaml"), "--model", str(self.tiny),
                "--output_dir", str(self.tmp / "out"), "--check", *extra]

    def sft(self, *extra: str) -> list[str]:
        return ["sft", "--config", str(RECIPES / "sft_tiny.yaml"), *SFT_RUN, "--model", str(self.tiny), "--check", *extra]

    def recipe(self, text: str) -> list[str]:
        data = self.file("prefs.jsonl", json.dumps(ROW) + "\n")
        path = self.file("recipe.yaml", text.format(model=self.tiny, data=data, out=self.tmp / "out"))
        return ["dpo", "--config", path, "--check"]


# The finished run every output_dir/resume case starts from (see the `run` fixture).
SFT_RUN = ["--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1",
           "--learning_rate", "1e-3", "--per_device_train_batch_size", "4"]


def jsonl(*rows) -> str:
    return "".join(row if isinstance(row, str) else json.dumps(row) + "\n" for row in rows)


# (case id, command, words the one-line error must hold, environment)
Case = tuple[str, Callable[[Inputs], list[str]], tuple[str, ...], dict]
BAD: list[Case] = [
    # -- the model ----------------------------------------------------------------------------
    ("model-missing", lambda c: c.dpo("--model", str(c.tmp / "nope")), ("model=", "nope", "no such folder"), {}),
    ("model-is-a-file", lambda c: c.dpo("--model", c.file("model.bin", b"x")), ("model=", "model.bin", "is a file"), {}),
    ("model-folder-without-model", lambda c: c.dpo("--model", str(c.tmp)), ("model=", "no config.json"), {}),
    ("model-folder-of-checkpoints", lambda c: c.dpo("--model", c.only_checkpoints()),
     ("model=", "no config.json", "did you mean its checkpoint-2?"), {}),
    ("model-config-not-json", lambda c: c.dpo("--model", c.model_copy("m", config__json='{"model_type": "llama",')),
     ("model=", "config.json is not valid JSON", "line 1"), {}),
    ("model-config-unknown-type", lambda c: c.dpo("--model", c.model_copy("m", config__json='{"model_type": "nosuch"}')),
     ("model=", "config.json is not a config transformers can read", "nosuch"), {}),
    ("model-without-weights", lambda c: c.dpo("--model", c.model_copy("m", drop=("*.safetensors",))),
     ("model=", "no weights"), {}),
    ("hub-id-offline-not-cached", lambda c: c.dpo("--model", "nobody/no-such-model"),
     ("model='nobody/no-such-model'", "HF_HUB_OFFLINE=1", "local cache"), {}),
    ("ref-model-missing", lambda c: c.dpo("--ref_model", str(c.tmp / "ref")), ("ref_model=", "no such folder"), {}),
    ("teacher-missing", lambda c: ["distill", "--config", str(RECIPES / "distill_tiny.yaml"), "--model", str(c.tiny),
                                   "--teacher_model_name_or_path", str(c.tmp / "teacher"), "--check"],
     ("training.teacher_model_name_or_path=", "teacher", "no such folder"), {}),
    # -- the tokenizer ------------------------------------------------------------------------
    ("tokenizer-files-missing", lambda c: c.dpo("--model", c.model_copy("m", drop=("tokenizer*",))),
     ("model=", "no tokenizer files"), {}),
    ("tokenizer-json-corrupt", lambda c: c.dpo("--model", c.model_copy("m", tokenizer__json="{not json")),
     ("model=", "tokenizer cannot be loaded"), {}),
    # -- data files ---------------------------------------------------------------------------
    ("data-empty-file", lambda c: c.dpo("--dataset", c.file("d.jsonl", "")), ("dataset.data_files", "d.jsonl", "is empty"), {}),
    ("data-only-blank-lines", lambda c: c.dpo("--dataset", c.file("d.jsonl", "\n\n")),
     ("dataset.split='train'", "selects no rows", "train: 0 rows"), {}),
    ("data-split-past-the-rows", lambda c: c.dpo("--dataset", c.file("d.jsonl", jsonl(ROW, ROW)), "--dataset.split", "train[5:]"),
     ("dataset.split='train[5:]'", "selects no rows", "train: 2 rows"), {}),
    ("data-split-not-a-key", lambda c: c.dpo("--dataset", c.file("d.jsonl", jsonl(ROW)), "--dataset.split", "validation"),
     ("dataset.split='validation'", "does not name a split", "train"), {}),
    ("eval-data-empty", lambda c: c.dpo("--eval_dataset", c.file("e.jsonl", "")), ("eval_dataset.data_files", "e.jsonl", "empty"), {}),
    ("jsonl-corrupt-line", lambda c: c.dpo("--dataset", c.file("d.jsonl", jsonl(ROW, ROW, '{"prompt": "a", oops}\n'))),
     ("dataset.data_files", "d.jsonl, line 3", "not valid JSON"), {}),
    ("jsonl-line-not-an-object", lambda c: c.dpo("--dataset", c.file("d.jsonl", jsonl(ROW, "[1, 2]\n"))),
     ("d.jsonl, line 2", "a JSON array, not an object"), {}),
    ("json-array-item-not-an-object", lambda c: c.dpo("--dataset", c.file("d.json", json.dumps([ROW, 3]))),
     ("d.json, item 1", "a JSON number, not an object"), {}),
    ("data-not-utf8", lambda c: c.dpo("--dataset", c.file("d.jsonl", jsonl(ROW).encode() + b'{"prompt": "caf\xe9"}\n')),
     ("dataset.data_files", "d.jsonl, line 2", f"byte {len(jsonl(ROW)) + 15}", "not UTF-8"), {}),
    # -- the recipe's YAML --------------------------------------------------------------------
    ("yaml-duplicate-top-level-key", lambda c: c.recipe("method: dpo\nmodel: {model}\nmodel: {model}\ndataset: {data}\n"),
     ("recipe.yaml: line 3", "key 'model' is also on line 2"), {}),
    ("yaml-duplicate-training-key", lambda c: c.recipe(
        "method: dpo\nmodel: {model}\ndataset: {data}\ntraining:\n  beta: 0.1\n  output_dir: {out}\n  beta: 0.5\n"),
     ("recipe.yaml: line 7", "key 'beta' is also on line 5"), {}),
    # -- training numbers ---------------------------------------------------------------------
    ("batch-size-0", lambda c: c.dpo("--per_device_train_batch_size", "0"), ("per_device_train_batch_size=0", ">= 1"), {}),
    ("eval-batch-size-0", lambda c: c.dpo("--per_device_eval_batch_size", "0"), ("per_device_eval_batch_size=0",), {}),
    ("learning-rate-0", lambda c: c.dpo("--learning_rate", "0"), ("learning_rate=0", "> 0"), {}),
    ("learning-rate-negative", lambda c: c.dpo("--learning_rate", "-1e-5"), ("learning_rate=-1e-05", "> 0"), {}),
    ("learning-rate-nan", lambda c: c.dpo("--learning_rate", ".nan"), ("learning_rate=nan", "finite"), {}),
    ("gradient-accumulation-0", lambda c: c.dpo("--gradient_accumulation_steps", "0"), ("gradient_accumulation_steps=0",), {}),
    ("epochs-negative", lambda c: c.dpo("--num_train_epochs", "-1"), ("num_train_epochs=-1", ">= 0"), {}),
    ("epochs-0-without-max-steps", lambda c: c.dpo("--num_train_epochs", "0", "--max_steps", "-1"),
     ("num_train_epochs=0", "max_steps"), {}),
    ("max-steps-0", lambda c: c.dpo("--max_steps", "0"), ("max_steps=0", "-1 to train num_train_epochs"), {}),
    ("weight-decay-negative", lambda c: c.dpo("--weight_decay", "-0.1"), ("weight_decay=-0.1",), {}),
    ("max-grad-norm-negative", lambda c: c.dpo("--max_grad_norm", "-1.0"), ("max_grad_norm=-1.0",), {}),
    # -- output_dir and resuming --------------------------------------------------------------
    ("output-dir-is-a-file", lambda c: c.dpo("--output_dir", c.file("out.txt", "x")), ("output_dir=", "out.txt", "is a file"), {}),
    ("output-dir-holds-a-foreign-model", lambda c: c.dpo("--output_dir", c.model_copy("base")),
     ("output_dir=", "base", "a model that no plait run wrote", "overwrite_output_dir"), {}),
    ("output-dir-holds-another-method", lambda c: c.dpo("--output_dir", c.run_copy()),
     ("output_dir=", "the model of a sft run", "overwrite_output_dir"), {}),
    ("output-dir-holds-another-config", lambda c: c.sft("--output_dir", c.run_copy(), "--learning_rate", "5e-4"),
     ("output_dir=", "another sft run", "learning_rate=0.001 there, 0.0005 here"), {}),
    ("output-dir-holds-checkpoints", lambda c: c.sft("--output_dir", str(c.run)),
     ("output_dir=", "holds checkpoints", "checkpoint-2", "resume_from_checkpoint", "latest"), {}),
    ("resume-latest-without-checkpoints", lambda c: c.sft("--output_dir", str(c.tmp), "--resume_from_checkpoint", "latest"),
     ("resume_from_checkpoint='latest'", "no complete checkpoint (none)"), {}),
    ("resume-true-only-half-written", lambda c: c.sft("--output_dir", c.with_half_written(3), "--resume_from_checkpoint", "true"),
     ("resume_from_checkpoint=True", "only incomplete ones: checkpoint-3"), {}),
    ("resume-half-written-path", lambda c: c.sft("--output_dir", str(c.tmp), "--resume_from_checkpoint", c.half_written(str(c.tmp), 3)),
     ("resume_from_checkpoint=", "checkpoint-3", "is not a complete checkpoint"), {}),
    ("resume-path-missing", lambda c: c.sft("--output_dir", str(c.tmp), "--resume_from_checkpoint", str(c.tmp / "checkpoint-7")),
     ("resume_from_checkpoint=", "checkpoint-7", "no such folder"), {}),
    ("resume-another-methods-checkpoint", lambda c: c.dpo("--resume_from_checkpoint", str(c.run / "checkpoint-2")),
     ("resume_from_checkpoint=", "checkpoint of a sft run", "plait sft"), {}),
    # -- plugins ------------------------------------------------------------------------------
    ("loss-of-a-plugin-disabled-by-the-recipe", lambda c: c.recipe(
        "method: dpo\nmodel: {model}\ndataset: {data}\nloss: [dpo.hinge]\nplugins: {{disable: [dpo_hinge]}}\n"
        "training: {{output_dir: {out}}}\n"),
     ("loss 'dpo.hinge' comes from plugin 'dpo_hinge'", "disabled by the recipe's plugins.disable"), {}),
    ("loss-of-a-plugin-disabled-by-env", lambda c: c.dpo("--loss", "dpo.ipo"),
     ("loss 'dpo.ipo' comes from plugin 'dpo_ipo'", "PLAIT_DISABLE_PLUGINS=dpo_ipo"), {"PLAIT_DISABLE_PLUGINS": "dpo_ipo"}),
    ("method-of-a-plugin-disabled-by-env", lambda c: c.dpo(),
     ("method 'method.dpo' comes from plugin 'method_dpo'", "PLAIT_DISABLE_PLUGINS=method_dpo"),
     {"PLAIT_DISABLE_PLUGINS": "method_dpo"}),
]
# These also run through the installed console script, in subprocesses started together.
THROUGH_THE_CONSOLE_SCRIPT = ("model-missing", "jsonl-corrupt-line", "method-of-a-plugin-disabled-by-env")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real 2-step SFT run of the tiny model with checkpoint-1, checkpoint-2 and the final model."""
    out = tmp_path_factory.mktemp("sft") / "run"
    assert main(["sft", "--config", str(RECIPES / "sft_tiny.yaml"), "--model", str(tiny_model_path()),
                 "--output_dir", str(out), *SFT_RUN]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    return out


@pytest.fixture
def inputs(tmp_path, run) -> Inputs:
    return Inputs(tmp_path, run)


@pytest.mark.parametrize("case", BAD, ids=[case[0] for case in BAD])
def test_bad_input_is_one_line_before_any_weights_load(case, inputs, capsys, monkeypatch):
    name, command, words, env = case
    argv = command(inputs)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(argv) != 0
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    line = error_line(captured.err)
    for word in words:
        assert word in line, (word, line)


def error_line(err: str) -> str:
    """The one error line of a refused --check, after the lines of what passed ("plait: checked ...")."""
    *passed, last = err.splitlines()
    assert last.startswith("plait: error: ") and all(line.startswith("plait: checked ") for line in passed), err
    return last


def test_bad_inputs_through_the_console_script(inputs):
    """The installed `plait` command: exit status 2, one line, no traceback (the processes run together)."""
    cases = {case[0]: case for case in BAD}
    started = {}
    for name in THROUGH_THE_CONSOLE_SCRIPT:
        _, command, words, env = cases[name]
        started[name] = (subprocess.Popen([str(PLAIT), *command(inputs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env={**os.environ, **env}, cwd=inputs.tmp), words)
    for name, (process, words) in started.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 2 and out == "" and "Traceback" not in err, (name, err[-2000:])
        line = error_line(err)
        assert all(word in line for word in words), (name, line)


# -- what must still pass --------------------------------------------------------------------------


def test_check_never_reads_the_weights(inputs, capsys):
    """A model folder whose weight file is garbage passes --check: only config and tokenizer are read."""
    folder = inputs.model_copy("m", model__safetensors=b"not a safetensors file")
    assert main(inputs.dpo("--model", folder)) == 0
    assert "is a valid dpo recipe" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--overwrite_output_dir"], ["--resume_from_checkpoint", "latest"]],
                         ids=["overwrite_output_dir", "resume"])
def test_an_earlier_runs_folder_is_accepted_when_asked(inputs, extra):
    assert main(inputs.sft("--output_dir", inputs.run_copy(checkpoints=True), *extra)) == 0


def test_the_same_run_may_be_rerun_into_its_own_folder(inputs):
    """Same method, same config (the folder may have moved): the final model is simply rewritten."""
    assert main(inputs.sft("--output_dir", inputs.run_copy())) == 0


def test_resume_latest_takes_the_newest_complete_checkpoint_and_trains_on(inputs, capsys):
    out = Path(inputs.run_copy(checkpoints=True))
    inputs.half_written(str(out), 9)  # killed mid-save, outside plait's staging
    shutil.copytree(out / "checkpoint-2", out / ".staging" / "checkpoint-10")  # a staged save, never renamed
    argv = ["sft", "--config", str(RECIPES / "sft_tiny.yaml"), "--model", str(inputs.tiny), "--output_dir", str(out),
            *SFT_RUN, "--max_steps", "3", "--resume_from_checkpoint", "latest"]
    config = load_recipe(RECIPES / "sft_tiny.yaml", {"model": str(inputs.tiny), "output_dir": str(out),
                                                     "resume_from_checkpoint": True}, method="sft")
    assert check_recipe(config).resume_from_checkpoint == str(out / "checkpoint-2")
    assert main(argv) == 0
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]
    assert load_file(out / "model.safetensors").keys() == load_file(inputs.tiny / "model.safetensors").keys()
