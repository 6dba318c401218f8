"""Property-based fuzzing of the HTTP bodies, raw HTTP oddities and SamplingParams (bounded:
fixed examples per property, derandomized). The strategies and checks live in
scripts/fuzz_http.py, which runs the same properties for as many examples as asked."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_http.py"
_spec = importlib.util.spec_from_file_location("fuzz_http", _SCRIPT)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_http"] = fuzz
_spec.loader.exec_module(fuzz)

BOUNDED = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = fuzz.start_server(fuzz.tiny_checkpoint(tmp_path_factory.getbasetemp()))
    yield live
    live.close()


@pytest.fixture
def idle(server):
    """The engine is idle after the test (no running requests, no KV, no slots)."""
    yield server
    server.wait_idle()


@pytest.mark.parametrize("path", list(fuzz.ENDPOINTS))
def test_bodies_get_2xx_or_a_4xx_naming_the_field(idle, path):
    statuses: set[int] = set()

    @BOUNDED
    @given(body=fuzz.ENDPOINTS[path]())
    def prop(body):
        statuses.add(fuzz.check_body(idle, path, body))

    prop()
    assert 400 in statuses  # the strategies do reach the error paths


@pytest.mark.parametrize("path", list(fuzz.ENDPOINTS))
def test_raw_bodies_are_400s_or_served(idle, path):
    @BOUNDED
    @given(raw=fuzz.raw_bodies(path))
    def prop(raw):
        fuzz.check_raw(idle, path, raw)

    prop()


def test_known_nasty_bodies(idle):
    """Fixed cases the strategies may not draw in a short run."""
    cases = [
        ("/v1/completions", b'{"prompt": [1], "temperature": NaN}', None),
        ("/v1/completions", b'{"prompt": [1], "max_tokens": Infinity}', None),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
        ("/v1/completions", b'{"prompt": [1], "max_tokens": 1e400}', None),
        ("/v1/completions", b'{"prompt": [512]}', "prompt"),
        ("/v1/completions", b'{"prompt": [1], "seed": 9223372036854775808}', "seed"),
        ("/v1/completions", b'{"prompt": [1], "n": 1.0}', "n"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
        ("/detokenize", b'{"tokens": [-1]}', "tokens"),
        ("/tokenize", b'{"prompt": "' + b"x" * 300_000 + b'"}', None),
    ]
    for path, raw, param in cases:
        status, headers, data = fuzz.post(idle, path, raw)
        fuzz.check_response(status, headers, data, sent_object=False)
        if param is not None:
            assert status == 400 and json.loads(data)["error"]["param"] == param, data


def _raw_http(server, request: bytes) -> bytes:
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(request)  # no half-close: the server takes EOF for a client gone
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_raw_http_oddities(idle):
    body = b'{"prompt": [5, 6], "max_tokens": 2}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    ok = _raw_http(
        idle,
        head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
    )
    assert _status(ok) == 200
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    response = _raw_http(idle, head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    assert _status(response) == 200  # a chunked body is a body
    response = _raw_http(idle, head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n")
    assert _status(response) == 400  # malformed chunking
    for ctype in (b"text/plain", b"multipart/form-data; boundary=x", b"application/x-www-form"):
        response = _raw_http(
            idle,
            head + b"Content-Type: " + ctype + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        )
        assert _status(response) == 415, response[:200]
        assert b'"param"' in response
    huge = b"X-Big: " + b"a" * 20_000 + b"\r\n"
    response = _raw_http(idle, head + huge + b"Content-Length: 2\r\n\r\n{}")
    assert 400 <= _status(response) < 500  # beyond max_header_bytes
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(500))
    response = _raw_http(idle, head + many + b"Content-Length: 2\r\n\r\n{}")
    assert 400 <= _status(response) < 500
    lying = head + b"Content-Type: application/json\r\nContent-Length: 5\r\n\r\n" + body
    assert _status(_raw_http(idle, lying)) == 400  # 5 bytes of JSON: invalid


@BOUNDED
@given(kwargs=fuzz.SAMPLING_KWARGS)
def test_sampling_params_build_or_name_the_field(kwargs):
    fuzz.check_sampling_params(kwargs)
