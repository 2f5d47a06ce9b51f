"""The example third-party package, really installed, and docs/writing-plugins.md, really executed.

A session fixture pip-installs examples/plait-example-plugin (a normal, non-editable install from
a copy) into a site folder of each test process's own, put on its ``sys.path`` and on its
subprocesses' ``PYTHONPATH``; the uninstall test removes it from there and reinstalls it. The
shared venv is never touched, so no other test's ``plait`` process sees a half-installed plugin.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from plait import make_plugins
from plait.engine.batches import PreferenceLogps
from plait.engine.objective import Objective, normalise_loss_specs
from plait.errors import PlaitError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plait-example-plugin"
DOC = ROOT / "docs" / "writing-plugins.md"
DIST = "plait-example-plugin"
PACKAGE = "plait_example"
PYPROJECT = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
ENTRY_POINTS = PYPROJECT["project"]["entry-points"]["plait"]
VERSION = PYPROJECT["project"]["version"]
COMPONENTS = {"losses": "dpo.simpo", "rewards": "reward.concise", "advantage_estimators": "advantage.centered_rank"}


def _forget_imports() -> None:
    """Make this process see the environment as it is now (files and metadata changed by pip)."""
    importlib.invalidate_caches()
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def install_example(site: Path) -> None:
    """Install the example as a user would (pip, from a copy, so the build leaves no files in the
    repo), into ``site``: a folder of this test process's own on ``sys.path``, not the shared venv.
    The suite runs in parallel, and every other worker's ``plait`` subprocess loads all installed
    plugins: installing into (or uninstalling from) the venv would let them catch it half-written."""
    copy = site.with_name(site.name + "-source")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    install = ("install", "--no-deps", "--upgrade", "--target", str(site), str(copy))
    # Fast and offline with this environment's setuptools; an isolated build (which fetches its
    # build backend from the package index) where that setuptools cannot build a wheel.
    result = _pip(*install, "--no-build-isolation", "--no-index")
    if result.returncode != 0:
        result = _pip(*install)
    assert result.returncode == 0, result.stdout
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    _forget_imports()
    assert importlib.metadata.distribution(DIST).version == VERSION


def uninstall_example(site: Path) -> None:
    """What ``pip uninstall`` does: the package and its metadata leave the disk."""
    shutil.rmtree(site)
    _forget_imports()


@pytest.fixture(scope="session")
def example_site(tmp_path_factory):
    """Where the example is installed for this test process; ``PYTHONPATH`` for its subprocesses."""
    site = tmp_path_factory.mktemp("example") / "site-packages"
    install_example(site)
    yield site
    sys.path.remove(str(site))
    _forget_imports()


@pytest.fixture
def example_installed(example_site):
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(example_site), os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def plugins(example_installed):
    return make_plugins()


# ---------------------------------------------------------------------------------------------
# The installed package
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(COMPONENTS))
def test_components_are_registered_with_their_distribution_and_version(plugins, kind):
    component = plugins.registries[kind].get(COMPONENTS[kind])
    assert (component.distribution, component.version) == (DIST, VERSION)
    assert component.plugin in ENTRY_POINTS


def test_plugins_report_the_distribution_and_hooks(plugins):
    infos = {info.name: info for info in plugins.distributions()}
    assert {name: (infos[name].distribution, infos[name].version) for name in ENTRY_POINTS} == {
        name: (DIST, VERSION) for name in ENTRY_POINTS}
    assert plugins.hooks_of("example_simpo") == ["register_losses"]
    assert plugins.hooks_of("example_concise") == ["register_rewards"]
    assert plugins.hooks_of("example_centered_rank") == ["register_advantage_estimators"]


def _plait(*args: str, env: dict[str, str]) -> str:
    script = Path(sys.executable).with_name("plait")
    result = subprocess.run([str(script), *args], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _cli(*args: str) -> str:
    """``plait ARGS`` in this process (what the console script calls), returning its stdout."""
    from plait.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


def test_plait_plugins_lists_it_with_its_version(example_installed):
    # Through the installed console script once, in a fresh process, as a user runs it.
    rows = [line.split() for line in _plait("plugins", env=example_installed).splitlines()]
    for name in ENTRY_POINTS:
        assert [name, DIST, VERSION] == next(row[:3] for row in rows if row and row[0] == name)


def test_blocking_by_name_removes_it(example_installed, monkeypatch):
    assert "dpo.simpo" not in make_plugins(disable=["example_simpo"]).losses
    assert "reward.concise" in make_plugins(disable=["example_simpo"]).rewards
    blocked = make_plugins(disable=[DIST])
    assert not any(COMPONENTS[kind] in blocked.registries[kind] for kind in COMPONENTS)
    monkeypatch.setenv("PLAIT_DISABLE_PLUGINS", f"plait_unrelated,{DIST}")
    assert not any(COMPONENTS[kind] in make_plugins().registries[kind] for kind in COMPONENTS)
    assert "example_simpo" not in _cli("plugins")  # the CLI obeys the environment too
    assert "dpo.sigmoid" in make_plugins().losses  # built-ins are untouched


def _build_objective(plugins):
    specs = normalise_loss_specs([{"name": "dpo.simpo", "weight": 1.0, "gamma": 0.5},
                                  {"name": "sigmoid", "weight": 0.5}])
    return Objective.build(specs, plugins.losses, family="dpo", consumes=PreferenceLogps, shared={"beta": 0.1})


def test_its_loss_composes_with_a_builtin_by_name(plugins):
    objective = _build_objective(plugins)
    assert objective.names == ["dpo.simpo", "dpo.sigmoid"]
    assert objective.params_of("dpo.simpo").beta == 0.1  # the method's shared beta fills it
    batch = PreferenceLogps(*(torch.tensor([v]) for v in (-2.0, -6.0, -3.0, -3.0, 2.0, 3.0)))
    total, parts = objective(batch)
    assert parts["dpo.simpo"].item() == pytest.approx(-torch.nn.functional.logsigmoid(torch.tensor(0.1 - 0.5)).item())
    assert total.item() == pytest.approx(parts["dpo.simpo"].item() + 0.5 * parts["dpo.sigmoid"].item())


def test_after_uninstalling_naming_its_loss_is_an_error_naming_it(example_site):
    try:
        uninstall_example(example_site)
        plugins = make_plugins()
        assert "dpo.simpo" not in plugins.losses
        with pytest.raises(PlaitError, match=r"unknown loss 'dpo\.simpo'.*available: .*dpo\.sigmoid"):
            _build_objective(plugins)
    finally:
        install_example(example_site)
    assert "dpo.simpo" in make_plugins().losses


@pytest.mark.slow  # a fresh interpreter importing torch and every plugin: ~10 s
def test_the_example_passes_its_own_test_suite(example_installed):
    # Its tests use plait.testing and the plait_plugins fixture of plait's pytest plugin.
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
                            capture_output=True, text=True, cwd=EXAMPLE, env=example_installed)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b8 passed\b", result.stdout), result.stdout  # 7 + the guess_number environment contract


# ---------------------------------------------------------------------------------------------
# docs/writing-plugins.md: every fenced block is checked or executed
# ---------------------------------------------------------------------------------------------

FENCE = re.compile(r"^```(\w*)[ \t]*([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


README_SECTION = "## Writing a plugin"


def doc_text(doc: Path) -> str:
    """The page, or for the README only its "Writing a plugin" section (the rest is prose)."""
    text = doc.read_text()
    if doc.name == "README.md":
        start = text.index(README_SECTION)
        end = text.find("\n## ", start + len(README_SECTION))
        text = text[: end if end != -1 else len(text)]
        text = "\n" * text.count("\n", 0, start) + text[start:]  # keep line numbers true
    return text


def doc_blocks(doc: Path = DOC) -> list[tuple[int, str, dict[str, str], str]]:
    text = doc_text(doc)
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        attributes = dict(part.split("=", 1) for part in match.group(2).split())
        blocks.append((line, match.group(1), attributes, match.group(3)))
    return blocks


def test_every_block_of_the_doc_is_of_a_kind_the_suite_runs():
    kinds = [(line, lang, bool(attrs.get("file"))) for line, lang, attrs, _ in doc_blocks()]
    assert all(lang in ("python", "toml", "console", "text") for _, lang, _ in kinds), kinds
    assert all(has_file for _, lang, has_file in kinds if lang == "toml"), kinds
    # the headline snippets are all there
    assert sum(lang == "console" for _, lang, _ in kinds) >= 1
    assert any(lang == "python" and has_file for _, lang, has_file in kinds)


def _fixtures(tmp_path) -> dict:
    from plait.testing.tiny_model import tiny_model_path

    return {"plait_plugins": make_plugins, "tiny_model_path": tiny_model_path, "tmp_path": lambda: tmp_path}


def _run_snippet(source: str, name: str, tmp_path) -> str:
    """Execute a Python block as a test module: define it, then call each test_* with fixtures."""
    namespace: dict = {"__name__": name}
    exec(compile(source, name, "exec"), namespace)
    fixtures = _fixtures(tmp_path)
    tests = [v for k, v in namespace.items() if k.startswith("test_") and callable(v)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for test in tests:
            test(**{arg: fixtures[arg]() for arg in inspect.signature(test).parameters})
    return out.getvalue()


def _matches_in_order(expected: list[str], actual: list[str]) -> bool:
    """Each expected line (whitespace-normalised; '...' skipped) appears in ``actual``, in order."""
    norm = lambda s: " ".join(s.split())  # noqa: E731
    remaining = iter(norm(line) for line in actual)
    return all(any(line == seen for seen in remaining) for line in map(norm, expected) if line and line != "...")


def _console(block: str) -> list[tuple[str, list[str]]]:
    sessions: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            sessions.append((line[2:], []))
        else:
            sessions[-1][1].append(line)
    return sessions


@pytest.mark.parametrize("doc", [DOC, ROOT / "README.md"], ids=["writing-plugins.md", "README.md"])
def test_doc_snippets_run(example_installed, tmp_path, doc):
    blocks = doc_blocks(doc)
    assert blocks, f"{doc.name} has no code blocks to run"
    previous_stdout = None
    for line, lang, attributes, body in blocks:
        where = f"{doc.name}:{line}"
        if lang == "python" and "file" in attributes:
            assert body == (ROOT / attributes["file"]).read_text(), f"{where} differs from {attributes['file']}"
            previous_stdout = None
        elif lang == "python":
            previous_stdout = _run_snippet(body, f"doc_snippet_line_{line}", tmp_path)
        elif lang == "text":
            assert previous_stdout is not None, f"{where}: a text block shows the output of the Python block before it"
            assert body.strip() == previous_stdout.strip(), (
                f"{where} is stale; the snippet now prints:\n{previous_stdout}")
            previous_stdout = None
        elif lang == "toml":
            snippet, full = tomllib.loads(body), tomllib.loads((ROOT / attributes["file"]).read_text())
            assert _contains(full, snippet), f"{where} is not part of {attributes['file']}"
        elif lang == "console":
            for command, expected in _console(body):
                argv = shlex.split(command)
                assert argv[0] == "plait", f"{where}: only `plait ...` commands are run, not `{command}`"
                stdout = _cli(*argv[1:])
                assert _matches_in_order(expected, stdout.splitlines()), (
                    f"{where}: the output of `{command}` is stale; it now prints:\n{stdout}")


def _contains(full, part) -> bool:
    if isinstance(part, dict):
        return isinstance(full, dict) and all(k in full and _contains(full[k], v) for k, v in part.items())
    return full == part


def test_the_doc_runner_notices_a_stale_block(example_installed):
    # _matches_in_order is the whole of the console comparison: prove it can fail.
    actual = ["plugin  distribution  version", "a  b  1", "c  d  2"]
    assert _matches_in_order(["plugin distribution version", "...", "c d 2"], actual)
    assert not _matches_in_order(["c d 2", "a b 1"], actual)  # order matters
    assert not _matches_in_order(["a b 9"], actual)
    table = lambda value: {"project": {"entry-points": {"plait": {"x": value}}}}  # noqa: E731
    assert _contains(table("y"), table("y")) and not _contains(table("y"), table("z"))


def test_the_pytest_plugin_is_registered_through_pytest11(pytestconfig, plait_plugins, tiny_model_path):
    assert pytestconfig.pluginmanager.hasplugin("plait")  # the name of the pytest11 entry point
    assert "dpo.sigmoid" in plait_plugins.losses
    assert (tiny_model_path / "config.json").is_file()


@pytest.mark.slow
def test_a_recipe_composes_its_loss_with_a_builtin_and_trains(example_installed, tmp_path):
    import json

    from plait.cli import main
    from plait.testing.tiny_model import tiny_model_path

    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tell me about the {w}.", "chosen": f" The {w} is good.",
                                        "rejected": f" The {w} is bad."}) + "\n"
                            for w in ["apple", "river", "stone", "cloud", "music", "garden", "window", "paper"]))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
method: dpo
model: {tiny_model_path()}
dataset: {{path: json, data_files: {data}}}
loss:
  - {{name: dpo.sigmoid, weight: 1.0}}
  - {{name: simpo, weight: 0.5, beta: 2.0, gamma: 0.5}}
training: {{output_dir: {tmp_path / 'out'}, max_steps: 4, per_device_train_batch_size: 4, logging_steps: 1,
           learning_rate: 1.0e-3, save_strategy: "no", report_to: none, disable_tqdm: true}}
""")
    assert main(["dpo", "--config", str(recipe)]) == 0
    state = json.loads((tmp_path / "out" / "plait_run.json").read_text())
    assert {"distribution": "plait-example-plugin", "name": "example_simpo", "version": "0.1.0"} in state["plugins"]
    assert state["config"]["loss"][1]["name"] == "simpo"
