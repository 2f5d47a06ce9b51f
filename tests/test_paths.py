"""Files outside output_dir: one cache variable, a bounded reference log-prob cache, the user's umask."""

import collections
import os
import shutil
import stat
import time

import pytest
import torch

from plait import paths
from plait.engine.models import cached_tensors
from plait.errors import PlaitError
from plait.testing.tiny_model import cached_build


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_027():
    """A umask other than the usual 022, so that 'honours the umask' is not 0644 by chance."""
    previous = os.umask(0o027)
    yield
    os.umask(previous)


def test_the_cache_folder_is_plait_cache_dir_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("PLAIT_CACHE", raising=False)
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "mine"))
    assert paths.cache_dir("ref_logps") == tmp_path / "mine" / "ref_logps"
    monkeypatch.delenv("PLAIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "plait"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "plait"


def test_the_former_plait_cache_still_works_and_asks_to_be_renamed(monkeypatch, tmp_path):
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "old"))
    with pytest.warns(FutureWarning, match="PLAIT_CACHE is the former name of PLAIT_CACHE_DIR"):
        assert paths.cache_dir() == tmp_path / "old"


def test_an_atomic_write_gets_the_users_umask_and_leaves_nothing_behind_on_failure(tmp_path, umask_027):
    target = tmp_path / "catalog.json"
    paths.write_atomically(target, "{}")
    assert target.read_text() == "{}" and mode(target) == 0o640
    paths.write_atomically(target, b"[]")  # replaced in place
    assert target.read_bytes() == b"[]"
    with pytest.raises(TypeError):
        paths.write_atomically(tmp_path / "other", 12)  # fails mid-write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["catalog.json"]


def test_files_a_library_wrote_0600_get_the_users_umask(tmp_path, umask_027):
    private, chosen = tmp_path / "model.safetensors", tmp_path / "script.sh"
    private.write_text("x")
    private.chmod(0o600)
    chosen.write_text("x")
    chosen.chmod(0o700)  # a mode someone chose on purpose is left alone
    paths.honour_umask([private, chosen])
    assert mode(private) == 0o640 and mode(chosen) == 0o700
    assert paths.umask() == 0o027


def test_a_test_model_folder_in_the_cache_is_shared_like_any_new_folder(monkeypatch, tmp_path, umask_027):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))

    def build(folder):
        (folder / "config.json").write_text("{}")
        (folder / "config.json").chmod(0o600)  # as safetensors writes model.safetensors

    folder = cached_build("fixture", build)
    assert mode(folder) == 0o750 and mode(folder / "config.json") == 0o640


def tensors_of(mib: float, value: float) -> dict:
    return {"logps": torch.full((int(mib * 2**18),), value)}  # 2**18 float32 = 1 MiB


def test_the_reference_logps_cache_keeps_within_its_bound_dropping_the_least_recently_used(monkeypatch, tmp_path,
                                                                                             umask_027):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PLAIT_REF_LOGPS_CACHE_MB", "2.5")  # room for two entries of 1 MiB
    computed = collections.Counter()

    def logps(name: str) -> torch.Tensor:
        def compute():
            computed[name] += 1
            return tensors_of(1, float(ord(name)))
        found = cached_tensors({"data": name}, compute)["logps"]
        time.sleep(0.05)  # uses further apart than the file system's clock ticks
        return found

    a, b = logps("a"), logps("b")
    assert torch.equal(logps("a"), a)  # from the cache, and now the most recently used
    folder = tmp_path / "ref_logps"
    assert all(mode(p) == 0o640 for p in folder.iterdir())
    logps("c")  # over the bound: b, the least recently used, goes
    assert len(list(folder.iterdir())) == 2
    assert torch.equal(logps("a"), a) and computed == {"a": 1, "b": 1, "c": 1}
    assert torch.equal(logps("b"), b) and computed["b"] == 2  # computed again
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 2.5 * 2**20


def test_a_reference_logps_cache_of_zero_mib_caches_nothing_and_a_bad_size_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PLAIT_REF_LOGPS_CACHE_MB", "0")
    cached_tensors({"data": "a"}, lambda: tensors_of(0.01, 1.0))
    assert not (tmp_path / "ref_logps").exists()
    monkeypatch.setenv("PLAIT_REF_LOGPS_CACHE_MB", "lots")
    with pytest.raises(PlaitError, match="PLAIT_REF_LOGPS_CACHE_MB='lots' must be a number of MiB >= 0"):
        cached_tensors({"data": "a"}, lambda: tensors_of(0.01, 1.0))


def test_a_damaged_cache_entry_is_computed_again(monkeypatch, tmp_path):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    first = cached_tensors({"data": "a"}, lambda: tensors_of(0.01, 1.0))
    (entry,) = (tmp_path / "ref_logps").iterdir()
    entry.write_bytes(b"half a file")
    again = cached_tensors({"data": "a"}, lambda: tensors_of(0.01, 1.0))
    assert torch.equal(again["logps"], first["logps"]) and entry.stat().st_size > 100


def test_a_write_that_ran_out_of_room_says_which_room(monkeypatch, tmp_path):
    (tmp_path / "optimizer.pt").write_bytes(b"x" * 1000)
    monkeypatch.setattr(paths, "file_size_limit", lambda: 1000)
    assert paths.storage_shortage(tmp_path, 5000) == ("optimizer.pt reached the file size limit (ulimit -f) of "
                                                      "1,000 bytes; about 5,000 bytes were to be written")
    monkeypatch.setattr(paths, "file_size_limit", lambda: None)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=4096))
    assert paths.storage_shortage(tmp_path / "missing" / "checkpoint-4", 5000) == (
        "no space left on its device (4,096 bytes free); about 5,000 bytes were to be written")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=2**30))
    assert paths.storage_shortage(tmp_path, 5000) is None  # room enough: the failure was something else
