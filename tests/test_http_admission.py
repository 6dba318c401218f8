"""The server's admission and shutdown paths on a scripted stage: the admission gate's cancel
paths, queued requests counted as waiting, a drain that refuses queued requests at once and
finishes running ones, 503s during shutdown and from a stage that died under an admin call."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from test_http_harness import (
    error_of,
    metric,
    running,
    scripted_factory,
    stage_for,
    tiny_checkpoint,
    wait_for,
)
from test_http_metrics import samples

from rltserve.core.stage import StageError
from rltserve.http.admission import AdmissionGate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


async def test_a_request_during_shutdown_is_a_503_with_retry_after(ckpt):
    """While the server drains, new requests get a 503 a load balancer can retry elsewhere."""
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        live.state.closing = True  # (what drain sets first)
        status, headers, raw = await live.post("/v1/completions", {"prompt": [5]})
        assert status == 503 and headers["Retry-After"] == "1"
        assert error_of(raw)["message"] == "the server is shutting down"


@contextlib.asynccontextmanager
async def _one_slot_taken(ckpt, queued: int):
    """A server of one slot, taken by a request whose tokens wait for ``hold``, with ``queued``
    requests in its admission queue: (live, hold, stage, the running one, the queued ones)."""
    hold = threading.Event()
    stage = stage_for(ckpt, hold=hold)
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, max_concurrent=1, max_queued=4) as live:
        first = asyncio.create_task(live.post("/v1/completions", {"prompt": [5]}))
        await wait_for(lambda: len(stage.added) == 1)
        waiting = [
            asyncio.create_task(live.post("/v1/completions", {"prompt": [5]}))
            for _ in range(queued)
        ]
        await wait_for(lambda: live.state.gate.num_queued == queued)
        yield live, hold, stage, first, waiting


async def test_a_stage_that_dies_under_an_admin_call_is_a_503(ckpt, monkeypatch):
    stage = stage_for(ckpt)

    def died(*args) -> None:
        raise StageError("stage is not running: worker process killed by signal 9")

    for name in ("sleep", "update_weights"):
        monkeypatch.setattr(stage, name, died)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        for path, body in (("/sleep", None), ("/v1/update_weights", {"model_path": "/m"})):
            status, headers, raw = await live.post(path, body)
            assert status == 503 and headers["Retry-After"] == "1", raw
            assert error_of(raw)["message"].startswith("stage is not running")


async def test_a_drain_refuses_queued_requests_at_once_and_finishes_running_ones(ckpt):
    """Queued requests would wait for slots only to be refused: they get the 503 at once (a
    load balancer retries them elsewhere) while the running one finishes."""
    async with _one_slot_taken(ckpt, 1) as (live, hold, stage, first, [queued]):
        drain = asyncio.create_task(live.state.drain())
        status, headers, raw = await queued
        assert status == 503 and headers["Retry-After"] == "1"
        assert error_of(raw)["message"] == "the server is shutting down; retry later"
        assert not first.done()
        hold.set()
        assert (await first)[0] == 200
        await drain
        assert len(stage.added) == 1


async def test_requests_in_the_admission_queue_count_as_waiting(ckpt):
    """``num_requests_waiting`` adds the server's admission queue to the engine's own."""
    async with _one_slot_taken(ckpt, 2) as (live, hold, _, first, queued):
        text = (await live.get("/metrics"))[2].decode()
        assert metric(text, "rltserve:num_requests_waiting") == 2
        hold.set()
        for task in (first, *queued):
            assert (await task)[0] == 200
        text = (await live.get("/metrics"))[2].decode()
        assert metric(text, "rltserve:num_requests_waiting") == 0


async def test_a_better_priority_leaves_the_admission_queue_before_worse_ones(ckpt):
    """Under --scheduling-policy priority the admission queue is in the engine's order: an
    interactive request (priority 0) queued after batch ones (priority 10) reaches the engine
    first when a slot frees. In FIFO order it waited for every batch request queued before it
    to end (seconds of TTFT under batch load with --max-concurrent near --max-num-seqs)."""
    async with _one_slot_taken(ckpt, 0) as (live, hold, stage, first, _):
        queued = []
        for n, priority in enumerate((10, 10, 0), 1):
            body = {"prompt": [5], "max_tokens": 1, "priority": priority}
            queued.append(asyncio.create_task(live.post("/v1/completions", body)))
            await wait_for(lambda n=n: live.state.gate.num_queued == n)
        hold.set()
        for task in (first, *queued):
            assert (await task)[0] == 200
        assert [p.priority for p in stage.added_params] == [0, 0, 10, 10]


async def test_admission_gate_lets_waiters_in_by_priority_then_arrival():
    gate = AdmissionGate(max_concurrent=1, max_queued=8)
    order: list[str] = []

    async def hold(name: str, priority: int) -> None:
        async with gate.slots(1, priority):
            order.append(name)
            await asyncio.sleep(0)

    async with gate.slots(1):
        tasks = []
        for name, priority in (("a", 10), ("b", 0), ("c", 10), ("d", -1), ("e", 0)):
            tasks.append(asyncio.create_task(hold(name, priority)))
            await asyncio.sleep(0)
        assert gate.num_queued == 5
    await asyncio.gather(*tasks)
    assert order == ["d", "b", "e", "a", "c"] and gate.in_use == 0


async def test_admission_gate_a_cancelled_head_lets_the_next_waiter_in():
    """The head waiter (too big to fit) goes away: a smaller one behind it that fits now is
    let in at once, not only at the next release."""
    gate = AdmissionGate(max_concurrent=2, max_queued=2)
    granted: list[str] = []
    done = asyncio.Event()

    async def hold(name: str, weight: int) -> None:
        async with gate.slots(weight):
            granted.append(name)
            await done.wait()

    async with gate.slots(1):
        big = asyncio.create_task(hold("big", 2))
        small = asyncio.create_task(hold("small", 1))
        await asyncio.sleep(0)
        assert gate.num_queued == 2 and granted == []
        big.cancel()
        await asyncio.sleep(0.01)
        assert granted == ["small"] and gate.in_use == 2 and gate.num_queued == 0
        done.set()
        await small
    await asyncio.gather(big, return_exceptions=True)
    assert big.cancelled() and gate.in_use == 0


async def test_admission_gate_a_waiter_cancelled_as_it_is_granted_gives_its_slot_back():
    gate = AdmissionGate(max_concurrent=1, max_queued=1)
    granted: list[str] = []

    async def wait() -> None:
        async with gate.slots(1):
            granted.append("b")

    async with gate.slots(1):
        b = asyncio.create_task(wait())
        await asyncio.sleep(0)
        assert gate.num_queued == 1
    # Leaving the block granted b its slot; b is cancelled in the same turn, before it runs.
    assert gate.in_use == 1 and gate.num_queued == 0
    b.cancel()
    await asyncio.gather(b, return_exceptions=True)
    assert b.cancelled() and granted == [] and gate.in_use == 0


async def test_a_shutdown_closes_idle_keep_alive_connections_at_once(ckpt):
    """A pooled client's idle connection is closed as the drain starts, not left open and deaf
    to new requests until the drain ends: a request sent on it fails at once (EOF) while the
    request in flight still runs to its end."""
    async with _one_slot_taken(ckpt, 0) as (live, hold, stage, first, _):
        host, port = live.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200") and b"\r\nContent-Length: 15\r\n" in head
        assert await reader.readexactly(15) == b'{"status":"ok"}'
        closing = asyncio.create_task(live.server.close())
        await wait_for(lambda: live.state.closing)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, no answer
        writer.close()
        assert not first.done()
        hold.set()
        assert (await first)[0] == 200
        await closing


MODEL = ("model_name", "tiny")
ENGINE = ("engine", "0")


async def test_a_client_that_leaves_the_admission_queue_counts_an_abort(ckpt):
    """As one that leaves the engine's queue: ``request_success_total{finished_reason=
    "abort"}`` (with its e2e latency, the wait), besides the 499."""
    async with _one_slot_taken(ckpt, 1) as (live, hold, stage, first, [queued]):
        queued.cancel()
        abort = ("rltserve:request_success_total", (("finished_reason", "abort"), MODEL, ENGINE))
        for _ in range(500):  # (the server sees the closed connection a moment later)
            got = samples((await live.get("/metrics"))[2].decode())
            if got[abort] == 1.0:
                break
            await asyncio.sleep(0.01)
        assert got[abort] == 1.0
        assert got[("rltserve:e2e_request_latency_seconds_count", (MODEL, ENGINE))] == 1.0
        status = (("handler", "/v1/completions"), ("method", "POST"), ("status", "499"))
        assert got[("rltserve:http_requests_total", status)] == 1.0
        hold.set()
        assert (await first)[0] == 200
        assert len(stage.added) == 1


async def test_the_wait_for_a_seat_is_queue_time(ckpt):
    """A request that waited in the admission queue was queued that long (vLLM's queue time,
    from arrival to the first scheduling): its time in the engine starts when it got a seat."""
    async with _one_slot_taken(ckpt, 1) as (live, hold, stage, first, [queued]):
        await asyncio.sleep(0.5)
        hold.set()
        for task in (first, queued):
            assert (await task)[0] == 200
        got = samples((await live.get("/metrics"))[2].decode())
    assert got[("rltserve:request_queue_time_seconds_sum", (MODEL, ENGINE))] >= 0.5
