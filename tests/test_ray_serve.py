"""Replicas on Ray Serve behind the unchanged HTTP front end: two ouro-tiny replicas answer
byte for byte what one stage answers (completions and chat, streamed and not), requests spread
over both, session affinity keeps a session on one replica, a replica killed mid-stream ends
only its own streams (an error event then ``[DONE]``) and comes back, and shutdown leaves no
replica process behind. One local Ray cluster serves the whole module; skipped without Ray."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time

import orjson
import pytest
from test_http_harness import metric, running, sse_payloads, tiny_checkpoint, wait_for

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from rltserve.ray.client import APP, ReplicaSetClient  # noqa: E402 - after the skip
from rltserve.ray.config import ReplicaConfig  # noqa: E402

COMPLETION = {"prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT = {
    "messages": [{"role": "user", "content": "hi there"}],
    "max_tokens": 8,
    "temperature": 0,
}
CASES = [
    ("/v1/completions", COMPLETION),
    ("/v1/completions", {**COMPLETION, "stream": True}),
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": SCHEMA}}]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}, "max_thinking_tokens": 3}
SAMPLED = {"n": 2, "seed": 3, "temperature": 1.0, "max_tokens": 24}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}
# Structured outputs (their compiled index crosses to each replica once: ray/guides.py), tools,
# a thinking budget, seeded samples, logprobs and a stream's usage.
FEATURES = [
    ("/v1/chat/completions", {**CHAT, **SAMPLED, "response_format": JSON_FORMAT}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 24, "tools": TOOLS, "tool_choice": "required"}),
    (
        "/v1/completions",
        {"prompt": "pick", "temperature": 0, "logprobs": 2, "guided_choice": ["alpha", "beta"]},
    ),
    ("/v1/chat/completions", {**CHAT, **THINKING, **USAGE}),
]
LONG = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def cluster():
    # (No GPUs, also on a machine with some: a test asks for one no node has.)
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def replicas(n: int = 2, **kw):
    return ReplicaSetClient.factory(ReplicaConfig(replicas=n, **kw))


def replica_requests(raw: bytes) -> dict[str, float]:
    out = {}
    for line in raw.decode().splitlines():
        if line.startswith("rltserve:replica_requests_total{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = float(line.rsplit(" ", 1)[1])
    return out


async def answers(live) -> list[bytes]:
    out = []
    for path, body in CASES:
        status, _, raw = await live.post(path, body)
        assert status == 200, raw
        out.append(raw)
    return out


async def test_two_replicas_answer_as_one_stage_and_share_the_load(cluster, ckpt):
    async with running(ckpt) as single:
        expected = await answers(single)
    async with running(ckpt, client_factory=replicas(2)) as live:
        assert await answers(live) == expected  # same ids and clock: byte for byte
        status, _, raw = await live.get("/health")
        assert status == 200
        assert orjson.loads(raw)["replicas"] == {"live": 2, "configured": 2}
        body = {**COMPLETION, "max_tokens": 16}
        results = await asyncio.gather(*(live.post("/v1/completions", body) for _ in range(8)))
        assert {r[0] for r in results} == {200}
        assert len({r[2] for r in results}) == 1  # greedy: every replica gives the same text
        metrics = (await live.get("/metrics"))[2]
        per_replica = replica_requests(metrics)
        assert len(per_replica) == 2 and all(n > 0 for n in per_replica.values()), per_replica
        assert sum(per_replica.values()) == 8 + len(CASES)
        assert b"rltserve:replicas_live" in metrics
        # Idle now: no replica runs anything (their last batches were sent mid-request).
        text = metrics.decode()
        assert metric(text, "rltserve:num_requests_running") == 0
        assert metric(text, "rltserve:kv_cache_usage_perc") == 0
        running_lines = [x for x in text.splitlines() if x.startswith("rltserve:replica_num_req")]
        assert len(running_lines) == 2 and all(x.endswith(" 0.0") for x in running_lines)
        assert metric(text, "rltserve:engine_steps_total") > 0


async def test_replicas_answer_guided_tool_thinking_and_sampled_requests_as_one_stage(
    cluster, ckpt
):
    async def answer(live):
        out = []
        for path, body in FEATURES * 2:  # (again: a replica that has the index reuses it)
            status, _, raw = await live.post(path, body)
            assert status == 200, raw
            raw = re.sub(rb"chatcmpl-tool-[0-9a-f]+", b"TOOL-ID", raw)  # (random ids)
            # (Each replica has a prefix cache of its own: what a prompt found cached differs.)
            out.append(re.sub(rb'"prompt_tokens_details":\{"cached_tokens":\d+\},', b"", raw))
        return out

    async with running(ckpt) as single:
        expected = await answer(single)
    async with running(ckpt, client_factory=replicas(2)) as live:
        assert await answer(live) == expected


async def test_replicas_log_through_the_servers_log_config_file(
    cluster, ckpt, tmp_path, monkeypatch
):
    """``--log-config-file`` reaches the replicas as it reaches stage workers: their engine
    warnings go through its handlers (a file here) instead of Ray's worker output bare."""
    from rltserve.core import worker_process

    records = tmp_path / "replicas.jsonl"
    fmt = '{"pid": %(process)d, "level": "%(levelname)s", "message": "%(message)s"}'
    handler = {"class": "logging.FileHandler", "formatter": "json", "filename": str(records)}
    config = {
        "version": 1,
        "formatters": {"json": {"format": fmt}},
        "handlers": {"file": handler},
        "loggers": {"rltserve.core": {"level": "WARNING", "handlers": ["file"]}},
    }
    path = tmp_path / "logging.json"
    path.write_text(orjson.dumps(config).decode())
    monkeypatch.setenv(worker_process.LOG_CONFIG_ENV, "")  # (restored after)
    worker_process.set_log_config_file(str(path))  # (as `serve --log-config-file` does)
    async with running(ckpt, client_factory=replicas(1), engine={"num_blocks": 16}):
        pass  # (the replica warned at start: the pool holds less than the model's context)
    lines = [orjson.loads(x) for x in records.read_text().splitlines()]
    lowered = [x for x in lines if "max_model_len lowered" in x["message"]]
    assert lowered and all(x["level"] == "WARNING" for x in lowered), lines
    assert os.getpid() not in {x["pid"] for x in lowered}  # (the replica's: only it has the file)


async def _open_streams(live, sessions: list[str]):
    contexts = [
        live.session.post(live.url + "/v1/completions", json=LONG, headers={"X-Session-Id": s})
        for s in sessions
    ]
    responses = [await c.__aenter__() for c in contexts]
    firsts = [await r.content.readuntil(b"\n\n") for r in responses]
    return contexts, responses, firsts


async def test_a_killed_replica_ends_only_its_streams_and_comes_back(cluster, ckpt):
    config = {"replica_affinity": "session"}
    async with running(ckpt, client_factory=replicas(2, **config)) as live:
        client = live.state.client.inner
        # Until this process's router has both replicas on its hash ring, a session may move.
        for i in range(50):
            await live.post("/v1/completions", COMPLETION, headers={"X-Session-Id": f"w{i}"})
            if len(client.replicas()) == 2:
                break
        headers = {"X-Session-Id": "chat-1"}
        before = replica_requests((await live.get("/metrics"))[2])
        for _ in range(4):
            status, _, raw = await live.post("/v1/completions", COMPLETION, headers=headers)
            assert status == 200, raw
        after = replica_requests((await live.get("/metrics"))[2])
        grown = {r: n - before.get(r, 0) for r, n in after.items() if n != before.get(r, 0)}
        assert list(grown.values()) == [4], grown  # one session, one replica

        contexts, responses, firsts = await _open_streams(live, [f"s{i}" for i in range(8)])
        busy = {r: s for r, s in client.replicas().items() if s.stats and s.stats.num_running}
        if len(busy) < 2:  # (eight sessions on one replica of the ring: 1 in 128) eight more
            more = await _open_streams(live, [f"t{i}" for i in range(8)])
            contexts, responses, firsts = (
                a + b for a, b in zip((contexts, responses, firsts), more)
            )
            busy = {r: s for r, s in client.replicas().items() if s.stats and s.stats.num_running}
        assert len(busy) == 2, busy  # the sessions hash onto both replicas
        victim, state = sorted(busy.items())[0]
        steps_before = client.stats.num_steps
        os.kill(state.pid, signal.SIGKILL)
        endings = []
        for context, response, first in zip(contexts, responses, firsts):
            rest = await asyncio.wait_for(response.content.read(), 120)
            await context.__aexit__(None, None, None)
            events = sse_payloads(first + rest)
            assert events[-1] == "[DONE]"
            endings.append(events[-2])
        failed = [e["error"] for e in endings if "error" in e]
        finished = [e["choices"][0]["finish_reason"] for e in endings if "error" not in e]
        assert failed and finished, endings
        assert all(e["code"] == 503 and e["message"].startswith("stage died") for e in failed)
        assert set(finished) == {"length"}
        assert client.stats.num_steps >= steps_before  # its counters stay in the sums

        deadline = time.monotonic() + 120  # Serve replaces the dead replica
        while True:
            status, _, raw = await live.post("/v1/completions", COMPLETION)
            ids = set(client.replicas())
            if status == 200 and client.live_replicas == 2 and len(ids - {victim}) == 2:
                break
            assert time.monotonic() < deadline, (status, raw, ids, client.live_replicas)
            await asyncio.sleep(0.5)
        pids = {s.pid for s in client.replicas().values()}
    # The server closed: its deployment and replica processes are gone, the cluster stays.
    assert APP not in serve.status().applications
    await wait_for(lambda: not any(_alive(p) for p in pids), timeout=30)


async def test_a_replica_that_died_idle_leaves_the_metrics(cluster, ckpt):
    """A replica killed while it ran nothing (no request failed on it) left its series in
    /metrics for good beside its replacement's, and its gauges in the sums."""
    async with running(ckpt, client_factory=replicas(2)) as live:
        client = live.state.client.inner

        async def until_both_answered() -> None:  # (a replica joins the roster as it answers)
            for _ in range(30):  # (concurrent: Serve spreads them by load)
                await asyncio.gather(*(live.post("/v1/completions", COMPLETION) for _ in range(4)))
                if len(client.replicas()) == 2:
                    return
            pytest.fail(f"one replica answered all: {client.replicas()}")

        await until_both_answered()
        victim, state = sorted(client.replicas().items())[0]
        os.kill(state.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120  # Serve replaces it; the poller drops it
        while victim in client.replicas() or client.live_replicas < 2:
            assert time.monotonic() < deadline, (client.replicas(), client.live_replicas)
            await asyncio.sleep(0.5)
        await until_both_answered()
        per_replica = replica_requests((await live.get("/metrics"))[2])
        assert victim not in per_replica and len(per_replica) == 2, per_replica


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_offline_generate_over_two_replicas_keeps_input_order(cluster, ckpt):
    from rltserve.llm import LLM
    from rltserve.ray import generate
    from rltserve.sampling import SamplingParams

    prompts = [[5, 6, 7], [8, 9], "hello there", [10, 11, 12, 13], [1], "a b"]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outputs = generate(prompts, params, replicas=2, model=str(ckpt), num_blocks=512)
    with LLM(model=str(ckpt), num_blocks=512, in_process=True) as llm:
        expected = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in expected]
    assert [_tokens(o) for o in outputs] == [_tokens(o) for o in expected]
    with pytest.raises(ValueError, match="token id"):
        generate([[5], [10**6]], params, replicas=2, model=str(ckpt), num_blocks=512)
    # A config the engine refuses is its ValueError, as from LLM (not a dead actor's error).
    with pytest.raises(ValueError) as refused:
        generate(prompts, params, replicas=1, model=str(ckpt), max_model_len=10**6)
    assert str(refused.value) == "max_model_len=1000000: the model's context is 2048 tokens"


def test_offline_generate_without_params_takes_the_generation_config(cluster, ckpt, tmp_path):
    """As ``LLM.generate``: the checkpoint's sampling defaults on every replica."""
    import shutil

    from rltserve.ray import generate
    from rltserve.sampling import SamplingParams

    model = tmp_path / "m"
    shutil.copytree(ckpt, model)
    (model / "generation_config.json").write_text('{"temperature": 0, "max_new_tokens": 3}')
    prompts = [[5, 6, 7], [8, 9]]
    outputs = generate(prompts, replicas=2, model=str(model), num_blocks=128)
    greedy = SamplingParams(max_tokens=3, temperature=0)
    expected = generate(prompts, greedy, replicas=2, model=str(ckpt), num_blocks=128)
    assert [_tokens(o) for o in outputs] == [_tokens(o) for o in expected]


def _tokens(output) -> list[int]:
    """Generated ids, whether the output is flat or vLLM-shaped (``outputs[0]``)."""
    inner = output.outputs[0] if hasattr(output, "outputs") else output
    return list(inner.token_ids)


async def test_replicas_that_cannot_start_fail_within_the_startup_timeout_saying_why(cluster, ckpt):
    # Replicas no node can schedule (a GPU on a CPU cluster) used to keep the server loading
    # forever (and deaf to SIGTERM): now /health reports the load error at the startup
    # timeout, naming what a replica asks for and what the cluster has.
    gpu = replicas(1, replica_gpus=1, ray_app="rltserve-gpu")  # (its own app name)
    async with running(ckpt, client_factory=gpu, wait=False, startup_timeout_s=3) as live:
        await asyncio.wait_for(live.state.ready.wait(), 60)
        error = live.state.load_error
        assert error is not None and "replicas not ready (deploying)" in error, error
        assert "1 GPU each" in error and "CPU" in error, error
    assert "rltserve-gpu" not in serve.status().applications  # gone with the server
    # An engine that refuses its config: Serve's deployment fails and the reason comes through.
    async with running(
        ckpt,
        client_factory=replicas(1),
        wait=False,
        startup_timeout_s=120,
        engine={"max_model_len": 10**6},
    ) as live:
        await asyncio.wait_for(live.state.ready.wait(), 150)
        error = live.state.load_error
        # ... as the engine's own ValueError: `serve` exits 2 as it does with one stage.
        assert isinstance(live.state.load_exception, ValueError), error
        assert str(live.state.load_exception) == (
            "max_model_len=1000000: the model's context is 2048 tokens"
        )
