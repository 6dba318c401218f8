"""Every error response: OpenAI-style bodies with the right status, never a 500 for bad input.
Uses the scripted stage, so each case is cheap and deterministic. Bodies and routes the server
cannot read: ``test_http_body.py``."""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    error_of,
    metric,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    stage_for,
    tiny_checkpoint,
    wait_for,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


BAD_REQUESTS = [
    # (endpoint, body, param, message fragment)
    ("completions", {"prompt": "x", "temperature": 5}, "temperature", "[0, 2]"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
    ("completions", {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens", ">= 1"),
    ("completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens", "an integer"),
    ("completions", {"prompt": "x", "n": 0}, "n", "[1, 128]"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ("completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
    ("completions", {"prompt": "x", "stop": [1]}, "stop", "a string or an array of strings"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "stream=true"),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "only with echo=true"),
    ("completions", {"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 2}, "min_tokens",
     "must be 0 with max_tokens=0"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 21}, "logprobs", "[0, 20]"),
    ("completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ("completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
    ("completions", {"prompt": "x", "best_of": 3}, "best_of", "best_of == n"),
    # vLLM's grammars and beams: refused, not ignored (the output would look valid)
    ("completions", {"prompt": "x", "guided_grammar": "root ::= x"}, "guided_grammar",
     "not supported"),
    ("completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search", "not supported"),
    ("completions", {"prompt": "x", "guided_json": 0}, "guided_json", "JSON schema"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "structured_outputs": {"grammar": "x"}}, "structured_outputs", "grammars are not supported"),
    ("completions", {"prompt": "x", "logit_bias": {"a": 1.0}}, "logit_bias", "not a token id"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("completions", {"prompt": "x", "logit_bias": {"512": 1}}, "logit_bias",
     "outside the vocabulary"),
    ("completions", {"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias", "object of numbers"),
    ("completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "at least one"),
    ("completions", {"prompt": "x", "allowed_token_ids": [3, 512]}, "allowed_token_ids",
     "outside the vocabulary"),
    ("completions", {"prompt": "x", "max_loops": 9}, "max_loops", "at most 8"),
    ("completions", {"prompt": "x", "min_loops": 3, "max_loops": 2}, "max_loops", "min_loops"),
    ("completions", {"prompt": "x", "exit_threshold": 0}, "exit_threshold", "> 0"),
    ("completions", {"prompt": "x", "num_steps": 2, "max_loops": 3}, "num_steps", "alias"),
    ("completions", {"prompt": []}, "prompt", "must not be empty"),
    ("completions", {"prompt": [[]]}, "prompt", "at least one token"),
    ("completions", {"prompt": [1, 512]}, "prompt", "outside the vocabulary"),
    ("completions", {"prompt": "x", "max_thinking_tokens": 2, "thinking_end_token_ids": [512]},
     "thinking_end_token_ids", "outside the vocabulary"),
    ("completions", {"prompt": [1] * 64}, "prompt",
     "This model's maximum context length is 64 tokens. However, your request has 64 input "
     "tokens, which leave no room for the completion."),
    ("completions", {"prompt": True}, "prompt", "must be a string"),
    ("completions", {"max_tokens": 3}, "prompt", "is required"),
    ("chat/completions", {"messages": []}, "messages", "must not be empty"),
    ("completions", {"prompt": "x", "priority": 2**63}, "priority", "an integer in"),
    # JSON integers beyond 64 bits: quoted as sent, and the message says why
    ("completions", {"prompt": "x", "max_tokens": 10**30}, "max_tokens",
     "max_tokens=1000000000000000000000000000000 (beyond 64-bit integers): must be an integer"),
    ("completions", {"prompt": "x", "seed": 2**64}, "seed",
     "seed=18446744073709551616 (beyond 64-bit integers): must be an integer in"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "priority": 99999999999999999999}, "priority",
     "priority=99999999999999999999 (beyond 64-bit integers): must be an integer in "
     "[-9223372036854775808, 9223372036854775807]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "priority": "1"},
     "priority", "must be an integer in"),
    ("completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens",
     "max_tokens=1.5: must be an integer"),
    # A client's own Jinja template would run on the server.
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs.chat_template", "not a template variable"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "chat_template": "{{ 1 }}"}, "chat_template", "not accepted from requests"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs.tokenize", "not a template variable"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
     "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
    ("chat/completions", {"messages": [{"role": " ", "content": "x"}]}, "messages[0].role",
     "must not be empty"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "only text parts"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "a text part's text is required"),
    ("chat/completions", {"messages": [{"role": "system", "content": "x"}, {"role": "user"}]},
     "messages[1].content", "required for a user message"),
    # OpenAI's 400 (an empty turn), for every role
    ("chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages[0].content",
     "must not be an empty array"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"},
                                       {"role": "assistant", "content": []}]},
     "messages[1].content", "must not be an empty array"),
    # vLLM's 400: a new assistant header or the final message left open, not both
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "not with add_generation_prompt=true"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "continue_final_message": True},
     "continue_final_message", "send add_generation_prompt=false"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 400}]}, "messages",
     "maximum context length"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", "requires logprobs=true"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function"}], "tool_choice": "required"},
     "tools[0].function", "required"),
    ("chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]},
     "messages[1].tool_calls[0]", 'must be {"id": ..., "type": "function"'),
    ("chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f", "content": "42"}]},
     "messages[1].function_call", "function calls are not supported"),
    ("completions", {"prompt": "x", "response_format": {"type": "json_schema"}},
     "response_format", "json_schema: must be an object"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "modalities": ["text", "audio"]}, "modalities", 'only ["text"]'),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "audio": {"voice": "alloy", "format": "wav"}}, "audio", "not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "web_search_options": {}}, "web_search_options", "not supported"),
]  # fmt: skip


async def test_bad_requests_name_the_field(ckpt):
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        for endpoint, body, param, fragment in BAD_REQUESTS:
            status, _, raw = await live.post(f"/v1/{endpoint}", body)
            error = error_of(raw)
            assert (status, error["param"]) == (400, param), (body, error)
            assert fragment in error["message"], (body, error)
            assert error["type"] == "invalid_request_error" and error["code"] == 400
        # the server still serves after all that
        status, _, _ = await live.post("/v1/completions", {"prompt": "x"})
        assert status == 200


async def test_the_engines_refusals_are_400s_in_its_own_words(ckpt):
    """Checks only the engine can make (its model, its pool) are 400s naming the field. Here
    the pool (8 blocks of 4 on ouro-tiny's 4 planes) holds 9 tokens, far below the model's
    context: the prompt is told that, as offline, not that the model is too short."""
    async with running(ckpt, engine={"num_blocks": 8, "block_size": 4}) as live:
        for body, param, message in (
            (
                {"prompt": [5] * 9},
                "prompt",
                "This model's maximum context length is 9 tokens. However, your request has "
                "9 input tokens, which leave no room for the completion. Please reduce the "
                "length of the input messages. (This limit is what the server's KV cache "
                "holds.)",
            ),
            (
                {"prompt": [5], "init_state": "random"},
                "init_state",
                "init_state='random': this model has no recurrent initial state to set (it "
                "starts from the embedding); init_state is for Huginn",
            ),
            (
                {"prompt": [5], "exit_criterion": "kl"},
                "exit_criterion",
                "exit_criterion='kl': this model's tokens exit by its learned gate "
                "(exit_threshold); the zero-shot criteria are for models without one "
                "(Huginn, Nanbeige)",
            ),
        ):
            status, _, raw = await live.post("/v1/completions", {**body, "max_tokens": 1})
            assert (status, error_of(raw)) == (
                400,
                {"message": message, "type": "invalid_request_error", "param": param, "code": 400},
            ), body


async def test_string_prompt_without_tokenizer(ckpt, tmp_path):
    # A checkpoint directory without tokenizer files serves token ids only.
    stage = ScriptedStage(scripted_info(tmp_path), Script([44]))
    async with running(tmp_path, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": "hello"})
        assert status == 400 and "no tokenizer" in error_of(raw)["message"]
        chat = {"messages": [{"role": "user", "content": "x"}]}
        status, _, raw = await live.post("/v1/chat/completions", chat)
        assert status == 400 and error_of(raw)["param"] == "messages"
        status, _, raw = await live.post("/v1/completions", {"prompt": [3, 4]})
        assert status == 200
        choice = orjson.loads(raw)["choices"][0]
        assert choice["text"] == "" and choice["finish_reason"] == "length"


async def test_api_key(ckpt):
    factory = scripted_factory(stage_for(ckpt))
    async with running(ckpt, client_factory=factory, api_key="sesame") as live:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            status, resp_headers, raw = await live.post(
                "/v1/completions", {"prompt": "x"}, headers=headers
            )
            assert status == 401 and resp_headers["WWW-Authenticate"] == "Bearer"
            assert error_of(raw)["type"] == "authentication_error"
        assert (await live.get("/v1/models"))[0] == 401
        status, _, raw = await live.get("/health")  # health stays open
        assert status == 200 and orjson.loads(raw) == {"status": "ok"}
        for path in ("/metrics", "/metrics/"):  # so do the metrics (vLLM's answers both)
            status, _, raw = await live.get(path)
            assert status == 200 and b"rltserve:num_requests_running" in raw, path
        ok = {"Authorization": "Bearer sesame"}
        status, _, _ = await live.post("/v1/completions", {"prompt": "x"}, headers=ok)
        assert status == 200


async def test_overload_gives_503_with_retry_after(ckpt):
    hold = threading.Event()
    stage = stage_for(ckpt, hold=hold)
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, max_concurrent=2, max_queued=1) as live:
        path, gate = "/v1/completions", live.state.gate
        running_ = asyncio.create_task(live.post(path, {"prompt": "x", "n": 2}))
        await wait_for(lambda: len(stage.added) == 2)
        queued = asyncio.create_task(live.post(path, {"prompt": "x", "stream": True}))
        await wait_for(lambda: gate.num_queued == 1)
        status, headers, raw = await live.post(path, {"prompt": "x"})
        assert status == 503 and headers["Retry-After"] == "1"
        assert error_of(raw)["type"] == "unavailable_error"
        status, _, raw = await live.post(path, {"prompt": "x", "n": 3})  # can never fit
        assert status == 400 and error_of(raw)["param"] == "n"
        status, _, raw = await live.post(path, {"prompt": ["x", "y", "z"]})  # a batch: prompt
        error = error_of(raw)
        assert (status, error["param"]) == (400, "prompt"), error
        assert error["message"].startswith("prompt: 3 prompts x n = 3 sequences exceed"), error
        hold.set()
        assert (await running_)[0] == 200
        status, _, raw = await queued
        assert status == 200 and sse_payloads(raw)[-1] == "[DONE]"
        assert gate.in_use == 0 and gate.num_queued == 0


async def test_queued_request_that_disconnects_leaves_the_queue(ckpt):
    hold = threading.Event()
    stage = stage_for(ckpt, hold=hold)
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, max_concurrent=1, max_queued=4) as live:
        gate = live.state.gate
        first = asyncio.create_task(live.post("/v1/completions", {"prompt": "x"}))
        await wait_for(lambda: len(stage.added) == 1)
        waiter = asyncio.create_task(live.post("/v1/completions", {"prompt": "x"}))
        await wait_for(lambda: gate.num_queued == 1)
        waiter.cancel()
        await wait_for(lambda: gate.num_queued == 0)
        hold.set()
        assert (await first)[0] == 200
        assert len(stage.added) == 1 and gate.in_use == 0


async def test_engine_rejection_is_a_400(ckpt):
    stage = stage_for(ckpt, reject="max_tokens=40: the KV pool is too small")
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        for stream in (False, True):
            body = {"prompt": "x", "max_tokens": 40, "stream": stream}
            status, _, raw = await live.post("/v1/completions", body)
            assert status == 400, raw  # nothing was streamed yet: a real status
            assert error_of(raw)["param"] == "max_tokens"
        _, _, raw = await live.get("/metrics")
        text = raw.decode()
        # refused, never finished (the series is there from the start: 0) ...
        assert (
            'request_success_total{engine="0",finished_reason="error",model_name="tiny"} 0.0'
            in text
        )
        for name in ("prompt_tokens_total", "request_prompt_tokens_count"):  # ... nor started
            assert metric(text, f"rltserve:{name}") == 0, name
        assert metric(text, "rltserve:request_queue_time_seconds_count") == 0


async def test_a_request_aborted_before_any_update_counts_a_start_and_an_abort(ckpt):
    hold = threading.Event()
    stage = stage_for(ckpt, hold=hold)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        request = asyncio.create_task(live.post("/v1/completions", {"prompt": [5, 6, 7]}))
        await wait_for(lambda: len(stage.added) == 1)
        request.cancel()  # the client goes away before the engine sent anything
        await wait_for(lambda: len(stage.aborted) == 1)
        text = (await live.get("/metrics"))[2].decode()
        assert metric(text, "rltserve:prompt_tokens_total") == 3
        assert (
            'request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 1.0'
            in text
        )
        hold.set()


async def test_stage_death_mid_stream(ckpt):
    stage = stage_for(ckpt, interval_s=0.01)
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, stage_restarts=0) as live:
        body = {"prompt": [5], "max_tokens": 63, "stream": True}
        async with live.stream("/v1/completions", body) as r:
            first = await r.content.readuntil(b"\n\n")
            stage.kill()
            events = sse_payloads(first + await r.content.read())
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == 503 and "stage died" in error["message"]
        assert (await live.get("/health"))[0] == 503
        status, _, raw = await live.post("/v1/completions", {"prompt": "x"})
        assert status == 503 and "not running" in error_of(raw)["message"]


async def test_engine_failure_is_a_500_or_an_error_event(ckpt):
    # Not a rejection: the engine failed while running the request.
    failing = stage_for(ckpt, fail="RuntimeError: step failed", fail_after=0)
    async with running(ckpt, client_factory=scripted_factory(failing)) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": "x", "max_tokens": 5})
        assert status == 500, raw
        assert error_of(raw)["message"] == "RuntimeError: step failed"
        assert error_of(raw)["code"] == 500
        assert (await live.get("/health"))[0] == 200  # the engine keeps serving
    gate = threading.Event()
    late = stage_for(ckpt, fail="RuntimeError: step failed", fail_after=2, fail_gate=gate)
    async with running(ckpt, client_factory=scripted_factory(late)) as live:
        body = {"prompt": "x", "max_tokens": 5, "stream": True}
        async with live.stream("/v1/completions", body) as r:
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
            assert r.status == 200  # the stream has started: the error becomes an event
            gate.set()
            events = sse_payloads(first + await asyncio.wait_for(r.content.read(), 10))
        assert events[-1] == "[DONE]"
        assert [e["choices"][0]["text"] for e in events[:2]] == ["H", "i"]
        assert events[-2]["error"]["code"] == 500
        assert events[-2]["error"]["message"] == "RuntimeError: step failed"


async def test_continuous_usage_stats_count_up(ckpt):
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True, "stream_options": options}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200
        events = sse_payloads(raw)[:-1]
        with_text = [e for e in events if e["choices"]]
        assert [e["usage"]["completion_tokens"] for e in with_text] == [1, 2, 3, 4]
        assert all(e["usage"]["prompt_tokens"] == 3 for e in events)
        assert all(
            e["usage"]["total_tokens"] == 3 + e["usage"]["completion_tokens"] for e in events
        )
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
        body["stream_options"] = {"include_usage": True}  # without: only the final chunk
        events = sse_payloads((await live.post("/v1/completions", body))[2])[:-1]
        assert [e.get("usage") is not None for e in events] == [False] * 4 + [True]


async def test_detokenize_checks_the_vocabulary(ckpt):
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        status, _, raw = await live.post("/detokenize", {"tokens": [44, 512]})
        assert status == 400
        error = error_of(raw)
        assert error["param"] == "tokens"
        assert error["message"] == "tokens: token id 512 is outside the vocabulary [0, 512)"
        status, _, raw = await live.post("/detokenize", {"tokens": [44, 77]})
        assert status == 200 and orjson.loads(raw)["prompt"] == "Hi"


async def test_api_key_scheme_is_case_insensitive_and_a_missing_key_is_named(ckpt):
    factory = scripted_factory(stage_for(ckpt))
    async with running(ckpt, client_factory=factory, api_key="sesame") as live:
        status, headers, raw = await live.post("/v1/completions", {"prompt": "x"})
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        assert error_of(raw)["message"] == "Missing API key: send 'Authorization: Bearer <key>'"
        for auth in ("Basic sesame", "Bearer sesame2"):
            status, _, raw = await live.post(
                "/v1/completions", {"prompt": "x"}, headers={"Authorization": auth}
            )
            assert status == 401 and error_of(raw)["message"] == "Invalid API Key", auth
        # RFC 9110: the scheme is case-insensitive; blanks around the key do not count
        for auth in ("bearer sesame", "BEARER sesame", "Bearer  sesame"):
            status, _, raw = await live.post(
                "/v1/completions", {"prompt": "x"}, headers={"Authorization": auth}
            )
            assert status == 200, (auth, raw)


async def test_an_engine_failure_without_a_message_still_says_what_failed(ckpt):
    failing = stage_for(ckpt, fail="", fail_after=0)
    async with running(ckpt, client_factory=scripted_factory(failing)) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": "x", "max_tokens": 5})
        assert (status, error_of(raw)["message"]) == (500, "the engine failed"), raw
