"""``plait <method> ... --check`` means the run will start (issue 32).

Each case below used to pass ``--check`` (or, for a missing local path without HF_HUB_OFFLINE, spend
~75 s in hub retries and then blame the tokenizer) and fail only in the real run. They now fail at
``--check`` through the installed ``plait`` command, in one line naming the input and the fix, and a
good command still passes, saying what it checked. The dataset's first rows go through the method's
own ``prepare`` up to the format decision (:func:`plait.data.prepare.deciding_format`), so the check
and the run refuse wrong columns with the same line.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from plait.cli import main
from plait.data.prepare import FormatDecided, deciding_format, prepare_dataset
from plait.errors import PlaitError
from plait.testing.tiny_model import tiny_model_path

PLAIT = Path(sys.executable).parent / "plait"
PAIRS = [{"prompt": "Say hi.", "chosen": " Hi!", "rejected": " No."},
         {"prompt": "Say yo.", "chosen": " Yo!", "rejected": " No."}]
GOOD_BAD = [{"prompt": row["prompt"], "good": row["chosen"], "bad": row["rejected"]} for row in PAIRS]


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory as a user's: the tiny model in runs/tiny-model, a preference file, a
    file of the wrong columns (good/bad), and a data/ folder."""
    here = tmp_path_factory.mktemp("check")
    shutil.copytree(tiny_model_path(), here / "runs" / "tiny-model")
    (here / "prefs.jsonl").write_text(jsonl(PAIRS))
    (here / "goodbad.jsonl").write_text(jsonl(GOOD_BAD))
    (here / "data").mkdir()
    return here


class HubRecorder(http.server.BaseHTTPRequestHandler):
    """A stand-in hub (HF_ENDPOINT) that answers 404 and remembers every request made to it: a path
    judged as a path makes none (before, each of these commands asked the hub for it, and the real
    hub's retries took ~75 s without a network)."""

    requests: list[str] = []

    def do_HEAD(self):  # http.server names the handlers
        HubRecorder.requests.append(f"HEAD {self.path}")
        self.send_response(404)
        self.end_headers()

    def do_GET(self):
        self.do_HEAD()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def hub() -> str:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubRecorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


# (case, argv after `plait`, environment changes (None: unset), words of the one error line)
TINY = ["--model_name_or_path", "runs/tiny-model"]
OFFLINE = {"HF_HUB_OFFLINE": "1"}
ONLINE_HUB = {"HF_HUB_OFFLINE": None}
REFUSED = {
    "offline-hub-dataset": (
        ["sft", *TINY, "--dataset_name", "trl-lib/Capybara", "--check"], OFFLINE,
        ("dataset='trl-lib/Capybara'", "not in the local datasets cache", "HF_HUB_OFFLINE",
         "hf download trl-lib/Capybara --repo-type dataset")),
    # the same preflight runs before a real run: one line, not OfflineModeIsEnabled's traceback
    "offline-hub-dataset-run": (
        ["sft", *TINY, "--dataset_name", "trl-lib/Capybara", "--max_steps", "1"], OFFLINE,
        ("dataset='trl-lib/Capybara'", "not in the local datasets cache")),
    "wrong-columns": (
        ["dpo", *TINY, "--dataset_name", "goodbad.jsonl", "--check"], OFFLINE,
        ("dataset='goodbad.jsonl'", "columns ['bad', 'good', 'prompt']", "missing column(s) ['chosen', 'rejected']",
         "{prompt, chosen, rejected} (format.preference)")),
    # what the run says about the same file, from the same decision
    "wrong-columns-run": (
        ["dpo", *TINY, "--dataset_name", "goodbad.jsonl", "--max_steps", "1"], OFFLINE,
        ("dataset='goodbad.jsonl'", "missing column(s) ['chosen', 'rejected']")),
    "fsdp1-on-cpu": (
        ["dpo", *TINY, "--dataset_name", "prefs.jsonl", "--accelerate_config", "fsdp1", "--num_processes", "2",
         "--check"], {**OFFLINE, "CUDA_VISIBLE_DEVICES": ""},
        ("--accelerate_config fsdp1", "FSDP1 needs GPUs", "fsdp2")),
    "missing-local-model-online": (
        ["sft", "--model_name_or_path", "runs/no-such-model", "--dataset_name", "prefs.jsonl", "--check"], ONLINE_HUB,
        ("model='runs/no-such-model'", "no such folder", "a local path, not a hub id")),
    "missing-local-dataset-online": (
        ["sft", *TINY, "--dataset_name", "./data/missing", "--check"], ONLINE_HUB,
        ("dataset='./data/missing'", "no such file or folder", "a local path")),
}
# Where the hub is not offline, a local-looking path must not cost a hub call (before: ~75 s of retries).
ONLINE = ("missing-local-model-online", "missing-local-dataset-online")


def plait(workdir: Path, argv: list[str], env: dict, hub: str) -> subprocess.Popen:
    environ = {**os.environ, "HF_ENDPOINT": hub}
    environ.update({key: value for key, value in env.items() if value is not None})
    for key in [key for key, value in env.items() if value is None]:
        environ.pop(key, None)
    return subprocess.Popen([str(PLAIT), *argv, "--output_dir", "out", "--report_to", "none"], cwd=workdir, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def error_line(err: str) -> str:
    """The refusal: the last line of stderr, after one "plait: checked" line per check that passed."""
    *passed, last = err.splitlines()
    assert last.startswith("plait: error: ") and all(line.startswith("plait: checked ") for line in passed), err
    return last


def refused(name: str, process: subprocess.Popen) -> None:
    out, err = process.communicate(timeout=600)
    assert (process.returncode, out) == (2, ""), (name, out, err[-3000:])
    assert "Traceback" not in err, (name, err[-3000:])
    line = error_line(err)
    assert all(word in line for word in REFUSED[name][2]), (name, line)


@pytest.mark.slow
def test_what_the_run_refuses_check_refuses_in_one_line(workdir, hub):
    """Through the installed `plait` command: rc 2, nothing on stdout, no traceback, one error line.
    The cases with the hub online run one at a time: they make no hub request and each finishes well
    inside the ~75 s of retries it used to spend; the others run together."""
    HubRecorder.requests.clear()
    for name in ONLINE:
        argv, env, _ = REFUSED[name]
        start = time.monotonic()
        refused(name, plait(workdir, argv, env, hub))
        assert time.monotonic() - start < 60, name
    assert HubRecorder.requests == []
    started = {name: plait(workdir, argv, env, hub) for name, (argv, env, _) in REFUSED.items() if name not in ONLINE}
    for name, process in started.items():
        refused(name, process)
    assert not (workdir / "out").exists()  # nothing ran


@pytest.mark.slow
def test_a_good_command_checks_each_input_and_is_valid(workdir, hub):
    process = plait(workdir, ["dpo", *TINY, "--dataset_name", "prefs.jsonl", "--eval_dataset", "prefs.jsonl",
                              "--accelerate_config", "cpu_ddp", "--num_processes", "2", "--check"], OFFLINE, hub)
    out, err = process.communicate(timeout=600)
    assert (process.returncode, out) == (0, "plait: the command line is a valid dpo recipe\n"), err
    assert err.splitlines() == [
        "plait: checked dpo recipe: component names, field types and ranges, DPOConfig",
        "plait: checked model runs/tiny-model: local folder",
        "plait: checked tokenizer: TokenizersBackend",
        "plait: checked dataset prefs.jsonl: data files, columns prompt, chosen, rejected",
        "plait: checked eval_dataset prefs.jsonl: data files, columns prompt, chosen, rejected",
        "plait: checked dataset rows for dpo: format.preference for task 'preference'",
        "plait: checked eval_dataset rows for dpo: format.preference for task 'preference'",
        "plait: checked output_dir out: free for this run",
        "plait: checked launch: 2 CPU processes (torch.distributed.run, gloo), preset cpu_ddp",
    ]


# -- the same checks in-process (the console script's entry point), for the cases around them ----


def check(workdir: Path, monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    monkeypatch.chdir(workdir)
    status = main([*argv, "--output_dir", "out", "--check"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("argv, words", [
    (["sft", "--model_name_or_path", "nobody/no-such-model", "--dataset_name", "prefs.jsonl"],
     ("model='nobody/no-such-model'", "HF_HUB_OFFLINE", "hf download nobody/no-such-model")),
    # data/ is a folder here, so data/prefs is read as a path, not as the hub id of an account named "data"
    (["dpo", *TINY, "--dataset_name", "data/prefs"], ("dataset='data/prefs'", "no such file or folder",
                                                      "./data is a folder here")),
    (["kto", *TINY, "--dataset_name", "goodbad.jsonl"],
     ("task 'unpaired'", "{prompt, completion, label} (format.unpaired_preference)")),
    # columns no format knows: only the shapes of formats the method's task takes are offered
    (["dpo", *TINY, "--dataset", "odd.jsonl"], ("dataset='odd.jsonl'", "cannot recognise", "columns ['a', 'b']",
                                                "(format.preference)")),
    (["dpo", *TINY, "--dataset", "prefs.jsonl", "--eval_dataset", "goodbad.jsonl"],
     ("eval_dataset='goodbad.jsonl'", "missing column(s) ['chosen', 'rejected']")),
    (["dpo", *TINY, "--dataset", "prefs.jsonl", "--dataset.split", "test"],
     ("dataset.split='test'", "does not name a split")),
    (["dpo", *TINY, "--dataset", "prefs.jsonl", "--accelerate_config", "multi_gpu"],
     ("--accelerate_config multi_gpu", "needs GPUs")),
    (["dpo", *TINY, "--dataset", "prefs.jsonl", "--accelerate_config", "single_gpu", "--num_processes", "2"],
     ("--num_processes 2", "runs one process")),
], ids=["offline-hub-model", "first-segment-is-a-folder", "kto-good-bad", "unknown-columns", "eval-columns",
        "split-missing", "multi-gpu-on-cpu", "single-gpu-two"])
def test_check_refuses(argv, words, workdir, monkeypatch, capsys):
    (workdir / "odd.jsonl").write_text(jsonl([{"a": "x", "b": "y"}]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    status, out, err = check(workdir, monkeypatch, capsys, *argv)
    line = error_line(err)
    assert (status, out) == (2, "") and all(word in line for word in words), line
    if "cannot recognise" in line:
        assert "format.language_modeling" not in line and "format.sharegpt" not in line, line


def test_a_mixture_is_checked_as_the_run_concatenates_it(workdir, monkeypatch, capsys):
    """datasets fills the columns one part lacks with None; the run's prepare then refuses the first such row."""
    recipe = workdir / "mixture.yaml"
    recipe.write_text(f"model_name_or_path: {workdir / 'runs' / 'tiny-model'}\ndatasets:\n"
                      f"  - {{path: {workdir / 'prefs.jsonl'}}}\n  - {{path: {workdir / 'goodbad.jsonl'}}}\n")
    status, out, err = check(workdir, monkeypatch, capsys, "dpo", "--config", str(recipe))
    line = error_line(err)
    assert (status, out) == (2, "") and "prefs.jsonl, " in line, line
    assert "dataset row 2 (format.preference): column 'chosen' is None" in line, line


def test_the_format_decision_stops_before_tokenising():
    """Under deciding_format, prepare_dataset decides as in a run and stops before any row is tokenised
    (no tokenizer is touched: None stands in for it)."""
    with deciding_format(), pytest.raises(FormatDecided) as decided:
        prepare_dataset(PAIRS, None, "unpaired")
    assert (decided.value.format_name, decided.value.task) == ("format.preference", "unpaired")
    with deciding_format(), pytest.raises(PlaitError, match=r"missing column\(s\) \['chosen', 'rejected'\]"):
        prepare_dataset(GOOD_BAD, None, "preference")
