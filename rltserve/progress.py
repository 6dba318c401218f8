"""Progress bars for the commands people wait on (``make-model``, the benchmarks).

Bars go to stderr, so a ``--json`` report on stdout stays parseable, and only when a person is
watching: never with ``--quiet`` and never when stderr is not a terminal (a pipe, a log file, a
test); ``LLM.generate``'s also in a Jupyter notebook. The server's request path has none.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

_POLL_S = 0.25  # how often a watched directory's size is read


def progress_enabled(quiet: bool = False) -> bool:
    return not quiet and is_terminal(sys.stderr)


def is_terminal(stream: object) -> bool:
    """Whether ``stream`` is a terminal. Not one: None (a process started without stderr,
    ``2>&-``), a closed file, or a stand-in without ``isatty`` (a logging shim with ``write``
    alone, as scripts assign to ``sys.stderr``): no bar then, rather than a failed call."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel: its stderr is no terminal, yet a person watches
    the cell's output (where tqdm's bar redraws in place)."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return type(shell).__name__ == "ZMQInteractiveShell"


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "it") -> tqdm:
    """A bar on stderr; a no-op object when ``enabled`` is False."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
        unit_scale=unit == "B",
    )


def _dir_bytes(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:  # not created yet, or a file replaced while listed
        return 0


@contextmanager
def watch_dir_growth(path: Path, total_bytes: int, desc: str, enabled: bool) -> Iterator[None]:
    """Shows the bytes written into directory ``path`` (up to ``total_bytes``) while the body
    runs: progress of a writer that reports none, observed from outside."""
    if not enabled:
        yield
        return
    bar = progress_bar(total_bytes, desc, True, unit="B")
    done = threading.Event()

    def poll() -> None:
        while not done.wait(_POLL_S):
            bar.n = min(_dir_bytes(path), total_bytes)
            bar.refresh()

    thread = threading.Thread(target=poll, name="rltserve-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.close()
