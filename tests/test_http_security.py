"""Security bounds of the server: auth on every route but the probes vLLM leaves open (/health,
/ping, /version, /openapi.json, /load, and /metrics unless configured; HEAD as GET),
per-request limits from ServerConfig (``test_http_limits.py``), slow clients timed out, no
secrets, paths or tracebacks in responses."""

from __future__ import annotations

import asyncio
import gzip
import time
import zlib

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    error_of,
    running,
    scripted_factory,
    scripted_info,
)

from rltserve.http import body
from rltserve.http.handlers import ROUTES

KEY = "sk-very-secret-0123456789"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_http_harness import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory)


def scripted(ckpt, **script):
    return scripted_factory(ScriptedStage(scripted_info(ckpt), Script([44, 45, 46], **script)))


BODIES = {
    "/v1/completions": {"prompt": [5], "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5]},
    "/v1/update_weights": {"model_path": "/ckpt"},
    "/sleep": None,  # (query parameters only)
    "/wake_up": None,
    "/reset_prefix_cache": None,
    "/ping": None,
}


# a route with a path parameter, called with a value it serves
CONCRETE = {"/v1/models/{model:.+}": "/v1/models/tiny"}


async def _call(live, method: str, path: str, headers: dict) -> tuple[int, bytes]:
    path = CONCRETE.get(path, path)
    if method == "GET":
        status, _, raw = await live.get(path, headers=headers)
    else:
        status, _, raw = await live.post(path, BODIES[path], headers=headers)
    return status, raw


@pytest.mark.parametrize("metrics_auth", [False, True])
async def test_every_route_but_the_probes_needs_the_key(ckpt, metrics_auth):
    """As vLLM's: read-only probes answer without the key (a liveness probe on /version, a
    SageMaker /ping); everything else needs it, the admin routes (/sleep, /wake_up,
    /reset_prefix_cache, /v1/update_weights) included."""
    probes = {"/health", "/ping", "/version", "/openapi.json", "/load"}
    open_routes = probes | (set() if metrics_auth else {"/metrics", "/metrics/"})
    admin = {"/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/v1/update_weights"}
    assert admin <= {route.path for route in ROUTES} - open_routes
    flags = {"metrics_auth": metrics_auth, "enable_tokenizer_info_endpoint": True}
    async with running(ckpt, client_factory=scripted(ckpt), api_key=KEY, **flags) as live:
        for route in ROUTES:
            status, raw = await _call(live, route.method, route.path, {})
            if route.path in open_routes:
                assert status == 200, (route.path, raw)
                continue
            assert status == 401, (route.path, status)
            assert error_of(raw)["type"] == "authentication_error"
            status, raw = await _call(
                live, route.method, route.path, {"Authorization": "Bearer wrong-" + KEY}
            )
            assert status == 401 and KEY.encode() not in raw  # the key is never echoed
            status, raw = await _call(
                live, route.method, route.path, {"Authorization": f"Bearer {KEY}"}
            )
            assert status == 200, (route.path, raw)


async def test_any_of_several_api_keys_is_accepted(ckpt):
    """``--api-key K1 K2``, as vLLM's (its api_key is a list): either key passes; a key that
    is neither, a prefix of one or the two run together does not."""
    chat = "/v1/chat/completions"
    async with running(ckpt, client_factory=scripted(ckpt), api_key=(KEY, "sk-second")) as live:
        for key in (KEY, "sk-second"):
            status, _, _ = await live.post(chat, BODIES[chat], headers=_bearer(key))
            assert status == 200, key
        for key in ("sk-third", "sk-sec", KEY + "sk-second", ""):
            status, _, raw = await live.post(chat, BODIES[chat], headers=_bearer(key))
            assert status == 401 and b"sk-second" not in raw, key


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def _head_request(live, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    async with live.session.head(live.url + path, headers=headers or {}) as r:
        return r.status, r.headers, await r.read()


@pytest.mark.parametrize("api_key", [None, KEY])
async def test_every_get_route_answers_head_as_get_without_the_body(ckpt, api_key):
    """Load balancers' health checks (HAProxy's ``option httpchk HEAD /health``) and uptime
    monitors send HEAD: the GET's status and headers, no body, and the same key rules."""
    same = ("Content-Type", "Content-Length")
    async with running(ckpt, client_factory=scripted(ckpt), api_key=api_key) as live:
        auth = {"Authorization": f"Bearer {KEY}"} if api_key else {}
        for path in ("/health", "/ping", "/version", "/load", "/v1/models", "/v1/models/tiny"):
            status, got, raw = await live.get(path, headers=auth)
            head_status, head, head_raw = await _head_request(live, path, auth)
            assert (head_status, head_raw) == (200, b"") and status == 200, path
            assert [head[h] for h in same] == [got[h] for h in same] == [
                "application/json", str(len(raw))
            ], path  # fmt: skip
        status, head, raw = await _head_request(live, "/metrics")  # (open unless --metrics-auth)
        assert (status, raw) == (200, b"") and head["Content-Type"].startswith("text/plain")
        assert int(head["Content-Length"]) > 0
        status, head, raw = await _head_request(live, "/v1/models")  # (no key)
        if api_key is None:
            assert (status, raw) == (200, b"")
        else:
            assert (status, raw, head["WWW-Authenticate"]) == (401, b"", "Bearer")
            assert int(head["Content-Length"]) == len((await live.get("/v1/models"))[2])
        status, head, _ = await _head_request(live, "/v1/completions", auth)  # (POST: no HEAD)
        assert (status, head["Allow"]) == (405, "POST")


async def test_oversized_bodies_and_headers(ckpt):
    async with running(
        ckpt, client_factory=scripted(ckpt), max_body_bytes=4096, max_header_bytes=1024
    ) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": "x" * 5000})
        assert status == 413 and error_of(raw)["type"] == "invalid_request_error"
        # The body unread (here never sent), its connection is not reused after the 413.
        head, _ = await _answer(live, _head("/v1/completions", 5000))
        assert head.startswith(b"HTTP/1.1 413 ") and b"\r\nConnection: close\r\n" in head
        status, _, _ = await live.post(
            "/v1/completions", {"prompt": [5]}, headers={"X-Long": "a" * 2000}
        )
        assert status == 400
        status, _, _ = await live.post(
            "/v1/completions", {"prompt": [5]}, headers={"X-Long": "a" * 900}
        )
        assert status == 200


async def test_the_number_of_header_fields_is_bounded(ckpt):
    """``max_header_count`` (vLLM's --h11-max-header-count) reaches the parser: a request with
    more header fields is a 400, one within it is served."""
    async with running(ckpt, client_factory=scripted(ckpt), max_header_count=16) as live:
        # (aiohttp's client adds 6 fields of its own: Host, Accept, ...)
        for extra, status in ((8, 200), (12, 400)):
            fields = {f"X-F{i}": "1" for i in range(extra)}
            assert (await live.post("/v1/completions", {"prompt": [5]}, headers=fields))[
                0
            ] == status


async def _read_all(reader: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


async def _exchange(live, request: bytes) -> bytes:
    """Everything the server sends back on a connection of its own until it closes it (a
    connection it kept open fails the wait)."""
    host, port = live.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    try:
        return await _read_all(reader, 10)
    finally:
        writer.close()


async def _answer(live, request: bytes) -> tuple[bytes, bytes]:
    """The head and body of the response to ``request``, sent on a connection of its own (then
    closed by the client)."""
    host, port = live.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        return head, await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()


def _head(path: str, length: int, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n" % (path.encode(), length, extra)
    )


INFLATED = 16 * 2**20  # a compression bomb's bytes once inflated: 1000 times its size
COMPRESS = {"gzip": lambda b: gzip.compress(b, 1), "deflate": lambda b: zlib.compress(b, 1)}


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compression_bomb_is_refused_before_it_is_inflated(ckpt, monkeypatch, encoding):
    """16 MiB of JSON (blanks first) in under 80 KiB of gzip or deflate against a 1 MiB limit:
    a 413 once the inflated bytes pass the limit, the rest never inflated (aiohttp's stream
    counts what it inflated into it: the limit, and at most its buffer of two 256 KiB pieces
    and the piece being inflated), and its connection not reused (that would read and inflate
    the rest); so for one sent to a route that reads no body."""
    streams = []
    read_within = body.read_within

    async def spy(content, limit):
        streams.append(content)
        return await read_within(content, limit)

    monkeypatch.setattr(body, "read_within", spy)
    json_text = b'{"prompt": [5], "max_tokens": 1}'
    bomb = COMPRESS[encoding](b" " * (INFLATED - len(json_text)) + json_text)
    assert len(bomb) < INFLATED // 200
    limit = 2**20
    async with running(ckpt, client_factory=scripted(ckpt), max_body_bytes=limit) as live:
        extra = b"Content-Encoding: %s\r\n" % encoding.encode()
        head, payload = await _answer(live, _head("/v1/completions", len(bomb), extra) + bomb)
        assert head.startswith(b"HTTP/1.1 413 ") and b"\r\nConnection: close\r\n" in head
        assert error_of(payload)["message"] == f"request body exceeds {limit} bytes"
        # A route that reads no body (/ping: no key needed): the same, not inflated to reuse
        # the connection.
        head, _ = await _answer(live, _head("/ping", len(bomb), extra) + bomb)
        assert head.startswith(b"HTTP/1.1 200 ") and b"\r\nConnection: close" in head
        # (a body within the limit, in the same encoding, is read whole)
        small = COMPRESS[encoding](json_text)
        extra += b"Connection: close\r\n"
        raw = await _exchange(live, _head("/v1/completions", len(small), extra) + small)
        assert raw.startswith(b"HTTP/1.1 200 "), raw
    # (counted once the server is closed: nothing more was inflated after the answer either)
    stream = streams[0]
    assert limit < stream.total_bytes <= limit + 1 + 3 * 2**18, stream.total_bytes


async def test_slow_loris_headers_are_cut_off(ckpt):
    async with running(ckpt, client_factory=scripted(ckpt), idle_timeout_s=0.5) as live:
        host, port = live.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        started = time.monotonic()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for i in range(100):  # a header line every 0.1 s, never the blank line
            try:
                writer.write(b"X-Slow-%d: y\r\n" % i)
                await writer.drain()
            except ConnectionError:
                closed = True
                break
            await asyncio.sleep(0.1)
            if reader.at_eof() or writer.is_closing():
                closed = True
                break
            try:
                if await asyncio.wait_for(reader.read(1), 0.01) == b"":
                    closed = True
                    break
            except asyncio.TimeoutError:
                pass
        writer.close()
        assert closed, "the server kept a trickling connection open"
        assert time.monotonic() - started < 8


@pytest.mark.parametrize(
    ("path", "start"),
    [("/v1/completions", b'{"prompt": '), ("/v1/update_weights", b'{"model_path": ')],
)
async def test_slow_body_gets_408(ckpt, path, start):
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage), body_timeout_s=0.5) as live:
        host, port = live.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + b"Content-Length: 100\r\n\r\n"
            + start
        )
        await writer.drain()
        # The rest of the body would make the connection useless: it closes after the 408
        # (not after the idle timeout of 60 s: that fails the wait).
        raw = await _read_all(reader, 10)
        writer.close()
        head = raw.partition(b"\r\n\r\n")[0]
        assert head.startswith(b"HTTP/1.1 408") and b"\r\nConnection: close\r\n" in head, raw
        assert stage.added == [] and stage.weight_updates == []


async def test_update_weights_body_is_checked_like_every_route(ckpt):
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage), max_body_bytes=2048) as live:
        url = live.url + "/v1/update_weights"
        async with live.session.post(url, data=b"model_path=/ckpt") as r:  # form-encoded
            assert r.status == 415
            assert "application/json" in error_of(await r.read())["message"]
        status, _, raw = await live.post("/v1/update_weights", {"model_path": "x" * 4096})
        assert status == 413 and error_of(raw)["code"] == 413
        for body, param, fragment in [
            ({"model_path": "/ckpt", "force": True}, "force", "unknown field"),
            ({"model_path": "/ckpt", "abort": 1}, "abort", "a boolean"),
            ({"model_path": "/ckpt", "timeout": 3601}, "timeout", "[0, 3600]"),
            ({"model_path": ""}, "model_path", "required"),
        ]:
            status, _, raw = await live.post("/v1/update_weights", body)
            assert (status, error_of(raw)["param"]) == (400, param), raw
            assert fragment in error_of(raw)["message"], raw
        assert stage.weight_updates == []
        body = {"model_path": "/ckpt", "abort": True, "timeout": 5}
        status, _, raw = await live.post("/v1/update_weights", body)
        assert status == 200 and orjson.loads(raw) == {"weight_version": "1"}
        assert stage.weight_updates == [["/ckpt"]]


async def test_update_weights_is_in_openapi(ckpt):
    async with running(ckpt, client_factory=scripted(ckpt)) as live:
        _, _, raw = await live.get("/openapi.json")
    document = orjson.loads(raw)
    operation = document["paths"]["/v1/update_weights"]["post"]
    ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert schema["required"] == ["model_path"]
    assert set(schema["properties"]) == {"model_path", "abort", "timeout"}


async def test_disable_fastapi_docs_hides_the_api_description(ckpt):
    """vLLM's ``--disable-fastapi-docs`` (production manifests' flag): /openapi.json is a 404;
    the flag was "unrecognized arguments", so the server did not start."""
    async with running(ckpt, client_factory=scripted(ckpt), disable_fastapi_docs=True) as live:
        status, _, raw = await live.get("/openapi.json")
        assert status == 404 and "--disable-fastapi-docs" in error_of(raw)["message"]
        assert (await live.get("/health"))[0] == 200


class _Exploding(ScriptedStage):
    def add_request(self, request_id, prompt_token_ids, params, sink, group=None) -> None:
        raise RuntimeError(f"boom in /srv/secret/{KEY}")


async def test_errors_carry_no_tracebacks_secrets_or_paths(ckpt):
    stage = _Exploding(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage), api_key=KEY) as live:
        auth = {"Authorization": f"Bearer {KEY}"}
        status, _, raw = await live.post("/v1/completions", {"prompt": [5]}, headers=auth)
        assert status == 500
        assert error_of(raw)["message"] == "internal server error"
        assert b"Traceback" not in raw and KEY.encode() not in raw and b"/srv" not in raw
        assert live.state._frontend.num_open == 0 and live.state.gate.in_use == 0  # no leak
        _, _, raw = await live.get("/v1/models", headers=auth)
        assert str(ckpt).encode() not in raw  # no filesystem path unless configured
        assert orjson.loads(raw)["data"][0]["root"] == "tiny"
        for route in ROUTES:
            status, raw = await _call(live, route.method, route.path, auth)
            assert KEY.encode() not in raw and b"Traceback" not in raw, route.path


async def test_model_path_shown_when_configured(ckpt):
    async with running(ckpt, client_factory=scripted(ckpt), expose_model_path=True) as live:
        _, _, raw = await live.get("/v1/models")
        assert orjson.loads(raw)["data"][0]["root"] == str(ckpt)


async def test_expect_continue_asks_for_the_key_before_the_body(ckpt):
    """A client without the key gets its 401 instead of ``100 Continue`` (it never uploads the
    body); one with the key is told to go on; an unknown expectation is a 417. A refusal closes the
    connection (the body is never read)."""
    async with running(ckpt, client_factory=scripted(ckpt), api_key=KEY) as live:
        host, port = live.url.removeprefix("http://").rsplit(":", 1)
        body = orjson.dumps({"prompt": [5], "max_tokens": 1})
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: r1\r\nContent-Length: %d\r\n" % len(body)
        )
        for extra, status, message in [
            (b"Expect: 100-continue\r\n", 401, "Missing API key"),
            (b"Expect: 100-continue\r\nAuthorization: Bearer nope\r\n", 401, "Invalid API Key"),
            (b"Expect: teapot\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n", 417, None),
        ]:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + extra + b"\r\n")
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(answer.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            payload = await asyncio.wait_for(reader.readexactly(length), 10)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 %d " % status), answer
            assert b"\r\nX-Request-Id: r1\r\n" in answer and b"Connection: close" in answer
            error = orjson.loads(payload)["error"]
            assert error["code"] == status
            if message is not None:
                assert error["message"].startswith(message)
            else:
                assert error["message"] == "Expect: 'teapot': only '100-continue' is supported"
        # A body its Content-Length puts over max_body_bytes: the 413 at once, no 100 first
        # (without the key, the 401 still comes first).
        big = _head("/v1/completions", 8 * 2**20 + 1, b"Expect: 100-continue\r\n")
        raw = await _exchange(
            live, big.replace(b"\r\n\r\n", b"\r\nAuthorization: Bearer %s\r\n\r\n" % KEY.encode())
        )
        head413, _, payload = raw.partition(b"\r\n\r\n")
        assert head413.startswith(b"HTTP/1.1 413 ") and b"\r\nConnection: close" in head413
        assert error_of(payload)["message"] == "request body of 8388609 bytes exceeds 8388608"
        assert (await _exchange(live, big)).startswith(b"HTTP/1.1 401 ")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + b"Expect: 100-continue\r\nAuthorization: Bearer " + KEY.encode())
        writer.write(b"\r\nConnection: close\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        raw = await _read_all(reader, 10)
        writer.close()
        assert raw.startswith(b"HTTP/1.1 200 ")
        assert orjson.loads(raw.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 1
        status, _, _ = await live.get("/health")
        assert status == 200
