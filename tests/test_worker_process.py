"""The parent's handle on a stage worker (``core/worker_process.py``), its channel's sender
thread: a write that fails breaks the channel (the next ``send`` says so, and nothing queued
after is written), and ``stop`` and ``close`` end the thread. On a bare process and socket pair:
no engine."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import pytest

from rltserve.core.worker_process import WorkerProcess, _Outbox


def _senders() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "rltserve-stage-sender"}


def _handle(peer_open: bool = True) -> tuple[WorkerProcess, socket.socket, threading.Thread]:
    """A handle on a process that exits at once, its channel's other end (closed unless
    ``peer_open``) and its sender thread."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stderr=subprocess.PIPE)
    ours, theirs = socket.socketpair()
    if not peer_open:
        theirs.close()
    before = _senders()
    worker = WorkerProcess(proc, Connection(ours.detach()))
    (sender,) = _senders() - before
    return worker, theirs, sender


def test_a_broken_channel_is_an_os_error_at_the_next_send():
    worker, _, sender = _handle(peer_open=False)
    worker.send(("add", "r0"))  # (queued: the sender thread finds the channel broken)
    sender.join(5)
    assert not sender.is_alive()
    with pytest.raises(OSError, match="the stage channel is broken: "):
        worker.send(("add", "r1"))
    worker.stop(5)
    worker.close()


class _FailsOnce:
    """A channel whose first write fails once ``queued`` is set (a later message waits)."""

    def __init__(self) -> None:
        self.queued = threading.Event()
        self.written: list[bytes] = []
        self.calls = 0

    def send_bytes(self, data) -> None:
        self.calls += 1
        if self.calls == 1:
            self.queued.wait(5)
            raise BrokenPipeError("the worker is gone")
        self.written.append(bytes(data))


def test_nothing_queued_after_a_failed_write_is_written():
    """A failed write may have left part of a message on the channel: what follows is never
    written after it (the worker would read it as the rest of the broken one)."""
    conn = _FailsOnce()
    outbox = _Outbox(conn)  # type: ignore[arg-type]
    outbox.put(memoryview(b"first"))
    outbox.put(memoryview(b"second"))
    conn.queued.set()
    deadline = time.monotonic() + 5
    while outbox.failed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert isinstance(outbox.failed, BrokenPipeError) and conn.written == []
    outbox.put(None)


@pytest.mark.parametrize("end", ["stop", "close"])
def test_stop_or_close_ends_the_sender_thread(end):
    worker, theirs, sender = _handle()
    worker.send(("hello",))
    assert theirs.recv(1 << 16)  # (written: the thread waits for the next message)
    if end == "stop":
        worker.stop(5)
    else:
        worker.close()
    sender.join(5)
    assert not sender.is_alive()
    worker.kill()
    worker.close()
    theirs.close()
