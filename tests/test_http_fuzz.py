"""Property-based fuzzing of the HTTP bodies, raw HTTP oddities and SamplingParams (bounded:
fixed examples per property, derandomized). The strategies and checks live in
scripts/fuzz_http.py, which runs the same properties for as many examples as asked."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from script_util import load_script

fuzz = load_script("fuzz_http")

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


# ---------------------------------------------------------------------- /openapi.json


def _accepts(schema: dict, value: object) -> bool:
    """A validator for the JSON Schema subset /openapi.json uses, written apart from
    rltserve.http.validation so that the two are compared, not copied."""
    if "anyOf" in schema:
        return any(_accepts(s, value) for s in schema["anyOf"])
    kind = schema.get("type")
    if kind is None:
        return True
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        return schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "number":
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (value == value and abs(value) != float("inf"))
        )
    if kind == "array":
        return isinstance(value, list) and all(_accepts(schema["items"], v) for v in value)
    assert kind == "object", schema
    if not isinstance(value, dict):
        return False
    properties = schema.get("properties", {})
    if any(name not in value for name in schema.get("required", ())):
        return False
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        sub = properties.get(key, extra)
        if sub is False or (isinstance(sub, dict) and not _accepts(sub, item)):
            return False
    return True


def _served_schema(document: dict, path: str) -> dict:
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    return document["components"]["schemas"][ref["schema"]["$ref"].rsplit("/", 1)[1]]


def test_openapi_is_served_and_lists_every_route(idle):
    from rltserve.http.handlers import ROUTES
    from rltserve.http.openapi import openapi_path

    conn = fuzz.http.client.HTTPConnection(idle.host, idle.port, timeout=30)
    conn.request("GET", "/openapi.json")
    document = json.loads(conn.getresponse().read())
    conn.close()
    assert document["openapi"].startswith("3.")
    assert {(r.method.lower(), openapi_path(r.path)) for r in ROUTES} == {
        (method, path) for path, ops in document["paths"].items() for method in ops
    }
    schema = _served_schema(document, "/v1/completions")
    assert schema["required"] == ["prompt"]
    assert schema["properties"]["seed"]["anyOf"][0] == {
        "type": "integer",
        "minimum": -(2**63),
        "maximum": 2**63 - 1,
    }


@pytest.mark.parametrize("path", list(fuzz.ENDPOINTS))
def test_openapi_accepts_what_validation_accepts(path):
    """For generated bodies, the served schema accepts a body iff parsing it (types, required
    fields, ranges; before the cross-field rules) succeeds."""
    import orjson

    from rltserve.http.handlers import ROUTES
    from rltserve.http.openapi import openapi_document
    from rltserve.http.validation import SchemaError, parse_object

    document = json.loads(json.dumps(openapi_document(ROUTES, "test")))
    schema = _served_schema(document, path)
    cls = next(r.body for r in ROUTES if r.path == path)
    outcomes: set[bool] = set()

    @settings(BOUNDED, max_examples=300)
    @given(body=fuzz.ENDPOINTS[path]())
    def prop(body):
        try:
            value = orjson.loads(fuzz.encode(body))
        except orjson.JSONDecodeError:
            return  # not JSON: neither side sees it
        try:
            parse_object(cls, value, on_unknown=lambda name: None)
            parsed = True
        except SchemaError:
            parsed = False
        assert _accepts(schema, value) == parsed, value
        outcomes.add(parsed)

    prop()
    assert outcomes == {True, False}
