"""The stage worker process: ``main()`` with ``--fd N --parent-pid P [--role R]
[--log-level L | --log-config-file F]`` (``python -m
rltserve.core.stage_worker`` runs it too; the client starts it with a bootstrap that keeps the
caller's current directory off ``sys.path``).

The worker is a program of its own, so starting it never re-imports the caller's main module: a
script, code piped on stdin or a notebook needs no ``if __name__ == "__main__"`` guard. It
inherits one end of a socket pair as file descriptor N and speaks the stage protocol (see
``rltserve.core.stage``) over it; the first message it receives is the ``EngineConfig``.

Signals: the worker ignores SIGINT and SIGTERM. A Ctrl-C in a terminal or a service manager's
SIGTERM to the process group is meant for the parent, which decides how the stage stops (a
drain, then ("shutdown",)). The worker stops when told, when the channel closes, or when the
parent process goes away (it is then re-parented, which a watchdog thread notices).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import platform
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

_PARENT_POLL_S = 1.0
# Gen-0 collection every this many net container allocations (Python's default: 700).
GC_GEN0_THRESHOLD = 20_000

# How the server logs (``rltserve serve``); a worker whose parent set up logging logs so too.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def load_log_config(source: str | dict) -> None:
    """Sets up logging from a JSON ``logging.config.dictConfig`` file (``rltserve serve
    --log-config-file``, whose stage workers load the same file) or from its configuration as
    read (``source`` a dict: a Ray replica's, whose node may not have the file); ValueError
    saying why it does not load."""
    import json
    import logging.config

    try:
        if isinstance(source, dict):
            config = source
        else:
            with open(source) as file:
                config = json.load(file)
        if isinstance(config, dict):  # (the caller's loggers exist by now: keep them on)
            config.setdefault("disable_existing_loggers", False)
        logging.config.dictConfig(config)
    except (OSError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise ValueError(str(exc)) from exc


def set_up_logging(setup: str | dict | int | None) -> None:
    """This process's logging as its parent handed it (``worker_process.handed_logging``): a
    dictConfig file, or its configuration as read, else a level in the server's format; None
    leaves Python's bare last-resort output, as the parent's."""
    if isinstance(setup, (str, dict)):
        load_log_config(setup)
    elif setup is not None:
        logging.basicConfig(level=setup, format=LOG_FORMAT)


def tune_gc() -> tuple[int, int, int]:
    """Collector settings for a process that runs an engine; returns the previous thresholds.

    A step allocates thousands of short-lived objects (plan items, results, updates) and frees
    them by reference counting; with the default thresholds the collector ran about 1.5 times
    per step at 256 rows and periodically scanned every long-lived object (0.7-0.8 ms per step
    of a loaded machine's 5-6, docs/benchmarks.md). Objects alive now (modules, the
    configuration) are frozen out of collection; cycles are still collected, less often."""
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 100)
    return previous


# glibc's mallopt parameters, and the values an engine process sets (``tune_malloc``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD = 32 << 20  # bytes: smaller blocks come from the heap (glibc's max)
MALLOC_TRIM_THRESHOLD = 256 << 20  # bytes free at the heap's top before it is given back


def tune_malloc() -> bool:
    """Allocator settings for a process that runs an engine (glibc only; True when set).

    By default glibc gives blocks of 128 KB and more back to the kernel when freed (each an
    mmap of its own, or the heap's top trimmed), raising that threshold as it sees such blocks
    come and go. A step's buffers of that size (attention metadata and block tables, sampling
    temporaries at a few hundred rows) then fault their pages in again step after step: 8-23
    page faults per step at 512 rows here, at ~5 us each in this VM (2-4% of the step's host
    time; docs/benchmarks.md). Fixed thresholds keep such blocks in the heap for reuse; the process
    keeps up to ``MALLOC_TRIM_THRESHOLD`` of freed memory. (glibc has no way back to its
    adaptive threshold: this is for the engine's own process and its benchmarks.)"""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # A fixed trim threshold alone would also fix the mmap one at 128 KB (worse than glibc's
    # adaptive default): set it only once the mmap threshold is taken.
    if not libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD):
        return False
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


def trim_heap() -> None:
    """Gives the heap's free memory back to the kernel (glibc's ``malloc_trim``): what
    ``tune_malloc``'s thresholds keep for the next steps, up to the largest step's buffers
    so far (90-120 MB after a soak of mixed requests). The engine loop calls it once the
    engine has been idle a while, so a busy engine keeps its buffers and an idle one its
    working set only."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _watch_parent(parent_pid: int) -> None:
    """Exits the worker once its parent is gone; nobody is left to read its output. The channel's
    EOF normally ends the worker first; this covers a channel kept open by a forked copy."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m rltserve.core.stage_worker")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket of the channel")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument(
        "--log-level", type=int, default=None, help="the parent's, when it set one up"
    )
    parser.add_argument(
        "--log-config-file", default=None, help="the parent's dictConfig file, when it has one"
    )
    parser.add_argument(
        "--role", default=None, help="the stage it runs (prefill, decode): for ps and its log lines"
    )
    args = parser.parse_args(argv)
    # (a configuration file: its handlers and formats, as the parent's lines)
    set_up_logging(args.log_config_file if args.log_config_file is not None else args.log_level)
    # Children of the worker must not hold the channel open: its EOF is how the parent learns
    # that the worker died.
    os.set_inheritable(args.fd, False)
    threading.Thread(
        target=_watch_parent, args=(args.parent_pid,), name="rltserve-parent-watch", daemon=True
    ).start()
    conn = Connection(args.fd)
    try:
        config = conn.recv()
    except (EOFError, OSError):
        return 0  # the client went away before sending the configuration

    def send(message: tuple) -> None:
        try:
            conn.send(message)
        except OSError:
            raise SystemExit(0) from None  # the client is gone: stop quietly

    from rltserve.core.stage_loop import serve

    tune_gc()  # this process runs nothing but the engine
    tuned = tune_malloc()
    try:
        serve(config, conn.recv, send, on_idle=trim_heap if tuned else None, role=args.role)
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
