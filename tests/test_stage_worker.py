"""The stage worker's process settings, and the idle hook that gives its heap back."""

from __future__ import annotations

import asyncio
import gc
import platform
import subprocess
import sys

import pytest

from rltserve.core.engine_loop import next_when_idle
from rltserve.core.stage_worker import GC_GEN0_THRESHOLD, tune_gc

# Rounds of eight 1 MiB buffers allocated, touched and freed (a step's metadata and sampling
# buffers at a few hundred rows); prints the page faults per round after the first.
_ROUNDS = """
import resource, sys
import numpy as np
if sys.argv[1] == "tuned":
    from rltserve.core.stage_worker import tune_malloc
    assert tune_malloc()
def one_round():
    buffers = [np.ones(1 << 17, dtype=np.int64) for _ in range(8)]
    del buffers
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    one_round()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def test_tune_gc_freezes_what_exists_and_collects_less_often():
    before = gc.get_threshold()
    try:
        previous = tune_gc()
        assert previous == before
        assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD
        assert gc.get_freeze_count() > 0
        # Cycles are still collected.
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator"
)
def test_tune_malloc_keeps_freed_buffers_for_reuse():
    """By default glibc gives large freed blocks back to the kernel and every round faults its
    8 MiB in again; an engine process keeps them (``tune_malloc``)."""

    def faults(mode: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True
        )
        return float(out.stdout)

    assert faults("default") > 1000  # (2048 pages of 4 KiB a round)
    assert faults("tuned") < 50


# Frees 64 MiB of 1 MiB heap blocks under ``tune_malloc`` (kept: below its trim threshold),
# then trims; prints the resident MiB after the free and after the trim.
_TRIM = """
import numpy as np
from rltserve.core.stage_worker import trim_heap, tune_malloc
assert tune_malloc()
def rss_mib():
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024
buffers = [np.ones(1 << 17, dtype=np.int64) for _ in range(64)]
del buffers
freed = rss_mib()
trim_heap()
print(freed, rss_mib())
"""


@pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator"
)
def test_trim_heap_gives_back_what_tune_malloc_keeps():
    out = subprocess.run([sys.executable, "-c", _TRIM], capture_output=True, text=True, check=True)
    freed, trimmed = map(float, out.stdout.split())
    assert freed - trimmed > 48


async def test_an_idle_engine_runs_on_idle_once_no_command_comes():
    calls: list[int] = []
    inbox: asyncio.Queue = asyncio.Queue()
    inbox.put_nowait(("a",))
    assert await next_when_idle(inbox, lambda: calls.append(1), 0.01) == ("a",)
    assert calls == []  # a waiting command is taken at once
    asyncio.get_running_loop().call_later(0.05, inbox.put_nowait, ("b",))
    assert await next_when_idle(inbox, lambda: calls.append(1), 0.01) == ("b",)
    assert calls == [1]
    asyncio.get_running_loop().call_later(0.01, inbox.put_nowait, ("c",))
    assert await next_when_idle(inbox, None, 0.001) == ("c",)
    assert calls == [1]
