"""The directory a prefill/decode client's transfer files live in (``pd.py``): shared memory
where the host has enough of it, one directory per client. Its owner holds an exclusive flock
on a file in it while it lives (the kernel drops the lock when the process dies, whatever the
PID namespace of the processes sharing the directory), so a new client removes the directories
of owners that are gone (killed before their cleanup: their files would hold shared memory
until a reboot) and never a live one's."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile

_SHM = "/dev/shm"  # where the host has it: the files never touch a disk
_MIN_SHM_BYTES = 1 << 30
_PREFIX = "rltserve-pd-"
_LOCK = "owner.lock"  # the file whose flock the owner holds


def create() -> tuple[str, int]:
    """A new directory, owned (the lock's descriptor, for ``drop``), after a sweep."""
    where = file_dir()
    sweep(where or tempfile.gettempdir())
    directory = tempfile.mkdtemp(prefix=_PREFIX, dir=where)
    return directory, own(directory)


def file_dir() -> str | None:
    """Where transfer files go: shared memory where the host has enough of it (Docker's
    default is 64 MiB), else the default temporary directory."""
    free = shm_free()
    return _SHM if free is not None and free >= _MIN_SHM_BYTES else None


def shm_free() -> int | None:
    """The bytes free in shared memory (None: the host has none)."""
    try:
        return shutil.disk_usage(_SHM).free
    except OSError:
        return None


def fallback_warning(directory: str) -> str | None:
    """What an operator should know when transfer files went to ``directory`` instead of
    shared memory (a container's small default /dev/shm): they are written to disk."""
    free = shm_free()
    if directory.startswith(_SHM + "/") or free is None:
        return None
    return (
        f"KV transfer files go to {os.path.dirname(directory)} (disk), not {_SHM}: it has "
        f"{free / 2**20:.0f} MiB free, under the {_MIN_SHM_BYTES // 2**30} GiB they need there; "
        f"give the container a larger {_SHM} (Docker: --shm-size; Kubernetes: an emptyDir "
        f"volume with medium: Memory mounted at {_SHM})"
    )


def own(directory: str) -> int:
    """Takes the directory's owner lock: locked under another name, then renamed into place,
    so a sweep never finds the lock file unheld while its owner lives."""
    staging = os.path.join(directory, ".lock")
    fd = os.open(staging, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(staging, os.path.join(directory, _LOCK))
    return fd


def drop(directory: str, fd: int) -> None:
    shutil.rmtree(directory, True)
    with contextlib.suppress(OSError):
        os.close(fd)


def sweep(parent: str) -> None:
    """Removes the transfer directories whose owner is gone (killed before its cleanup ran:
    the files would hold shared memory until a reboot): those whose owner lock is free."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        try:
            fd = os.open(os.path.join(parent, name, _LOCK), os.O_RDWR)
        except OSError:  # (no lock yet, or not ours to open)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner lives
            continue
        else:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        finally:
            os.close(fd)


def remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
