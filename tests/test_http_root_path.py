"""``--root-path`` (vLLM's): behind a path-based proxy that passes the prefix on, requests under
it are served as the same requests without it (key rules, access-log filters and metrics labels
included), paths outside it as they are, and the access line keeps the path as sent."""

from __future__ import annotations

import logging

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    error_of,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    tiny_checkpoint,
)

from rltserve.http.config import ServerConfig
from rltserve.http.root_path import normal_root_path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def _factory(ckpt):
    return scripted_factory(ScriptedStage(scripted_info(ckpt), Script([44, 45, 46])))


async def test_requests_under_the_root_path_are_served_without_it(ckpt):
    auth = {"Authorization": "Bearer k"}
    body = {"prompt": [5], "max_tokens": 2}
    flags = {"root_path": "/llm", "api_key": "k"}
    async with running(ckpt, client_factory=_factory(ckpt), **flags) as live:
        for path in ("/llm/health", "/health", "/llm/ping", "/llm/version"):
            assert (await live.get(path))[0] == 200, path  # (probes: no key, either way)
        status, _, raw = await live.post("/llm/v1/completions", body, headers=auth)
        assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 2
        status, _, raw = await live.post("/v1/completions", body, headers=auth)
        assert status == 200
        stream = {**body, "stream": True}
        status, _, raw = await live.post("/llm/v1/completions", stream, headers=auth)
        assert sse_payloads(raw)[-1] == "[DONE]"
        status, _, raw = await live.get("/llm/v1/models?x=1", headers=auth)
        assert status == 200 and orjson.loads(raw)["data"][0]["id"] == "tiny"
        assert (await live.post("/llm/v1/completions", body))[0] == 401  # (the key rules hold)
        status, _, raw = await live.get("/llmx/v1/models", headers=auth)  # (not under /llm)
        assert status == 404 and "/llmx/v1/models" in error_of(raw)["message"]
        status, _, raw = await live.get("/llm/v1/nothing", headers=auth)  # (named as sent)
        assert status == 404 and error_of(raw)["message"] == "no route GET /llm/v1/nothing"
        status, _, raw = await live.get("/llm/v1/completions", headers=auth)
        assert status == 405 and "on /llm/v1/completions" in error_of(raw)["message"]
        _, _, raw = await live.get("/llm/openapi.json")
        assert orjson.loads(raw)["servers"] == [{"url": "/llm"}]
        _, _, raw = await live.get("/llm/metrics")
        text = raw.decode()
    # (a route's label is the same whichever way it was reached: dashboards are unchanged)
    assert 'handler="/v1/completions",method="POST",status="200"} 3.0' in text
    assert "/llm/" not in text


async def test_no_root_path_serves_no_prefix(ckpt):
    async with running(ckpt, client_factory=_factory(ckpt)) as live:
        assert (await live.get("/llm/health"))[0] == 404
        _, _, raw = await live.get("/openapi.json")
        assert "servers" not in orjson.loads(raw)


async def test_access_lines_keep_the_path_as_sent(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    flags = {"root_path": "/llm/", "disable_access_log_for_endpoints": "/health"}
    async with running(ckpt, client_factory=_factory(ckpt), **flags) as live:
        await live.get("/llm/health")  # (quiet under the prefix too)
        await live.get("/llm/version?a=%20b")
        await live.get("/llm")
        await live.get("/version")
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    requests = [line.split('"')[1] for line in lines]
    assert requests == [
        "GET /llm/version?a=%20b HTTP/1.1",
        "GET /llm HTTP/1.1",
        "GET /version HTTP/1.1",
    ]


def test_root_path_values():
    assert normal_root_path("/llm/") == "/llm"
    assert normal_root_path("/a/b") == "/a/b"
    assert normal_root_path("/") is None and normal_root_path("") is None
    assert ServerConfig(root_path="/llm/").root_path == "/llm"
    for bad in ("llm", "/a?b", "/a#b", "/a//b", 5):
        with pytest.raises(ValueError, match="root_path"):
            ServerConfig(root_path=bad)
