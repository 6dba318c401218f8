"""Requests aiohttp rejects while parsing (before any middleware) get the OpenAI-style JSON 400
every other error gets, over raw sockets; the message names the kind of error and never quotes
the request's bytes; the server keeps serving."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
from aiohttp import http_parser
from test_http_harness import Script, ScriptedStage, running, scripted_factory, scripted_info
from test_http_harness import tiny_checkpoint as build_checkpoint

from rltserve.http.protocol import parse_error_message

C_PARSER = getattr(http_parser, "HttpRequestParserC", None) is http_parser.HttpRequestParser

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
SECRET = b"s3cr3t-header-value"

MALFORMED = [
    # (raw request, message after "malformed HTTP request: ")
    (b"GARBAGE\r\n\r\n", "Invalid method encountered"),
    (b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n", "Invalid method encountered"),
    (b"GET /health HTTP/9\r\nHost: x\r\n\r\n", "Bad status line"),
    (HEAD + b"X-Big: " + SECRET * 1000 + b"\r\nContent-Length: 2\r\n\r\n{}",
     "Got more than 4096 bytes when reading"),
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
     "Got more than 4096 bytes when reading"),
    (HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(500)) + b"Content-Length: 2\r\n\r\n{}",
     "Too many headers received"),
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n", "Invalid character in chunk size"),
    (HEAD + b"X-A\x01b: " + SECRET + b"\r\nContent-Length: 2\r\n\r\n{}", "Invalid header token"),
    (HEAD + b"X-A: " + SECRET + b"\x00\r\nContent-Length: 2\r\n\r\n{}",
     "Invalid header value char"),
    (HEAD + b"Content-Length: abc\r\n\r\n{}", "Invalid character in Content-Length"),
    (HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
     "Transfer-Encoding can't be present with Content-Length"),
]  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory)


async def _exchange(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        raw = await asyncio.wait_for(reader.read(), timeout=30)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ", 2)[1]), {k.lower(): v for k, v in headers.items()}, body


async def test_parse_errors_are_json_400s(ckpt, caplog):
    caplog.set_level(logging.INFO)
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=64), Script([44, 77]))
    async with running(ckpt, client_factory=scripted_factory(stage), max_header_bytes=4096) as live:
        for request, reason in MALFORMED:
            status, headers, body = await _exchange(live.url, request)
            assert status == 400, request[:60]
            assert headers["content-type"] == "application/json"
            assert int(headers["content-length"]) == len(body)
            error = orjson.loads(body)["error"]
            message = error.pop("message")
            assert error == {"type": "invalid_request_error", "param": None, "code": 400}
            if C_PARSER:  # the pure-Python parser words its errors differently
                assert message == f"malformed HTTP request: {reason}", request[:60]
            assert message.startswith("malformed HTTP request")
            assert SECRET not in body and b"aaaa" not in body
        # One log line each, no traceback quoting the client's bytes (any client could fill
        # the log with them).
        logged = [r for r in caplog.records if "malformed request" in r.getMessage()]
        assert len(logged) == len(MALFORMED) and not any(r.exc_info for r in logged)
        assert not [r for r in caplog.records if r.name == "aiohttp.server"]
        # The server still serves well-formed requests.
        ok = b'{"prompt": [5, 6], "max_tokens": 2}'
        request = HEAD + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(ok)
        status, _, body = await _exchange(live.url, request + ok)
        assert status == 200 and orjson.loads(body)["object"] == "text_completion"


def test_parse_error_message_drops_quoted_bytes():
    class Parse(Exception):
        def __init__(self, message):
            self.message = message

    cases = {  # aiohttp's C and pure-Python parsers' wordings
        "Invalid header value char:\n\n  b'X-A: v\\x00v'\n   ^": "Invalid header value char",
        "Bad status line 'GET /secret HTTP/9'": "Bad status line",
        "Got more than 8190 bytes (20000) when reading b'aaaa'.": "Got more than 8190 bytes",
        "Invalid HTTP header: b'X-A\\x01'": "Invalid HTTP header",
        "Too many headers received": "Too many headers received",
        # (quotes and colons of aiohttp's own words are kept)
        "Missing 'Host' header in request.": "Missing 'Host' header in request.",
        "Data after `Connection: close`": "Data after `Connection: close`",
    }
    for detail, head in cases.items():
        assert parse_error_message(400, Parse(detail)) == f"malformed HTTP request: {head}"


def test_parse_error_message_is_bounded():
    class Parse(Exception):
        def __init__(self, message):
            self.message = message

    # A description that never starts quoting is cut at 100 characters.
    message = parse_error_message(400, Parse("x" * 300))
    assert message == "malformed HTTP request: " + "x" * 100


def test_parse_error_message_without_details():
    class Bare(Exception):
        message = ""

    assert parse_error_message(400, Bare()) == "malformed HTTP request"
    assert parse_error_message(400, None) == "malformed HTTP request"
    assert parse_error_message(500, ValueError("x")) == "internal server error"
    assert parse_error_message(504, None) == "gateway timeout"


async def test_header_bytes_that_are_not_utf8_are_a_4xx_not_a_500(ckpt):
    """aiohttp keeps such bytes as surrogates: a key compared with them was a 500, and an
    X-Request-Id naming the response could not be written as JSON (a 500 after the whole
    generation ran)."""
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    body = b'{"prompt": [5], "max_tokens": 1}'

    def request(headers: bytes) -> bytes:
        return (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + headers
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
            + body
        )

    async with running(ckpt, client_factory=scripted_factory(stage), api_key="k") as live:
        status, _, raw = await _exchange(live.url, request(b"Authorization: Bearer k\xff\r\n"))
        assert status == 401, raw
        headers = b"Authorization: Bearer k\r\nX-Request-Id: caf\xe9\r\n"
        status, _, raw = await _exchange(live.url, request(headers))
        assert status == 400, raw
        assert orjson.loads(raw)["error"]["message"] == "X-Request-Id header: must be UTF-8 text"
        status, _, raw = await _exchange(live.url, request(b"Authorization: Bearer k\r\n"))
        assert status == 200 and len(stage.added) == 1, raw  # (the 400 reached no engine)


async def test_an_http_1_0_keep_alive_stream_ends_with_its_connection(ckpt):
    """HTTP/1.0 has no chunked encoding, so a stream (a body of no length) ends only when the
    connection closes: a 1.0 client asking for keep-alive got every event and ``[DONE]`` and
    then waited for that end until the idle timeout. Its connection closes after the stream."""
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 77]))
    body = b'{"prompt": [5], "max_tokens": 2, "stream": true}'
    request = (
        b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    async with running(ckpt, client_factory=scripted_factory(stage), idle_timeout_s=60) as live:
        status, headers, raw = await _exchange(live.url, request)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers.get("connection", "close").lower() == "close"
    assert raw.endswith(b"data: [DONE]\n\n")
