"""Progress bars: on stderr only when it is a terminal and without ``--quiet``; ``--json`` on
stdout parses either way."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time

import orjson
import pytest
from test_http_harness import tiny_checkpoint

import rltserve.progress as progress
from rltserve.progress import progress_enabled, watch_dir_growth

TIMEOUT_S = 240
BAR = "%|"  # tqdm's percentage and bar edge


def run(*args: str, terminal: bool) -> tuple[int, str, str]:
    """Runs ``python -m rltserve ARGS``; stderr is a pseudo-terminal when ``terminal``.
    Returns (exit code, stdout, stderr)."""
    cmd = [sys.executable, "-m", "rltserve", *map(str, args)]
    if not terminal:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, where a bar has no room at all.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:  # keeps the terminal's buffer from filling and blocking the child
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, timeout=TIMEOUT_S)
    finally:
        os.close(slave)
        reader.join(10)
        os.close(master)
    return proc.returncode, proc.stdout.decode(), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def bench_args(model) -> list[str]:
    return [
        "bench", "offline", "--model", model, "--num-prompts", "3", "--input-len", "4",
        "--output-len", "3", "--concurrency", "2", "--num-blocks", "64", "--json",
    ]  # fmt: skip


def test_bars_only_for_a_terminal_and_not_when_quiet(monkeypatch):
    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.setattr(sys, "stderr", Stream(True))
    assert progress_enabled() and not progress_enabled(quiet=True)
    monkeypatch.setattr(sys, "stderr", Stream(False))
    assert not progress_enabled()


class WriteOnly:
    """A stand-in for stderr with ``write`` alone, as a script's logging shim has it."""

    def write(self, text: str) -> int:
        return len(text)


@pytest.mark.parametrize("stream", [None, WriteOnly()], ids=["no-stderr", "write-only"])
def test_a_stderr_that_is_no_file_means_no_bar(monkeypatch, stream):
    # (None: a process started with stderr closed, ``python script.py 2>&-``)
    monkeypatch.setattr(sys, "stderr", stream)
    assert not progress_enabled()


def test_bench_offline_json_without_a_terminal_has_no_bar(model):
    code, out, err = run(*bench_args(model), terminal=False)
    assert code == 0, err
    report = orjson.loads(out)
    assert report["num_prompts"] == 3 and report["refill"]["output_tokens"] == 9
    assert BAR not in err and "\r" not in err


def test_bench_offline_bars_on_a_terminal_stay_off_stdout(model):
    code, out, err = run(*bench_args(model), terminal=True)
    assert code == 0, err
    assert orjson.loads(out)["refill"]["output_tokens"] == 9
    assert "refill" in err and BAR in err
    code, out, err = run(*bench_args(model), "--quiet", terminal=True)
    assert code == 0 and orjson.loads(out)["refill"]["output_tokens"] == 9
    assert BAR not in err


def test_make_model_shows_the_weights_written_on_a_terminal(tmp_path):
    code, out, err = run(
        "make-model", "--preset", "ouro-tiny", "--out", tmp_path / "a", "--no-tokenizer",
        terminal=True,
    )  # fmt: skip
    assert code == 0, err
    assert out.startswith("wrote ouro-tiny")
    assert "ouro-tiny weights" in err and BAR in err
    code, out, err = run(
        "make-model", "--preset", "ouro-tiny", "--out", tmp_path / "b", "--no-tokenizer",
        "--quiet", terminal=True,
    )  # fmt: skip
    assert code == 0 and BAR not in err


def _soon(condition) -> bool:
    """Whether ``condition()`` holds within a generous bound (a poll thread makes it true)."""
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_watching_a_directory_shows_the_bytes_written_up_to_the_total(tmp_path, monkeypatch):
    class Bar:
        def __init__(self) -> None:
            self.n, self.seen, self.closed = 0, set(), False

        def refresh(self) -> None:
            self.seen.add(self.n)

        def close(self) -> None:
            self.closed = True

    bar = Bar()
    monkeypatch.setattr(progress, "progress_bar", lambda *a, **kw: bar)
    monkeypatch.setattr(progress, "_POLL_S", 0.001)
    with watch_dir_growth(tmp_path, 100, "weights", enabled=True):
        (tmp_path / "part").write_bytes(b"x" * 60)
        (tmp_path / "sub").mkdir()  # (not a file: not counted)
        assert _soon(lambda: 60 in bar.seen)
        (tmp_path / "more").write_bytes(b"x" * 60)  # past the total: the bar stops at it
        assert _soon(lambda: 100 in bar.seen)
    assert bar.closed and max(bar.seen) == 100
