"""The server on the real engine (ouro-tiny, in-process stage): outputs equal offline
``LLM.generate``, usage, stop strings, n > 1, echo, logprobs, loop controls, chat templates,
disconnects that free KV, and the metrics they leave behind."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
import pytest_asyncio
import torch
from reference import Reference
from test_http_harness import ENGINE, metric, running, sse_payloads, tiny_checkpoint, wait_for

from rltserve import LLM, SamplingParams
from rltserve.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPTS = [[11, 12, 13], [40, 41, 42, 43, 44, 45, 46], [300], [7, 8, 9, 10, 11]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def offline(ckpt):
    """Reference outputs from the offline API, computed before the server starts."""
    tok = load_tokenizer(ckpt)
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with LLM(str(ckpt), in_process=True, **ENGINE) as llm:
        greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        sampled = llm.generate(
            [PROMPTS[0]] * 3,
            [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11 + j) for j in range(3)],
        )
        loops = llm.generate(
            [PROMPTS[1]],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, max_loops=2, exit_threshold=0.3),
        )
        logprobs = llm.generate(
            [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
        )
        long = llm.generate(
            [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        )
        chat = llm.generate([chat_ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {
        "greedy": greedy,
        "sampled": sampled,
        "loops": loops[0],
        "logprobs": logprobs[0],
        "long": long[0],
        "chat": chat[0],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(ckpt, offline):
    async with running(ckpt) as live:
        yield live


async def complete(server, **body):
    status, _, raw = await server.post("/v1/completions", body)
    assert status == 200, raw
    return orjson.loads(raw)


async def stream(server, path="/v1/completions", **body):
    status, _, raw = await server.post(path, {**body, "stream": True})
    assert status == 200, raw
    events = sse_payloads(raw)
    assert events[-1] == "[DONE]"
    return events[:-1]


def joined(events, field="text"):
    """Per choice index: the concatenated text and the token ids of a completion stream."""
    texts, ids = {}, {}
    for chunk in events:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c[field]
            ids.setdefault(c["index"], []).extend(c.get("token_ids", []))
    return texts, ids


async def test_concurrent_streams_match_offline_generate(server, offline):
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            "return_exit_depths": True}  # fmt: skip
    streams = [stream(server, prompt=p, **body) for p in PROMPTS]
    whole = [complete(server, prompt=p, **body) for p in PROMPTS]
    results = await asyncio.gather(*streams, *whole)
    for i, ref in enumerate(offline["greedy"]):
        texts, ids = joined(results[i])
        assert ids[0] == ref.token_ids and texts[0] == ref.text
        choice = results[len(PROMPTS) + i]["choices"][0]
        assert choice["token_ids"] == ref.token_ids and choice["text"] == ref.text
        assert choice["exit_depths"] == ref.exit_depths
        assert choice["finish_reason"] == ref.finish_reason
        usage = results[len(PROMPTS) + i]["usage"]
        assert usage == {
            "prompt_tokens": len(PROMPTS[i]),
            "completion_tokens": len(ref.token_ids),
            "total_tokens": len(PROMPTS[i]) + len(ref.token_ids),
        }


async def test_seeded_n_choices_match_offline(server, offline):
    body = {"prompt": PROMPTS[0], "n": 3, "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 11, "return_token_ids": True}  # fmt: skip
    result = await complete(server, **body)
    assert [c["token_ids"] for c in result["choices"]] == [r.token_ids for r in offline["sampled"]]
    events = await stream(server, **body)
    _, ids = joined(events)
    assert [ids[j] for j in range(3)] == [r.token_ids for r in offline["sampled"]]


async def test_loop_controls_reach_the_engine(server, offline):
    ref = offline["loops"]
    result = await complete(
        server, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, num_steps=2,
        exit_threshold=0.3, return_token_ids=True, return_exit_depths=True,
    )  # fmt: skip
    choice = result["choices"][0]
    assert choice["token_ids"] == ref.token_ids and choice["exit_depths"] == ref.exit_depths
    assert max(choice["exit_depths"]) <= 2


async def test_logprobs_match_offline(server, offline):
    ref = offline["logprobs"]
    result = await complete(server, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                            logprobs=3)  # fmt: skip
    logprobs = result["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(ref.token_ids)
    sampled = [lp[t].logprob for lp, t in zip(ref.outputs[0].logprobs, ref.token_ids)]
    assert logprobs["token_logprobs"] == pytest.approx(sampled)
    # ...and both equal log_softmax of the dense oracle's logits for these tokens.
    want = Reference.load(server.state.engine_config.model.model).generate(
        PROMPTS[1], len(ref.token_ids), kv_policy="last_exited"
    )
    assert want.tokens == ref.token_ids
    tok = load_tokenizer(server.state.engine_config.model.model)
    for k, (logits, top) in enumerate(zip(want.logits, logprobs["top_logprobs"], strict=True)):
        logp = torch.log_softmax(logits.double(), dim=-1)
        assert logprobs["token_logprobs"][k] == pytest.approx(float(logp[want.tokens[k]]), abs=1e-4)
        values, ids = logp.topk(3)
        texts = [tok.decode([i]) for i in ids.tolist()]
        if len(set(texts)) == 3:  # distinct texts: the top entries are keyed by text
            assert sorted(top) == sorted(texts), f"token {k}"
            assert [top[t] for t in texts] == pytest.approx(values.tolist(), abs=1e-4)
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


async def test_stop_string_across_a_token_boundary(server, offline):
    ref = offline["long"]
    tok = load_tokenizer(server.state.engine_config.model.model)
    stop = expected = None
    for k in range(2, len(ref.token_ids)):  # a boundary whose two sides are plain text
        prefix = tok.decode(ref.token_ids[:k])
        if not ref.text.startswith(prefix) or "\ufffd" in prefix or len(prefix) < 2:
            continue
        candidate = ref.text[len(prefix) - 1 : len(prefix) + 1]
        if len(candidate) == 2 and ref.text.find(candidate) == len(prefix) - 1:
            stop, expected = candidate, prefix[:-1]
            break
    assert stop is not None, "no usable token boundary in the reference text"
    body = {"prompt": PROMPTS[0], "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "stop": stop}  # fmt: skip
    choice = (await complete(server, **body))["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected, "stop")
    events = await stream(server, **body)
    texts, _ = joined(events)
    assert texts[0] == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_echo(server):
    result = await complete(server, prompt="Hello world", max_tokens=3, temperature=0, echo=True)
    assert result["choices"][0]["text"].startswith("Hello world")
    events = await stream(server, prompt="Hello world", max_tokens=3, temperature=0, echo=True)
    assert events[0]["choices"][0]["text"].startswith("Hello world")


async def test_chat_template_and_kwargs(server, offline):
    messages = [{"role": "user", "content": "hi"}]
    counts = []
    for kwargs in (None, {"enable_thinking": True}):
        body = {"messages": messages, "chat_template_kwargs": kwargs}
        status, _, raw = await server.post("/tokenize", body)
        assert status == 200
        counts.append(orjson.loads(raw)["count"])
    assert counts[1] == counts[0] + 2  # "<think>\n" after the generation prompt
    # OpenAI's developer role renders as the system role (templates predate it).
    tokens = []
    for role in ("system", "developer"):
        body = {"messages": [{"role": role, "content": "Be brief."}, *messages]}
        status, _, raw = await server.post("/tokenize", body)
        tokens.append(orjson.loads(raw)["tokens"])
    assert tokens[0] == tokens[1]
    ref = offline["chat"]
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, _, raw = await server.post("/v1/chat/completions", body)
    result = orjson.loads(raw)
    assert status == 200 and result["object"] == "chat.completion"
    assert result["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert result["usage"]["prompt_tokens"] == counts[0]
    events = await stream(server, "/v1/chat/completions", **body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:])
    assert text == ref.text
    thinking = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    status, _, raw = await server.post("/v1/chat/completions", thinking)
    assert orjson.loads(raw)["usage"]["prompt_tokens"] == counts[1]


async def test_disconnect_mid_stream_aborts_and_frees_kv(server, caplog):
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    client = server.state.client
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with server.stream("/v1/completions", body) as r:
        for _ in range(3):
            await r.content.readuntil(b"\n\n")
        assert client.stats.kv_usage > 0
        r.close()  # the client goes away mid-stream
    await wait_for(lambda: client.stats.num_running == 0, timeout=5)
    assert client.stats.kv_usage == 0
    text = (await server.get("/metrics"))[2].decode()
    assert metric(text, "rltserve:kv_cache_usage_perc") == 0
    assert metric(text, "rltserve:num_requests_running") == 0
    closed = 'rltserve:http_requests_total{handler="/v1/completions",method="POST",status="499"}'
    assert closed in text  # counted, as nginx counts a client that closed the connection
    assert any('"POST /v1/completions HTTP/1.1" 499' in r.getMessage() for r in caplog.records)
    result = await complete(server, prompt=PROMPTS[2], max_tokens=2)  # still serving
    assert result["usage"]["completion_tokens"] == 2


async def test_metrics_after_traffic(server):
    # Its own traffic (one finished by length, one streamed), so the test holds alone too.
    await complete(server, prompt=PROMPTS[2], max_tokens=2, ignore_eos=True)
    await stream(server, prompt=PROMPTS[3], max_tokens=3, ignore_eos=True)
    status, headers, raw = await server.get("/metrics")
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = raw.decode()
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):  # fmt: skip
        assert f"# TYPE rltserve:{name} histogram" in text
        assert metric(text, f"rltserve:{name}_count") > 0
    assert metric(text, "rltserve:generation_tokens_total") > 0
    assert metric(text, "rltserve:prompt_tokens_total") > 0
    assert (
        'rltserve:request_success_total{engine="0",finished_reason="length",model_name="tiny"}'
        in text
    )
    # looped-model metrics: depth buckets 1..max_loops, default runs the model's 4 loops
    assert 'rltserve:token_exit_depth_bucket{engine="0",le="8.0",model_name="tiny"}' in text
    assert 2 < metric(text, "rltserve:loops_per_token") <= 4
    assert metric(text, "rltserve:rows_per_step") > 0
    assert metric(text, "rltserve:engine_steps_total") > 0
