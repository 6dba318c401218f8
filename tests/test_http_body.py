"""Request bodies (``http/body.py``) and routing as the server refuses them: a body that is no
JSON object, too large, sent in chunks past the bound, of another content type, not UTF-8 (its
first bad byte named) or that its Content-Encoding does not decode; unknown routes and methods.
OpenAI-style bodies with the right status, never a 500. Other error responses:
``test_http_errors.py``."""

from __future__ import annotations

import gzip

import orjson
import pytest
from test_http_harness import (
    error_of,
    running,
    scripted_factory,
    stage_for,
    tiny_checkpoint,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


async def test_body_and_routing_errors(ckpt):
    factory = scripted_factory(stage_for(ckpt))
    async with running(ckpt, client_factory=factory, max_body_bytes=2048) as live:
        s, url = live.session, live.url + "/v1/completions"
        status, _, raw = await live.post("/v1/completions", {"prompt": "x" * 4096})
        assert status == 413 and error_of(raw)["code"] == 413
        json_type = {"Content-Type": "application/json"}
        async with s.post(url, data=_chunked(4096), headers=json_type) as r:  # no length
            assert r.status == 413 and error_of(await r.read())["code"] == 413
        async with s.post(url, data=b"prompt=x") as r:  # form-encoded, as curl -d sends
            assert r.status == 415
            assert "application/json" in error_of(await r.read())["message"]
        for raw_body, fragment in ((b"{nope", "invalid JSON"), (b"[1, 2]", "JSON object")):
            async with s.post(url, data=raw_body, headers=json_type) as r:
                assert r.status == 400 and fragment in error_of(await r.read())["message"]
        status, _, raw = await live.post("/v1/completions", {"prompt": "x", "model": "gpt-4"})
        assert status == 404
        assert error_of(raw) == {
            "message": "The model `gpt-4` does not exist.",
            "type": "not_found_error",
            "param": "model",
            "code": 404,
        }
        status, _, raw = await live.get("/v1/nothing")
        assert status == 404 and error_of(raw)["type"] == "not_found_error"
        status, headers, raw = await live.get("/v1/completions")
        assert status == 405 and error_of(raw)["code"] == 405
        assert headers["Allow"] == "POST"  # (RFC 9110, as Starlette sends it)
        status, headers, raw = await live.post("/v1/models", {})
        assert status == 405 and headers["Allow"] == "GET,HEAD"  # (every GET route takes HEAD)
        status, _, _ = await live.post("/v1/completions", {"prompt": "x", "model": "tiny"})
        assert status == 200
        # an empty model names the served one, as a missing one does (vLLM's)
        status, _, raw = await live.post("/v1/completions", {"prompt": "x", "model": ""})
        assert status == 200 and orjson.loads(raw)["model"] == "tiny"


async def _chunked(size: int):
    for _ in range(size // 1024):
        yield b"x" * 1024


async def test_json_content_types_absent_types_and_the_exact_body_bound(ckpt):
    factory = scripted_factory(stage_for(ckpt))
    async with running(ckpt, client_factory=factory, max_body_bytes=2048) as live:
        s, url = live.session, live.url + "/v1/completions"
        body = orjson.dumps({"prompt": [5], "max_tokens": 1})
        for ctype in ("application/json; charset=utf-8", "application/merge-patch+json"):
            async with s.post(url, data=body, headers={"Content-Type": ctype}) as r:
                assert r.status == 200, (ctype, await r.read())
        # no Content-Type at all (curl --data-binary with -H "Content-Type:"): JSON is assumed
        async with s.post(url, data=body, skip_auto_headers=["Content-Type"]) as r:
            assert r.status == 200, await r.read()
        async with s.post(url, data=body, headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 415
        # a body of exactly max_body_bytes is read; one byte more is a 413 (trailing blanks
        # are valid JSON)
        json_type = {"Content-Type": "application/json"}
        exact = body + b" " * (2048 - len(body))
        async with s.post(url, data=exact, headers=json_type) as r:
            assert r.status == 200, await r.read()
        async with s.post(url, data=exact + b" ", headers=json_type) as r:
            assert r.status == 413
            assert error_of(await r.read())["message"] == "request body of 2049 bytes exceeds 2048"


async def test_a_body_that_is_not_utf8_names_its_first_bad_byte(ckpt):
    """Not orjson's "str is not valid UTF-8: surrogates not allowed" (the body has no str and no
    surrogate): the first byte that is not UTF-8, and where, on small bodies and on the long
    ones parsed on the tokenizer pool alike."""
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        s, url = live.session, live.url + "/v1/completions"
        json_type = {"Content-Type": "application/json"}
        for raw_body, byte, offset in [
            (b'{"prompt": "\xff\xfe hi", "max_tokens": 2}', "0xff", 12),
            (b'{"prompt": "\xed\xa0\x80"}', "0xed", 12),  # (a surrogate, encoded)
            (b'{"prompt": "' + b"a" * 100_000 + b'\xc3"}', "0xc3", 100_012),
        ]:
            async with s.post(url, data=raw_body, headers=json_type) as r:
                assert r.status == 400
                assert error_of(await r.read())["message"] == (
                    f"body: not valid UTF-8 (byte {byte} at offset {offset})"
                )
        async with s.post(url, data=b'{"prompt": "\\ud800"}', headers=json_type) as r:
            assert r.status == 400  # (valid UTF-8: orjson's own words)
            message = error_of(await r.read())["message"]
            assert message.startswith("body: invalid JSON: no low surrogate in string")


async def test_a_body_its_content_encoding_does_not_decode_is_a_400(ckpt, caplog):
    factory = scripted_factory(stage_for(ckpt))
    async with running(ckpt, client_factory=factory) as live:
        s, url = live.session, live.url + "/v1/completions"
        body = orjson.dumps({"prompt": [5], "max_tokens": 1})
        gzip_json = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        async with s.post(url, data=gzip.compress(body), headers=gzip_json) as r:
            assert r.status == 200, await r.read()
        # (the server closes a connection whose body it could not read)
        for encoding in ("gzip", "deflate"):
            headers = {**gzip_json, "Content-Encoding": encoding, "Connection": "close"}
            async with s.post(url, data=body, headers=headers) as r:
                assert r.status == 400
                assert error_of(await r.read())["message"] == (
                    f"body: cannot be read: Can not decode content-encoding: {encoding}"
                )
        status, _, _ = await live.post("/v1/completions", {"prompt": [5], "max_tokens": 1})
        assert status == 200
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_an_unknown_route_is_named_and_counted_as_unmatched(ckpt):
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        status, _, raw = await live.get("/v1/nothing")
        assert status == 404 and error_of(raw)["message"] == "no route GET /v1/nothing"
        text = (await live.get("/metrics"))[2].decode()
    assert 'rltserve:http_requests_total{handler="unmatched",method="GET",status="404"} 1' in text
