"""The first program of :func:`plait.online.tools.run_sandboxed`'s child: it runs as ``python -I -S`` (the
standard library only, nothing of the environment), before any model-written code, and sets up what
``preexec_fn`` cannot do safely in a threaded trainer. Given one JSON argument (``readonly``, ``hide``,
``keep``, ``limits``, ``argv``), it

* in a new mount namespace (``readonly``), lays an empty tmpfs over ``hide`` (the trainer's home:
  its tokens, keys and caches), binding back the ``keep`` paths below it (the interpreter's
  folders), then makes every mount read-only except its working directory: a write anywhere else
  fails, whichever user the code runs as;
* sets no-new-privileges (a setuid program cannot regain what was dropped) and the resource limits;
* replaces itself (``execv``) with ``argv``: the model's code in a fresh ``python -I``, possibly
  behind ``setpriv``, which changes to an unprivileged user when the trainer runs as root.
"""

import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
PR_SET_NO_NEW_PRIVS = 38
libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target, flags, fstype=None):
    if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def mountpoints():
    with open("/proc/self/mountinfo") as table:
        # the fifth field, with spaces and the like written as octal escapes
        return [line.split()[4].encode().decode("unicode_escape") for line in table]


def hide(folder, keep):
    below = [path for path in keep if path.startswith(folder.rstrip("/") + "/")]
    handles = {path: os.open(path, os.O_PATH) for path in below}  # still reachable once the tmpfs covers them
    mount("tmpfs", folder, MS_NOSUID | MS_NODEV, "tmpfs")
    for path, handle in handles.items():
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{handle}", path, MS_BIND | MS_REC)
        os.close(handle)


def make_readonly_except(folder):
    mount(folder, folder, MS_BIND)  # the folder becomes its own mount, left writable below
    os.chdir(folder)  # onto that new mount: the old working directory is the one made read-only
    for target in mountpoints():
        if target == folder:
            continue
        try:  # statvfs flags are the mount flags; keeping them is required inside a user namespace
            mount(None, target, MS_REMOUNT | MS_BIND | MS_RDONLY | os.statvfs(target).f_flag)
        except OSError:
            if target == "/":
                raise  # a mount below / that cannot change (a masked /proc file) is not worth failing for


def main():
    settings = json.loads(sys.argv[1])
    if settings["readonly"]:
        if os.path.isdir(settings["hide"]) and settings["hide"] != "/":
            hide(settings["hide"], settings["keep"])
        make_readonly_except(os.getcwd())
    if sys.platform == "linux":
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for name, value in settings["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    os.execv(settings["argv"][0], settings["argv"])


main()
