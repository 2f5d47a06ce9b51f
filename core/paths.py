"""Where plait keeps files outside a run's ``output_dir``, and how it writes files.

* :func:`cache_dir` is plait's one cache folder: ``$PLAIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/plait``,
  else ``~/.cache/plait``. It holds the registry catalog (``catalog.json``), the reference log-prob
  cache (``ref_logps/``, bounded: :func:`keep_within`) and the test models of :mod:`plait.testing`.
  ``PLAIT_CACHE``, its former name, still works, with a warning to rename it.
* :func:`write_atomically` writes a file through a temporary one renamed into place: readers see
  the old file or the new one, never half of one, and a failure leaves nothing behind. The file
  gets the permissions of any new file of the user (0666 less the umask), not a temporary file's 0600.
* :func:`honour_umask` gives files that a library wrote through its own temporary file (safetensors
  does) those same permissions.
* :func:`storage_shortage` says whether a failed write ran out of room (a full device, or the
  process's file size limit), which torch's serializer reports only as ``unexpected pos``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
import warnings
from pathlib import Path
from typing import Iterable

CACHE_VARIABLE = "PLAIT_CACHE_DIR"  # as HF_HUB_CACHE / HF_DATASETS_CACHE name a folder
FORMER_CACHE_VARIABLE = "PLAIT_CACHE"
PRIVATE = 0o600  # the mode of a file made by tempfile.mkstemp


def cache_dir(*parts: str) -> Path:
    """plait's cache folder, or ``parts`` inside it (not created here)."""
    root = os.environ.get(CACHE_VARIABLE)
    former = os.environ.get(FORMER_CACHE_VARIABLE)
    if former:  # whoever set it meant it: used until renamed
        warnings.warn(f"{FORMER_CACHE_VARIABLE} is the former name of {CACHE_VARIABLE}; rename it (it is used in its "
                      "place until then)", FutureWarning, stacklevel=2)
        root = former
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "plait")
    return Path(root, *parts)


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file beside it, renamed into place."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # created as open() creates files (mode 0666, which the kernel narrows by the umask), exclusively
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


_umask_lock = threading.Lock()


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc), else set and restored."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _umask_lock:  # os.umask can only be read by setting it
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def honour_umask(files: Iterable[Path]) -> None:
    """Give each of ``files`` that is private (0600, as a temporary file is made) the mode a new file
    of this user gets."""
    mode = 0o666 & ~umask()
    for path in files:
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == PRIVATE:
            path.chmod(mode)


def read_cached(path: Path) -> bytes | None:
    """The bytes of a cache entry, marked as just used (its mtime) for :func:`keep_within`; None when absent."""
    try:
        data = path.read_bytes()
        os.utime(path)
    except OSError:  # absent, or evicted by another process meanwhile
        return None
    return data


def keep_within(folder: Path, max_bytes: int) -> None:
    """Delete the least recently used files of ``folder`` (by mtime) until the rest fit in ``max_bytes``."""
    entries = []
    for entry in os.scandir(folder):
        try:
            if entry.is_file() and not entry.name.startswith("."):  # "." names: writes in progress
                info = entry.stat()
                entries.append((info.st_mtime_ns, info.st_size, entry.path))
        except OSError:  # removed meanwhile
            continue
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:  # another process evicted it first
            pass
        total -= size


def file_size_limit() -> int | None:
    """The largest file this process may write (``ulimit -f``, RLIMIT_FSIZE), or None when unlimited."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def storage_shortage(folder: str | os.PathLike, needed: int) -> str | None:
    """Why writing about ``needed`` bytes into ``folder`` failed, when it was for lack of room: a file
    that reached the file size limit, or a device with less free space than was left to write.
    None when it was neither."""
    folder = Path(folder)
    sizes = {path.name: path.stat().st_size for path in folder.rglob("*") if path.is_file()} \
        if folder.is_dir() else {}
    need = f"; about {needed:,} bytes were to be written"
    limit = file_size_limit()
    full = [name for name, size in sizes.items() if limit is not None and size >= limit]
    if full:
        return f"{full[0]} reached the file size limit (ulimit -f) of {limit:,} bytes{need}"
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < max(needed - sum(sizes.values()), 2**20):
        return f"no space left on its device ({free:,} bytes free){need}"
    return None
