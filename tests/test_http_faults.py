"""Fault injection at the HTTP level: a client that stops reading a stream, disconnects at every
phase, the tokenizer failing on one request, one request larger than the KV pool, SIGTERM
with requests in flight, a model step that raises and NaN logits for one request. Each ends
with nothing held: no open generations, no admission slots, no engine requests (and, with the
real engine, no KV blocks)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    post,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    tiny_checkpoint,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def released(live) -> bool:
    state = live.state
    return state.gate.in_use == 0 and state.gate.num_queued == 0 and state._frontend.num_open == 0


async def send_unread(live, body: dict) -> socket.socket:
    """A raw client that POSTs ``body`` to completions and never reads: its receive buffer is
    small (set before connecting) so that the server's writes soon block."""
    host, port = live.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    data = orjson.dumps(body)
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    await loop.sock_sendall(sock, request)
    return sock


async def read_rest(sock: socket.socket) -> bytes:
    """What the server left for ``sock`` to read, up to its close (or a reset)."""
    loop, received = asyncio.get_running_loop(), b""
    with contextlib.suppress(ConnectionResetError):
        while data := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 30):
            received += data
    return received


async def test_a_stalled_reader_is_aborted_and_its_slot_freed(ckpt):
    """A client that stops reading mid-stream: past stream_stall_timeout_s its request is
    aborted, its slot freed and its connection dropped at once; the server does not wait for
    the client to read what is buffered and then end the response properly (a handler held
    for as long as the client likes), so a client that reads again finds the body cut off."""
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=10**7), Script([44, 45]))
    async with running(
        ckpt, client_factory=scripted_factory(stage), stream_stall_timeout_s=0.5
    ) as live:
        body = {"prompt": [5], "max_tokens": 1_000_000, "stream": True}
        sock = await send_unread(live, body)
        try:  # never read: the server's writes block once the socket buffers are full
            # (Filling the kernel's send buffer takes ~2 s alone; late in a full suite, whose
            # process holds many engines' objects, several times that: a liveness bound only.)
            await wait_for(lambda: len(stage.aborted) == 1, timeout=120)
            await wait_for(lambda: released(live), timeout=5)
            received = await read_rest(sock)
        finally:
            sock.close()
        assert not received.endswith(b"\r\n0\r\n\r\n")  # no final chunk: cut off
        assert b"data: [DONE]" not in received
        status, _, raw = await live.post(COMPLETIONS, {"prompt": [5], "max_tokens": 2})
        assert status == 200, raw  # the server goes on serving


async def test_a_client_that_does_not_read_a_large_body_is_dropped(ckpt, caplog):
    """A non-streaming body of megabytes (echo with n) to a client that never reads it: past
    stream_stall_timeout_s the connection is dropped, as a stalled stream's is, instead of
    holding it and the body for as long as the client likes; the server goes on serving, and a
    client that reads gets the whole body. The drop is logged with the bytes sent (the 200
    was counted when the handler returned)."""
    caplog.set_level("WARNING", logger="rltserve.http")
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=10**7), Script([44]))
    async with running(
        ckpt, client_factory=scripted_factory(stage), stream_stall_timeout_s=0.5
    ) as live:
        server = live.server.runner.server
        body = {"prompt": [44] * 300_000, "max_tokens": 1, "echo": True, "n": 32}
        sock = await send_unread(live, body)
        try:  # never read: the body's writes block once the socket buffers are full
            await wait_for(lambda: len(stage.added) == 32, timeout=60)
            await wait_for(lambda: released(live), timeout=60)  # generated: the body is due
            await wait_for(lambda: not server.connections, timeout=60)  # (liveness bounds only)
            received = await read_rest(sock)
        finally:
            sock.close()
        status, headers, raw = await live.post(COMPLETIONS, body)
        assert status == 200 and len(raw) == int(headers["Content-Length"]) > 8 * 2**20
        assert raw == orjson.dumps(orjson.loads(raw))  # whole, as json_response makes it
        assert len(received) < len(raw)  # cut off (or reset before anything was read)
        assert not stage.aborted  # (generation had ended; only the delivery was dropped)
        [dropped] = [r.getMessage() for r in caplog.records if "body bytes" in r.getMessage()]
        assert dropped.startswith("POST /v1/completions: client read nothing for 0.5 s; dropped")


async def test_disconnects_at_every_phase_release_everything(ckpt):
    hold = threading.Event()
    stage = ScriptedStage(scripted_info(ckpt), Script([44], hold=hold, interval_s=0.01))
    async with running(
        ckpt, client_factory=scripted_factory(stage), max_concurrent=1, max_queued=4
    ) as live:
        gate = live.state.gate
        body = {"prompt": [5], "max_tokens": 50, "stream": True}
        # 1. in the engine before the first token (held), 2. queued behind it
        first = asyncio.create_task(post(live.session, live.url + COMPLETIONS, body))
        await wait_for(lambda: len(stage.added) == 1)
        queued = asyncio.create_task(post(live.session, live.url + COMPLETIONS, body))
        await wait_for(lambda: gate.num_queued == 1)
        queued.cancel()
        await wait_for(lambda: gate.num_queued == 0)
        first.cancel()
        await wait_for(lambda: len(stage.aborted) == 1)
        await wait_for(lambda: released(live))
        hold.set()
        # 3. mid-stream, after some chunks
        async with live.stream(COMPLETIONS, body) as response:
            await response.content.readuntil(b"\n\n")
            await response.content.readuntil(b"\n\n")
            response.close()
        await wait_for(lambda: len(stage.aborted) == 2)
        await wait_for(lambda: released(live))
        # 4. a non-streaming request, mid-generation
        task = asyncio.create_task(
            post(live.session, live.url + COMPLETIONS, {**body, "stream": False})
        )
        await wait_for(lambda: len(stage.added) == 3)  # the queued one never got in
        await asyncio.sleep(0.05)
        task.cancel()
        await wait_for(lambda: len(stage.aborted) == 3)
        await wait_for(lambda: released(live))
        # 5. while the body is being uploaded: nothing reaches the engine
        host, port = live.url.removeprefix("http://").rsplit(":", 1)
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        await writer.drain()
        writer.close()
        await asyncio.sleep(0.2)
        assert len(stage.added) == 3 and released(live)
        status, _, _ = await live.post(COMPLETIONS, {"prompt": [5], "max_tokens": 2})
        assert status == 200


async def test_the_tokenizer_failing_on_one_request(ckpt):
    async with running(ckpt) as live:
        codec = live.state._frontend.codec
        encode = codec.encode

        async def flaky(text, *args, **kwargs):
            if "poison" in text:
                raise RuntimeError("tokenizer crashed")
            return await encode(text, *args, **kwargs)

        codec.encode = flaky
        ok = {"prompt": "hello there", "max_tokens": 3, "temperature": 0}
        results = await asyncio.gather(
            live.post(COMPLETIONS, ok),
            live.post(COMPLETIONS, {**ok, "prompt": "poison"}),
            live.post(COMPLETIONS, ok),
        )
        statuses = [status for status, _, _ in results]
        assert statuses == [200, 500, 200], results
        error = orjson.loads(results[1][2])["error"]
        assert error["message"] == "internal server error"  # no exception text leaks
        client = live.state.client
        await wait_for(lambda: released(live))
        await wait_for(lambda: client.stats.num_running == 0 and client.stats.kv_usage == 0)


async def test_one_request_larger_than_the_kv_pool(ckpt):
    # 8 blocks of 4 tokens over 4 planes: one request holds a context of 9 tokens at most, and
    # the context limit says so.
    engine = {"num_blocks": 8, "block_size": 4}
    async with running(ckpt, engine=engine) as live:
        client = live.state.client
        giant = {"prompt": list(range(5, 60)), "max_tokens": 9, "ignore_eos": True, "n": 2}
        small = {"prompt": [5, 6], "max_tokens": 2, "temperature": 0}
        # Without max_tokens a request asks for the whole context: it fits, and ends there.
        whole = {"prompt": [5, 6, 7], "ignore_eos": True}
        statuses = await asyncio.wait_for(
            asyncio.gather(*(live.post(COMPLETIONS, b) for b in (giant, small, whole))), 120
        )
        assert [status for status, _, _ in statuses] == [400, 200, 200]
        message = orjson.loads(statuses[0][2])["error"]["message"]
        assert message == (
            "This model's maximum context length is 9 tokens. However, your request has 55 "
            "input tokens. Please reduce the length of the input messages. (This limit is what "
            "the server's KV cache holds.)"
        )
        body = orjson.loads(statuses[2][2])
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 6
        await wait_for(lambda: released(live))
        await wait_for(lambda: client.stats.num_running == 0 and client.stats.kv_usage == 0)


async def test_an_explicit_context_past_the_kv_pool_fails_at_start(ckpt):
    engine = {"num_blocks": 8, "block_size": 4, "max_model_len": 64}
    async with running(ckpt, engine=engine, wait=False) as live:
        await asyncio.wait_for(live.state.ready.wait(), 60)
        assert "max_model_len=64: the KV pool (8 blocks of 4 tokens" in live.state.load_error
        status, _, _ = await live.get("/health")
        assert status == 503


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_sigterm_drains_in_flight_requests_and_exits_zero(ckpt):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "rltserve.cli", "serve", "--model", str(ckpt)]
    cmd += ["--port", str(port), "--drain-timeout-s", "60", "--log-level", "warning"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 180
            while True:
                assert process.poll() is None and time.monotonic() < deadline
                try:
                    async with session.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
            body = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True}
            async with session.post(url + COMPLETIONS, json=body) as response:
                first = await response.content.readuntil(b"\n\n")
                process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                late = None
                try:  # a new request while draining: 503, or refused (no longer listening)
                    async with aiohttp.ClientSession() as other:
                        late, _, _ = await post(other, url + COMPLETIONS, {"prompt": [5]})
                except aiohttp.ClientConnectionError:
                    pass
                assert late in (None, 503)
                rest = await asyncio.wait_for(response.content.read(), 120)
        events = sse_payloads(first + rest)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"  # finished, not aborted
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert text  # the request ran to its end
        assert await asyncio.to_thread(process.wait, 60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


POISON_SEED = 4242
ASYNC = {"async_scheduling": True, "exit_mode": "delayed"}


async def _fault_outcomes(live, poisoned: dict) -> tuple[tuple, list[tuple]]:
    """A poisoned request beside two healthy ones, after a healthy baseline: the poisoned
    request's response and the healthy ones (baseline first, then a request sent after)."""
    healthy = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    baseline = await live.post(COMPLETIONS, healthy)
    results = await asyncio.wait_for(
        asyncio.gather(
            live.post(COMPLETIONS, {**healthy, **poisoned}),
            live.post(COMPLETIONS, healthy),
            live.post(COMPLETIONS, healthy),
        ),
        120,
    )
    client = live.state.client
    await wait_for(lambda: released(live))
    await wait_for(lambda: client.stats.num_running == 0 and client.stats.kv_usage == 0)
    after = await live.post(COMPLETIONS, healthy)  # the engine is not corrupted
    return results[0], [baseline, *results[1:], after]


def _text(result) -> str:
    status, _, raw = result
    assert status == 200, raw
    return orjson.loads(raw)["choices"][0]["text"]


@pytest.mark.parametrize("engine", [{}, ASYNC], ids=["sync", "async"])
async def test_nan_logits_fail_one_request_over_http(ckpt, monkeypatch, engine):
    from rltserve.core.sampler import Sampler

    sample_device = Sampler.sample_device

    def poisoned(self, logits, rows, banned=()):
        hit = [j for j, row in enumerate(rows) if row.params.seed == POISON_SEED]
        if hit:
            logits = logits.clone()
            logits[hit, 0] = float("nan")
        return sample_device(self, logits, rows, banned)

    monkeypatch.setattr(Sampler, "sample_device", poisoned)
    async with running(ckpt, engine=engine) as live:
        bad, healthy = await _fault_outcomes(live, {"seed": POISON_SEED})
    status, _, raw = bad
    assert status == 500, raw
    message = orjson.loads(raw)["error"]["message"]
    assert message.startswith("non-finite logits (NaN or infinity) for output token 0 ")
    texts = [_text(r) for r in healthy]
    assert texts == [texts[0]] * 4, texts  # the others are unaffected, before and after


@pytest.mark.parametrize("engine", [{}, ASYNC], ids=["sync", "async"])
async def test_a_step_that_raises_fails_its_requests_over_http(ckpt, monkeypatch, engine):
    from rltserve.core.step import Step

    run = Step.run

    def flaky(self):
        if any(live.setup.params.seed == POISON_SEED for live in self.lives):
            raise RuntimeError("injected step failure")
        return run(self)

    monkeypatch.setattr(Step, "run", flaky)
    async with running(ckpt, engine=engine) as live:
        bad, healthy = await _fault_outcomes(live, {"seed": POISON_SEED})
        assert (await live.get("/health"))[0] == 200
    status, _, raw = bad
    assert status == 500, raw
    error = orjson.loads(raw)["error"]
    assert error["message"] == "RuntimeError: injected step failure"  # no traceback
    # The healthy requests either shared the failed step (and failed with it) or were served
    # with the baseline's text; the requests before and after are always served.
    texts = [_text(r) for r in (healthy[0], healthy[-1])]
    assert texts[0] == texts[1]
    for status, _, raw in healthy[1:-1]:
        if status == 200:
            assert _text((status, None, raw)) == texts[0]
        else:
            assert status == 500 and b"injected step failure" in raw


async def test_a_client_that_stalls_or_resets_is_no_server_error(ckpt, monkeypatch, caplog):
    """A stalled reader (``StreamStalled``) and a connection reset (before a stream's first
    event, or while the body is read) are the client's doing: the request is aborted, nothing
    is logged as an unhandled error and /metrics counts no 500; a reset before any response
    went out is nginx's 499."""
    from rltserve.http import body as body_module
    from rltserve.http.sse import SSEWriter, StreamStalled

    stage = ScriptedStage(scripted_info(ckpt), Script([44, 45], interval_s=0.005))
    real_send, real_read = SSEWriter.send, body_module.read_within
    mode: list[str] = []

    async def send(self, *objs):
        if mode == ["reset"] and not self.started:
            raise ConnectionResetError("Cannot write to closing transport")
        if mode == ["stall"] and self.started:
            raise StreamStalled("client read nothing for 0.5 s; stream dropped")
        if mode == ["lost"] and self.started:  # (aiohttp's drain: a plain ConnectionError)
            raise ConnectionError("Connection lost")
        await real_send(self, *objs)

    async def read(content, limit):
        if mode == ["body-reset"]:
            raise ConnectionResetError("Connection lost")
        return await real_read(content, limit)

    monkeypatch.setattr(SSEWriter, "send", send)
    monkeypatch.setattr(body_module, "read_within", read)
    body = {"prompt": [5], "max_tokens": 50, "stream": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        statuses = []
        for what in ("stall", "reset", "body-reset", "lost"):
            mode[:] = [what]
            status, _, raw = await asyncio.wait_for(live.post(COMPLETIONS, body), 10)
            statuses.append(status)
            assert b"[DONE]" not in raw, what
            await wait_for(lambda: released(live))
        mode.clear()
        assert statuses == [200, 499, 499, 200]  # (the stall, lost: the stream had started)
        assert len(stage.aborted) == 3 and len(stage.added) == 3  # the body-reset never got in
        text = (await live.get("/metrics"))[2].decode()
    closed = 'rltserve:http_requests_total{handler="/v1/completions",method="POST",status="499"}'
    assert f"{closed} 2" in text and 'status="500"' not in text
    assert not any("unhandled error" in r.getMessage() for r in caplog.records)


async def test_an_unexpected_error_mid_stream_ends_the_stream(ckpt, monkeypatch, caplog):
    """A bug that raises after the 200 went out cannot become a 500 response (the client would
    wait for the stream's end until its own timeout): the stream gets an error event and
    ``[DONE]``, the error is logged, the request's KV is freed and the server goes on."""
    from rltserve.http.sse import SSEWriter

    stage = ScriptedStage(scripted_info(ckpt), Script([44, 45], interval_s=0.005))
    real_send = SSEWriter.send
    broken = [True]

    async def send(self, *objs):
        if broken[0] and self.started:
            raise RuntimeError("injected bug")
        await real_send(self, *objs)

    monkeypatch.setattr(SSEWriter, "send", send)
    body = {"prompt": [5], "max_tokens": 50, "stream": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await asyncio.wait_for(live.post(COMPLETIONS, body), 10)
        assert status == 200
        events = sse_payloads(raw)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["message"] == "internal server error"
        assert events[-2]["error"]["code"] == 500
        await wait_for(lambda: released(live))
        assert stage.aborted == stage.added[:1]
        broken[0] = False
        status, _, raw = await asyncio.wait_for(live.post(COMPLETIONS, body), 10)
        assert status == 200 and sse_payloads(raw)[-1] == "[DONE]"
    assert any("unhandled error while streaming" in r.getMessage() for r in caplog.records)
