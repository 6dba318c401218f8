"""The server's RL pieces on the real engine (ouro-tiny, in-process stage): POST
/v1/update_weights (auth, 400 / 409, weight_version in /v1/models, outputs on the new weights)
and chat thinking (enable_thinking opens <think>, reasoning_content in messages and deltas)."""

from __future__ import annotations

import asyncio
import json
import shutil

import orjson
import pytest
import pytest_asyncio
from builders import random_tensors, write_checkpoint
from test_http_harness import (
    ENGINE,
    running,
    special_think_end_checkpoint,
    sse_payloads,
    tiny_checkpoint,
    wait_for,
)

from rltserve import LLM, SamplingParams
from rltserve.models.tokenizer import load_tokenizer
from rltserve.updates import UPDATE_ABORTED

pytestmark = pytest.mark.asyncio(loop_scope="module")
KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [11, 12, 13]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def new_ckpt(ckpt, tmp_path_factory):
    cfg = json.loads((ckpt / "config.json").read_text())
    out = write_checkpoint(tmp_path_factory.mktemp("new"), cfg, random_tensors(cfg, seed=5))
    for f in ckpt.iterdir():  # the tokenizer too, so LLM can load it as a checkpoint
        if f.name.startswith(("tokenizer", "special")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def offline(ckpt, new_ckpt):
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tok = load_tokenizer(ckpt)
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = tok.apply_chat_template(messages, enable_thinking=True)
    chat = []  # by weight version: the server's tests may run before or after the update
    for path in (ckpt, new_ckpt):
        with LLM(str(path), in_process=True, **ENGINE) as llm:
            chat.append(
                llm.generate([chat_ids], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[
                    0
                ]
            )
            new = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    return {"new": new, "chat": chat, "chat_prompt_tokens": len(chat_ids)}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(ckpt, offline):
    async with running(ckpt, api_key=KEY) as live:
        yield live


async def _tokens(server) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    status, _, raw = await server.post("/v1/completions", body, headers=AUTH)
    assert status == 200, raw
    return orjson.loads(raw)["choices"][0]["token_ids"]


async def _version(server) -> int:
    _, _, raw = await server.get("/v1/models", headers=AUTH)
    version = orjson.loads(raw)["data"][0]["weight_version"]
    assert isinstance(version, str), version  # (as metadata's and /v1/update_weights')
    return int(version)


async def test_update_weights_endpoint(server, new_ckpt, ckpt, tmp_path, offline):
    path = "/v1/update_weights"
    status, _, _ = await server.post(path, {"model_path": str(new_ckpt)})
    assert status == 401
    old = await _tokens(server)
    bad_shape = json.loads((ckpt / "config.json").read_text())
    bad_shape["intermediate_size"] += 8
    wrong = write_checkpoint(tmp_path / "wrong", bad_shape, random_tensors(bad_shape))
    for body, param, fragment in [
        ({"model_path": "/no/such/dir"}, "model_path", "neither"),
        ({"model_path": str(wrong)}, "model_path", "wrong shapes"),
        ({"model_path": str(new_ckpt), "force": True}, "force", "unknown field"),
        ({}, "model_path", "required"),
        ({"model_path": str(new_ckpt), "timeout": -1}, "timeout", "[0, 3600]"),
    ]:
        status, _, raw = await server.post(path, body, headers=AUTH)
        error = orjson.loads(raw)["error"]
        assert (status, error["param"]) == (400, param), error
        assert fragment in error["message"]
    assert await _version(server) == 0 and await _tokens(server) == old
    status, _, raw = await server.post(path, {"model_path": str(new_ckpt)}, headers=AUTH)
    assert status == 200 and orjson.loads(raw) == {"weight_version": "1"}
    assert await _version(server) == 1
    assert await _tokens(server) == offline["new"] != old
    # Each answer says which weights produced it (SGLang's metadata), and so does /metrics.
    status, _, raw = await server.post("/v1/completions", {"prompt": PROMPT}, headers=AUTH)
    assert orjson.loads(raw)["metadata"] == {"weight_version": "1"}
    _, _, raw = await server.get("/metrics", headers=AUTH)
    assert b'rltserve:weight_version{engine="0",model_name="tiny"} 1.0' in raw


async def test_update_during_a_stream_times_out_with_409(server, new_ckpt):
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    async with server.session.post(server.url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status == 200
        await r.content.readline()  # the stream has started: the request runs
        update = {"model_path": str(new_ckpt), "timeout": 0}
        status, _, raw = await server.post("/v1/update_weights", update, headers=AUTH)
    assert status == 409, raw
    assert orjson.loads(raw)["error"]["param"] == "timeout"
    await asyncio.sleep(0)


async def test_an_update_that_aborts_tells_the_aborted_requests_why(ckpt, new_ckpt):
    """``abort: true`` ends the running requests: a stream with an error event that names the
    weight update (it said only "the request was aborted"), then [DONE]; a non-streaming one
    a 503 with Retry-After saying the same. (Its own server: the module's keeps version 1.)"""
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    async with running(ckpt) as live:
        plain = asyncio.create_task(live.post("/v1/completions", body))
        stream = {**body, "stream": True}
        async with live.session.post(live.url + "/v1/completions", json=stream) as r:
            first = await r.content.readuntil(b"\n\n")  # the stream has started: it runs
            await wait_for(lambda: live.state.require_frontend().num_open == 2)  # (both sent)
            update = {"model_path": str(new_ckpt), "abort": True}
            status, _, raw = await live.post("/v1/update_weights", update)
            assert status == 200, raw
            events = sse_payloads(first + await asyncio.wait_for(r.content.read(), 30))
        status, headers, raw = await asyncio.wait_for(plain, 30)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == UPDATE_ABORTED
    assert status == 503 and "Retry-After" in headers, raw
    assert orjson.loads(raw)["error"]["message"] == UPDATE_ABORTED


async def test_chat_thinking_fills_reasoning_content(server, offline):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    status, _, raw = await server.post("/v1/chat/completions", body, headers=AUTH)
    assert status == 200, raw
    result = orjson.loads(raw)
    message = result["choices"][0]["message"]
    want = offline["chat"][await _version(server)].text
    reasoning, _, content = want.partition("</think>")
    # (the offline text is raw; an answer with no content after its span has null content)
    assert message["reasoning_content"] == reasoning and message["content"] == (content or None)
    assert result["usage"]["prompt_tokens"] == offline["chat_prompt_tokens"]
    status, _, raw = await server.post(
        "/v1/chat/completions", {**body, "stream": True}, headers=AUTH
    )
    deltas = [c["choices"][0]["delta"] for c in sse_payloads(raw)[:-1] if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == content


async def test_bounded_thinking_over_http_equals_the_offline_api(ckpt):
    """``max_thinking_tokens`` and ``thinking_interruption`` (text) on completions and chat: the
    same tokens as ``LLM.generate`` with those SamplingParams; bad values are a 400 naming them."""
    think = {"max_thinking_tokens": 3, "thinking_interruption": "ok so"}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, **think)
    with LLM(str(ckpt), in_process=True, **ENGINE) as llm:
        want = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    async with running(ckpt) as live:
        body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **think}  # fmt: skip
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200, raw
        assert orjson.loads(raw)["choices"][0]["token_ids"] == want
        for bad, param in [
            ({"max_thinking_tokens": -2}, "max_thinking_tokens"),  # (-1: no bound, vLLM's)
            ({"max_thinking_tokens": 2, "thinking_end_token_ids": "x"}, "thinking_end_token_ids"),
        ]:
            status, _, raw = await live.post("/v1/completions", {**body, **bad})
            assert status == 400, raw
            assert orjson.loads(raw)["error"]["param"] == param, raw


async def test_reasoning_splits_where_the_tokenizer_makes_think_end_special(ckpt, tmp_path):
    """A tokenizer whose ``</think>`` is a special token: skip_special_tokens (the default)
    must not drop the tag the split looks for (everything came back as reasoning)."""
    special = special_think_end_checkpoint(ckpt, tmp_path / "special")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "max_thinking_tokens": 2, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    got = {}
    for path in (ckpt, special):
        async with running(path) as live:
            status, _, raw = await live.post("/v1/chat/completions", body)
            assert status == 200, raw
            choice = orjson.loads(raw)["choices"][0]
            status, _, raw = await live.post("/v1/chat/completions", {**body, "stream": True})
            deltas = [c["choices"][0]["delta"] for c in sse_payloads(raw)[:-1] if c["choices"]]
            streamed = [
                "".join(d.get(k) or "" for d in deltas) for k in ("reasoning_content", "content")
            ]
            got[path] = (choice["token_ids"], choice["message"]["reasoning_content"],
                         choice["message"]["content"], streamed)  # fmt: skip
    ids, reasoning, content, streamed = got[ckpt]
    tok = load_tokenizer(ckpt)
    end = tok.get_vocab()["</think>"]
    assert content == tok.decode(ids[ids.index(end) + 1 :]) != ""
    assert got[special] == got[ckpt] and streamed == [reasoning, content]


async def test_a_think_tag_in_a_message_does_not_make_a_thinking_chat(ckpt):
    """A ``<think>`` in a user's or system's words encodes to the token a thinking template
    writes, but opens no span: the answer is plain ``content`` and a budget forces nothing.
    A span the generation prompt opens (enable_thinking) or a continued final message opens
    still splits and is bounded."""
    tok = load_tokenizer(ckpt)
    end = tok.get_vocab()["</think>"]
    mention = {"role": "user", "content": "What does the <think> tag do in your output?"}
    system = {"role": "system", "content": "Never output <think> tags."}
    base = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    budget = {"max_thinking_tokens": 2}

    async def chat(live, body):
        status, _, raw = await live.post("/v1/chat/completions", {**base, **body})
        assert status == 200, raw
        choice = orjson.loads(raw)["choices"][0]
        return choice["token_ids"], choice["message"]

    async with running(ckpt) as live:
        for messages in ([mention], [system, {"role": "user", "content": "hi"}]):
            ids, message = await chat(live, {"messages": messages})
            assert message == {"role": "assistant", "content": tok.decode(ids)} and end not in ids
            assert await chat(live, {"messages": messages, **budget}) == (ids, message)
            status, _, raw = await live.post(
                "/v1/chat/completions", {**base, "messages": messages, "stream": True, **budget}
            )
            deltas = [c["choices"][0]["delta"] for c in sse_payloads(raw)[:-1] if c["choices"]]
            assert not any("reasoning_content" in d for d in deltas)
            assert "".join(d.get("content") or "" for d in deltas) == message["content"]
        think = {"chat_template_kwargs": {"enable_thinking": True}}
        prefill = {"role": "assistant", "content": "<think>\nLet me"}
        cont = {"add_generation_prompt": False, "continue_final_message": True}
        for body in ({"messages": [mention], **think}, {"messages": [mention, prefill], **cont}):
            free, _ = await chat(live, body)
            ids, message = await chat(live, {**body, **budget})
            assert free[2] != end and ids[2] == end  # (forced by the budget)
            assert message["reasoning_content"] == tok.decode(ids[:2])
            assert message["content"] == tok.decode(ids[3:])


async def test_a_thinking_budget_on_a_model_without_thinking_tags_changes_nothing(tmp_path):
    """Huginn's tokenizer has neither ``<think>`` nor ``</think>``: ``max_thinking_tokens``
    generates as without it (no prompt can open a span), on chat and completions alike."""
    from rltserve.models.presets import make_model

    huginn = make_model("huginn-tiny", tmp_path / "huginn")
    base = {"max_tokens": 6, "temperature": 0, "seed": 3, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    async with running(huginn) as live:
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
        ):
            got = []
            for extra in ({}, {"max_thinking_tokens": 2, "thinking_interruption": "so"}):
                status, _, raw = await live.post(path, {**base, **body, **extra})
                assert status == 200, raw
                got.append(orjson.loads(raw)["choices"][0]["token_ids"])
            assert got[0] == got[1]


async def test_a_generation_config_penalty_bounds_thinking_too(ckpt, tmp_path):
    """A thinking checkpoint's default repetition penalty (Ouro-Thinking's 1.05) takes a
    budget: its forced ids come after the budget's tokens, penalized or not."""
    model = tmp_path / "m"
    shutil.copytree(ckpt, model)
    (model / "generation_config.json").write_text('{"repetition_penalty": 1.05}')
    end = load_tokenizer(ckpt).get_vocab()["</think>"]
    think = {"enable_thinking": True}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
            "chat_template_kwargs": think}  # fmt: skip
    async with running(model) as live:
        for extra in ({}, {"repetition_penalty": 1}):
            got = []
            for budget in ({}, {"max_thinking_tokens": 2}):
                status, _, raw = await live.post(
                    "/v1/chat/completions", {**body, **extra, **budget}
                )
                assert status == 200, raw
                got.append(orjson.loads(raw)["choices"][0]["token_ids"])
            assert got[0][2] != end and got[1][:3] == [*got[0][:2], end]


async def test_a_stop_on_a_generation_config_end_id_reports_it(ckpt, tmp_path):
    """vLLM adds the generation config's end ids beyond the model's own to stop_token_ids, so a
    choice that ends on one says so in stop_reason (the model's own end ids report null)."""
    model = tmp_path / "m"
    shutil.copytree(ckpt, model)
    (model / "generation_config.json").write_text('{"eos_token_id": [7]}')
    async with running(model) as live:
        for token, reason in ((7, 7), (2, None)):  # (2: <|im_end|>, the model's own)
            body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                    "logit_bias": {str(token): 100}}  # fmt: skip
            status, _, raw = await live.post("/v1/completions", body)
            choice = orjson.loads(raw)["choices"][0]
            assert status == 200 and choice["finish_reason"] == "stop", raw
            assert choice["stop_reason"] == reason


async def test_requests_held_behind_an_update_count_as_waiting(ckpt):
    """An update waits for the running request; requests that arrive meanwhile are held in
    the stage and show in num_requests_waiting (they were in no gauge)."""
    from test_http_harness import metric, wait_for

    async with running(ckpt) as live:
        body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with live.session.post(live.url + "/v1/completions", json=body) as stream:
            await stream.content.readline()  # (it runs)
            update = {"model_path": str(ckpt), "timeout": 120}
            updating = asyncio.create_task(live.post("/v1/update_weights", update))
            await wait_for(lambda: live.state.client.inner._replies, 10)  # (the update waits)
            held = asyncio.create_task(live.post("/v1/completions", {"prompt": PROMPT}))
            await wait_for(lambda: live.state.client.stats.num_waiting == 1, 30)
            text = (await live.get("/metrics"))[2].decode()
            assert metric(text, "rltserve:num_requests_waiting") == 1
        # (leaving the stream aborted it: the update applies, then the held request runs)
        assert (await updating)[0] == 200 and (await held)[0] == 200
