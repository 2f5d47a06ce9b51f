"""The catalog answers `plait --help`, `plait list` and `plait plugins` without importing plugins,
says exactly what a full load says, and never shows a plugin as it was before an edit."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait.catalog import Catalog, load_catalog
from plait.cli import LIST_KINDS, main
from plait.manager import Plugins

PLAIT = str(Path(sys.executable).parent / "plait")
HEAVY = ("torch", "transformers", "peft", "accelerate", "datasets")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One warmed catalog for the module: the first listing imports every plugin and records it."""
    path = tmp_path_factory.mktemp("plait-cache")
    subprocess.run([PLAIT, "list", "methods"], env={**os.environ, "PLAIT_CACHE_DIR": str(path)}, check=True,
                   capture_output=True)
    return path


def plait(*args, cache_dir, extra_env=None, pythonpath=None):
    env = {**os.environ, "PLAIT_CACHE_DIR": str(cache_dir), **(extra_env or {})}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    done = subprocess.run([PLAIT, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def outputs(argv_list, capsys):
    results = []
    for argv in argv_list:
        assert main(argv) == 0
        results.append(capsys.readouterr().out)
    return results


def test_every_listing_from_the_catalog_is_what_a_full_load_prints(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    assert isinstance(load_catalog(), Plugins)  # nothing recorded yet: a full load, which records
    assert isinstance(load_catalog(), Catalog)
    listings = [["list", kind, "--json"] for kind in sorted(LIST_KINDS)] + [["plugins", "--json"]]
    from_catalog = outputs(listings, capsys)
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "empty"))  # no records: every call loads the plugins
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "catalog.json").write_text("not json")
    from_plugins = outputs(listings, capsys)
    assert from_catalog == from_plugins
    losses = json.loads(from_catalog[sorted(LIST_KINDS).index("losses")])
    assert {"dpo.sigmoid", "grpo.dapo", "sft.nll"} <= {row["name"] for row in losses}
    assert all(row["summary"] for row in losses)


def test_help_is_the_same_from_the_catalog(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    texts = []
    for _ in range(2):  # the first builds the catalog, the second reads it
        with pytest.raises(SystemExit):
            main(["--help"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert "dpo" in texts[0] and "train with the 'grpo' method" in texts[0]


def test_listing_imports_no_framework(cache_dir):
    probe = ("import sys; from plait.cli import main; main(['list', 'losses']); main(['plugins']); "
             f"print([m for m in {HEAVY!r} if m in sys.modules])")
    env = {**os.environ, "PLAIT_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_method_command_still_loads_its_plugin(cache_dir):
    assert "--beta" in plait("dpo", "--help", cache_dir=cache_dir)


def test_an_edited_or_disabled_plugin_is_never_listed_as_it_was(cache_dir, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    info = site / "plait_probe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plait-probe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[plait]\nprobe = plait_probe\n")
    source = site / "plait_probe.py"

    def write(name):
        source.write_text(textwrap.dedent(f'''
            from plait import hookimpl

            def loss(batch, params):
                """A probe loss."""

            @hookimpl
            def register_losses(register):
                register("{name}", loss)
        '''))

    write("probe.first")
    for _ in range(2):  # recorded, then read from the record
        assert "probe.first" in plait("list", "losses", cache_dir=cache_dir, pythonpath=site)
    write("probe.second_version")
    listed = plait("list", "losses", cache_dir=cache_dir, pythonpath=site)
    assert "probe.second_version" in listed and "probe.first" not in listed
    hidden = plait("list", "losses", cache_dir=cache_dir, pythonpath=site, extra_env={"PLAIT_DISABLE_PLUGINS": "probe"})
    assert "probe." not in hidden and "dpo.sigmoid" in hidden


def test_a_listing_piped_into_a_reader_that_left_ends_quietly(cache_dir):
    env = {**os.environ, "PLAIT_CACHE_DIR": str(cache_dir)}
    done = subprocess.run(f"'{PLAIT}' list losses | true", shell=True, env=env, capture_output=True, text=True)
    assert done.stderr == ""  # no BrokenPipeError traceback
