"""What the server logs, as vLLM's flags control it: request logs (``enable_log_requests``,
``enable_log_outputs``, ``max_log_len``) named by request ids (``enable_request_id_headers``
makes one for a client that sent none), one access line format for every status (the 499 of a
client that left included), access lines off or off for some paths, the drain's and a stage
failure's lines naming their requests, and one line per sleep-mode call."""

from __future__ import annotations

import asyncio
import logging
import re
import threading

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    tiny_checkpoint,
    wait_for,
)

# Apache's Combined Log Format, which every access line has: grok's COMBINEDAPACHELOG
# (%{IPORHOST} %{USER:ident} %{USER:auth} \[%{HTTPDATE}\] "%{WORD} %{NOTSPACE} HTTP/%{NUMBER}"
# %{NUMBER} (?:%{NUMBER}|-) %{QS:referrer} %{QS:agent}), spelled as a regex
ACCESS_LINE = re.compile(
    r"^(?P<remote>\S+) - - \[\d{2}/\w{3}/\d{4}:\d{2}:\d{2}:\d{2} [+-]\d{4}\] "
    r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/1\.1" (?P<status>\d{3}) (?P<bytes>[1-9]\d*|-) '
    r'"(?P<referer>[^"]*)" "(?P<agent>[^"]*)"$'
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def _stage(ckpt, **script) -> ScriptedStage:
    return ScriptedStage(scripted_info(ckpt), Script([44, 45, 46], **script))


def _lines(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


async def test_request_logs_name_the_request_with_its_params_and_outputs(ckpt, caplog):
    caplog.set_level(logging.DEBUG, logger="rltserve.http.requests")
    stage = _stage(ckpt)
    flags = {"enable_log_requests": True, "enable_log_outputs": True, "max_log_len": 2}
    async with running(ckpt, client_factory=scripted_factory(stage), **flags) as live:
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        _, _, raw = await live.post("/v1/completions", body, headers={"X-Request-Id": "abc"})
        text = orjson.loads(raw)["choices"][0]["text"]
        stream = {**body, "stream": True}
        await live.post("/v1/completions", stream, headers={"X-Request-Id": "s"})
    params = stage.added_params
    assert _lines(caplog, "rltserve.http.requests") == [
        f"Received request cmpl-abc: params: {params[0]}, prompt_tokens: 3.",
        # (max_log_len: two token ids, two characters)
        "Request cmpl-abc details: prompt: None, prompt_token_ids: [5, 6].",
        f"Generated response cmpl-abc: output: {text[:2]!r}, output_token_ids: [44, 45], "
        "finish_reason: length",
        "Finished request cmpl-abc.",
        f"Received request cmpl-s: params: {params[1]}, prompt_tokens: 3.",
        "Request cmpl-s details: prompt: None, prompt_token_ids: [5, 6].",
        f"Generated response cmpl-s (streaming complete): output: {text[:2]!r}, "
        "output_token_ids: [44, 45], finish_reason: length",
        "Finished request cmpl-s.",
    ]


async def test_a_request_its_stage_failed_is_logged_as_failed(ckpt, caplog):
    """Not "Finished": a failed stage or replica ends it with an error (a WARNING, with it)."""
    caplog.set_level(logging.INFO, logger="rltserve.http.requests")
    stage = _stage(ckpt, fail="stage died: replica r1 failed", fail_after=1)
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, enable_log_requests=True) as live:
        for stream in (False, True):
            body = {"prompt": [5], "max_tokens": 3, "stream": stream}
            await live.post("/v1/completions", body, headers={"X-Request-Id": f"f{stream:d}"})
    said = _lines(caplog, "rltserve.http.requests")
    for rid in ("cmpl-f0", "cmpl-f1"):
        assert f"Failed request {rid}: stage died: replica r1 failed" in said
        assert f"Finished request {rid}." not in said


async def test_request_logs_are_off_by_default_and_outputs_need_them(ckpt, caplog):
    caplog.set_level(logging.DEBUG, logger="rltserve.http.requests")
    for flags in ({}, {"enable_log_outputs": True}):
        async with running(ckpt, client_factory=scripted_factory(_stage(ckpt)), **flags) as live:
            status, _, _ = await live.post("/v1/completions", {"prompt": [5], "max_tokens": 1})
            assert status == 200
    assert _lines(caplog, "rltserve.http.requests") == []


async def test_a_client_that_leaves_is_an_aborted_request_and_a_combined_access_line(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="rltserve.http.requests")
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    stage = _stage(ckpt, interval_s=0.05)
    flags = {"enable_log_requests": True}
    async with running(ckpt, client_factory=scripted_factory(stage), **flags) as live:
        await live.post("/v1/completions", {"prompt": [5], "max_tokens": 1})
        body = {"prompt": [5], "max_tokens": 60, "stream": True}
        async with live.stream("/v1/completions", body) as r:
            await r.content.readuntil(b"\n\n")
            r.close()  # the client goes away mid-stream
        await wait_for(lambda: "Aborted request cmpl-test." in caplog.messages)
        await wait_for(lambda: len(_lines(caplog, "aiohttp.access")) == 2)
    served, left = (ACCESS_LINE.match(line) for line in _lines(caplog, "aiohttp.access"))
    assert served and left, _lines(caplog, "aiohttp.access")
    assert (served["status"], left["status"], left["bytes"]) == ("200", "499", "-")
    assert left["path"] == "/v1/completions" and left["remote"] == "127.0.0.1"
    assert left["agent"] == served["agent"] and left["agent"].startswith("Python/")
    assert "Finished request cmpl-test." in caplog.messages  # (the first one)


async def test_access_lines_count_body_bytes_as_apache_does(ckpt, caplog):
    """%b is the body's bytes (aiohttp's own counts the status line and headers, and a
    stream's chunk framing): a stream's as its client read them, none ('-') for a HEAD."""
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    async with running(ckpt, client_factory=scripted_factory(_stage(ckpt))) as live:
        _, _, version = await live.get("/version", headers={"Referer": "http://a.example/"})
        async with live.session.head(live.url + "/health") as r:
            assert r.status == 200 and int(r.headers["Content-Length"]) > 0
        body = {"prompt": [5], "max_tokens": 3, "stream": True}
        async with live.stream("/v1/completions", body) as r:
            streamed = await r.read()
        _, _, missing = await live.get("/nowhere")
        await wait_for(lambda: len(_lines(caplog, "aiohttp.access")) == 4)
    lines = [ACCESS_LINE.match(m) for m in _lines(caplog, "aiohttp.access")]
    assert all(lines), _lines(caplog, "aiohttp.access")
    assert [(m["method"], m["path"], m["status"], m["bytes"]) for m in lines] == [
        ("GET", "/version", "200", str(len(version))),
        ("HEAD", "/health", "200", "-"),
        ("POST", "/v1/completions", "200", str(len(streamed))),
        ("GET", "/nowhere", "404", str(len(missing))),
    ]
    assert (lines[0]["referer"], lines[1]["referer"]) == ("http://a.example/", "-")
    [record] = [r for r in caplog.records if r.name == "aiohttp.access"][:1]
    assert (record.response_status, record.response_size) == (200, len(version))


async def test_access_lines_can_be_turned_off_for_some_paths_or_all(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    quiet = {"disable_access_log_for_endpoints": "/health, /metrics,/ping"}
    for flags, logged in ((quiet, ["/version?x=1"]), ({"disable_uvicorn_access_log": True}, [])):
        caplog.clear()
        async with running(ckpt, client_factory=scripted_factory(_stage(ckpt)), **flags) as live:
            for path in ("/health", "/health?probe=1", "/metrics", "/ping", "/version?x=1"):
                assert (await live.get(path))[0] == 200
            await asyncio.sleep(0.05)  # (aiohttp logs after the response is out)
        paths = [ACCESS_LINE.match(m)["path"] for m in _lines(caplog, "aiohttp.access")]
        assert paths == logged, flags


async def test_request_id_headers_name_every_response_and_its_request(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="rltserve.http.requests")
    flags = {"enable_request_id_headers": True, "enable_log_requests": True}
    async with running(ckpt, client_factory=scripted_factory(_stage(ckpt)), **flags) as live:
        for stream in (False, True):
            body = {"prompt": [5], "max_tokens": 1, "stream": stream}
            _, headers, raw = await live.post("/v1/completions", body)
            rid = headers["X-Request-Id"]
            assert re.fullmatch("[0-9a-f]{32}", rid)  # a fresh one: none was sent
            first = sse_payloads(raw)[0] if stream else orjson.loads(raw)
            assert first["id"] == f"cmpl-{rid}"
            assert f"Finished request cmpl-{rid}." in caplog.messages
        _, headers, _ = await live.post("/v1/completions", {"prompt": []})  # a 400
        assert re.fullmatch("[0-9a-f]{32}", headers["X-Request-Id"])
        first, second = [(await live.get("/health"))[1]["X-Request-Id"] for _ in range(2)]
        assert first != second and re.fullmatch("[0-9a-f]{32}", first)
        _, headers, _ = await live.get("/health", headers={"X-Request-Id": "mine"})
        assert headers["X-Request-Id"] == "mine"  # the client's, as before
        _, headers, raw = await live.post(  # an empty header: as none sent (vLLM's)
            "/v1/completions", {"prompt": [5], "max_tokens": 1}, headers={"X-Request-Id": ""}
        )
        assert orjson.loads(raw)["id"] == f"cmpl-{headers['X-Request-Id']}"
        assert re.fullmatch("[0-9a-f]{32}", headers["X-Request-Id"])
    async with running(ckpt, client_factory=scripted_factory(_stage(ckpt))) as live:
        _, headers, raw = await live.post("/v1/completions", {"prompt": [5], "max_tokens": 1})
        assert "X-Request-Id" not in headers and orjson.loads(raw)["id"] == "cmpl-test"


async def test_the_drain_names_the_requests_it_aborts(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="rltserve.http")
    stage = _stage(ckpt, hold=threading.Event())
    flags = {"enable_log_requests": True, "drain_timeout_s": 0}
    async with running(ckpt, client_factory=scripted_factory(stage), **flags) as live:
        body = {"prompt": [5], "max_tokens": 4}
        pending = asyncio.ensure_future(
            live.post("/v1/completions", body, headers={"X-Request-Id": "held"})
        )
        await wait_for(lambda: stage.added)
        await live.state.drain()
        assert (await pending)[0] == 503
    assert "aborting 1 in-flight request(s): cmpl-held" in caplog.messages
    assert "Aborted request cmpl-held." in caplog.messages


async def test_a_failed_stage_names_the_requests_it_fails(ckpt, caplog):
    caplog.set_level(logging.ERROR, logger="rltserve.http")
    stage = _stage(ckpt, hold=threading.Event())
    flags = {"stage_restarts": 0}
    async with running(ckpt, client_factory=scripted_factory(stage), **flags) as live:
        body = {"prompt": [5], "max_tokens": 4, "n": 2}
        pending = [
            asyncio.ensure_future(live.post("/v1/completions", body, headers={"X-Request-Id": i}))
            for i in ("a", "b")
        ]
        await wait_for(lambda: len(stage.added) == 4)
        stage._dead = "killed"  # (dies without a word, as a crashed worker)
        statuses = [(await p)[0] for p in pending]
    assert statuses == [503, 503]
    # (two requests of n=2: four in the stage)
    assert "stage failed: the stage stopped (failing 2 request(s): cmpl-a, cmpl-b)" in (
        caplog.messages
    )


async def test_sleep_mode_calls_log_one_line_each(ckpt, caplog):
    caplog.set_level(logging.INFO, logger="rltserve.http")
    async with running(ckpt, client_factory=scripted_factory(_stage(ckpt))) as live:
        for path in ("/sleep?level=2", "/wake_up?tags=weights", "/reset_prefix_cache"):
            assert (await live.post(path, None))[0] == 200
    said = ("sleep", "wake", "Reset")
    assert [m for m in _lines(caplog, "rltserve.http") if m.startswith(said)] == [
        "sleep the engine with level 2",
        "wake up the engine with tags: ['weights']",
        "Resetting prefix cache...",
    ]
