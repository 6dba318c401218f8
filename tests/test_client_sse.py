"""The async client reads SSE framed with any of the three line endings (``\\r\\n`` as
sse-starlette sends it, ``\\n``, ``\\r``), split across reads anywhere, and bounds what it
buffers; a stream read to its end gives its connection back to the pool. A tiny aiohttp server
plays each framing."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from rltserve import client_sse
from rltserve.client import APIConnectionError, AsyncClient, BadRequestError
from rltserve.client_sse import SSEDecoder

CHUNKS = [{"id": "c", "choices": [{"index": 0, "text": t}]} for t in ("Hel", "lo", " \u00e9")]


def framed(eol: str) -> bytes:
    """A stream with a comment, an event/id line, a two-line data event and [DONE]."""
    parts = [f": keep-alive{eol}{eol}", f"event: message{eol}id: 1{eol}"]
    parts.append(f'data: {{"id": "c", "choices": [{eol}data: {{"index": 0, "text": "Hel"}}]}}')
    parts.append(eol * 2)
    parts += [f'data:{{"id": "c", "choices": [{{"index": 0, "text": "lo"}}]}}{eol}{eol}']
    parts += [f'data: {{"id": "c", "choices": [{{"index": 0, "text": " \u00e9"}}]}}{eol}{eol}']
    parts.append(f"data: [DONE]{eol}{eol}")
    return "".join(parts).encode()


def app_sending(body: bytes, piece: int, headers: dict | None = None) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", **(headers or {})}
        )
        await response.prepare(request)
        for i in range(0, len(body), piece):  # small writes: events split across reads
            await response.write(body[i : i + piece])
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    return app


@contextlib.asynccontextmanager
async def serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("eol", ["\r\n", "\n", "\r"], ids=["crlf", "lf", "cr"])
@pytest.mark.parametrize("piece", [1, 7, 4096])
async def test_client_reads_every_line_ending(eol, piece):
    async with serve(app_sending(framed(eol), piece)) as url, AsyncClient(url) as client:
        chunks = await asyncio.wait_for(_collect(client), 10)
    assert chunks == CHUNKS


async def _collect(client: AsyncClient) -> list[dict]:
    async with client.stream("x") as stream:
        return [chunk async for chunk in stream]


def test_decoder_exact_events_and_split_crlf():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []  # completes the \r\n: not a blank line
    assert decoder.feed(b"\r") == [b"a"]  # a blank line (its \n may follow)
    assert decoder.feed(b"\ndata: b\rdata:c\r\r") == [b"b\nc"]
    assert decoder.feed(b"data: d\n") == []
    assert decoder.feed(b"\n") == [b"d"]
    assert decoder.feed(b"data\n\n: comment\n\nretry: 5\nid: 1\n\n") == [b""]


def test_decoder_bounds_its_buffer():
    decoder = SSEDecoder(max_event_bytes=64)
    decoder.feed(b"data: " + b"x" * 40 + b"\n")
    with pytest.raises(APIConnectionError, match="an SSE event exceeds 64 bytes"):
        decoder.feed(b"data: " + b"y" * 30)
    # a stream with no line breaks at all (not SSE) fails at the bound, not at the end
    decoder = SSEDecoder(max_event_bytes=64)
    with pytest.raises(APIConnectionError, match="exceeds 64 bytes"):
        for _ in range(10):
            decoder.feed(b"z" * 10)


async def test_client_stops_at_the_bound_and_reads_error_events():
    endless = b"data: " + b"x" * (1 << 20)  # one line that never ends
    app = app_sending(endless, 65536)
    async with serve(app) as url, AsyncClient(url, max_event_bytes=4096) as client:
        with pytest.raises(APIConnectionError, match="an SSE event exceeds 4096 bytes"):
            await asyncio.wait_for(_collect(client), 10)
    error = b'data: {"error": {"message": "bad", "type": "x", "param": "n", "code": 400}}\r\n\r\n'
    async with (
        serve(app_sending(error, 5, {"X-Request-Id": "r7"})) as url,
        AsyncClient(url) as client,
    ):
        with pytest.raises(BadRequestError) as err:
            await asyncio.wait_for(_collect(client), 10)
    assert (err.value.message, err.value.param, err.value.code) == ("bad", "n", 400)
    assert err.value.body == {"message": "bad", "type": "x", "param": "n", "code": 400}
    assert err.value.request_id == "r7"  # (the stream's response header)


def test_decoder_holds_exactly_its_bound():
    # The line "data: 1234" is 10 bytes: it fits a bound of 10; one byte more does not.
    decoder = SSEDecoder(max_event_bytes=10)
    assert decoder.feed(b"data: 1234") == []
    with pytest.raises(APIConnectionError, match="exceeds 10 bytes"):
        decoder.feed(b"5")


def app_ending_late(
    after_done: float | None, trailer: bytes = b"", cut: bool = False
) -> tuple[web.Application, list]:
    """A stream whose body ends ``after_done`` seconds after its ``[DONE]`` (None: it goes on
    sending comments until the client leaves), ``trailer`` sent in between, or its connection
    ``cut`` there (no end of body); the list gets each request's client address."""
    peers: list = []

    async def handler(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(framed("\n"))
        if after_done is None:
            with contextlib.suppress(ConnectionError):  # (until the client drops it)
                while True:
                    await asyncio.sleep(0.02)
                    await response.write(b": still here\n\n")
            return response
        await asyncio.sleep(after_done)
        if trailer:
            await response.write(trailer)
            await asyncio.sleep(after_done)
        if cut:
            request.transport.abort()
            return response
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    return app, peers


async def test_a_finished_stream_gives_its_connection_back_to_the_pool():
    """The body's end may come after [DONE] (a write of its own): the client waits for it, so
    the next request reuses the connection instead of opening another."""
    app, peers = app_ending_late(0.05)
    async with serve(app) as url, AsyncClient(url) as client:
        for _ in range(2):
            assert await asyncio.wait_for(_collect(client), 10) == CHUNKS
            chunks = [chunk async for chunk in client.stream("x")]  # (no async with)
            assert chunks == CHUNKS
    assert len(peers) == 4 and len(set(peers)) == 1
    # What a server writes after [DONE] before the end (a comment) is read past as well.
    app, peers = app_ending_late(0.05, trailer=b": bye\n\n")
    async with serve(app) as url, AsyncClient(url) as client:
        for _ in range(2):
            assert await asyncio.wait_for(_collect(client), 10) == CHUNKS
    assert len(peers) == 2 and len(set(peers)) == 1


async def test_a_connection_cut_after_done_still_ends_the_stream_whole():
    """Every event came: a body cut short after [DONE] drops its connection, not the stream."""
    app, peers = app_ending_late(0.05, cut=True)
    async with serve(app) as url, AsyncClient(url) as client:
        for _ in range(2):
            assert await asyncio.wait_for(_collect(client), 10) == CHUNKS
    assert len(set(peers)) == 2


async def test_a_body_left_open_after_done_ends_the_stream_all_the_same(monkeypatch):
    monkeypatch.setattr(client_sse, "END_GRACE_S", 0.1)
    app, peers = app_ending_late(None)
    async with serve(app) as url, AsyncClient(url) as client:
        for _ in range(2):
            assert await asyncio.wait_for(_collect(client), 10) == CHUNKS
    assert len(set(peers)) == 2  # (each such connection is dropped, not pooled)
