"""Per-request limits from ServerConfig (``http/limits.py``): n, max_tokens (or
max_completion_tokens), stop strings, logprobs and loops past the server's bounds are 400s
naming the field sent; values at a bound are served; requests that ask for no max_tokens or
depth are held to the limit; bad bounds are refused at construction. Auth and slow clients:
``test_http_security.py``."""

from __future__ import annotations

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    error_of,
    running,
    scripted_factory,
    scripted_info,
)
from test_http_security import BODIES

from rltserve.http.config import ServerConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_http_harness import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory)


def scripted(ckpt, **script):
    return scripted_factory(ScriptedStage(scripted_info(ckpt), Script([44, 45, 46], **script)))


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("/v1/completions", {"prompt": [5], "n": 3}, "n", "[1, 2]"),
        ("/v1/completions", {"prompt": [5], "max_tokens": 9}, "max_tokens", "<= 8"),
        ("/v1/chat/completions", {"messages": [], "max_completion_tokens": 9}, None, None),
        # max_completion_tokens wins over max_tokens, and its bound names it.
        (
            "/v1/chat/completions",
            {"max_tokens": 4, "max_completion_tokens": 9},
            "max_completion_tokens",
            "<= 8",
        ),
        ("/v1/completions", {"prompt": [5], "stop": ["a", "b", "c"]}, "stop", "at most 2"),
        ("/v1/completions", {"prompt": [5], "stop": "x" * 11}, "stop", "at most 10"),
        ("/v1/completions", {"prompt": [5], "logprobs": 4}, "logprobs", "[0, 3]"),
        ("/v1/completions", {"prompt": [5], "prompt_logprobs": 4}, "prompt_logprobs", "[0, 3]"),
        ("/v1/chat/completions", {"top_logprobs": 4}, "top_logprobs", "[0, 3]"),
    ],
)
async def test_request_bounds_come_from_the_config(ckpt, path, body, param, fragment):
    limits = {"max_n": 2, "max_tokens_limit": 8, "max_stop": 2, "max_stop_chars": 10}
    async with running(ckpt, client_factory=scripted(ckpt), max_logprobs=3, **limits) as live:
        if path.endswith("chat/completions"):
            body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, **body}
        if param is None:  # an empty conversation is its own 400
            body = {**body, "messages": [{"role": "user", "content": "hi"}]}
            param, fragment = "max_completion_tokens", "<= 8"
        status, _, raw = await live.post(path, body)
        error = error_of(raw)
        assert (status, error["param"]) == (400, param), error
        assert fragment in error["message"], error
        # at the bound itself: served
        ok = {k: v for k, v in body.items() if k != param}
        status, _, raw = await live.post(path, ok)
        assert status == 200, raw


async def test_values_at_the_config_bounds_are_served(ckpt):
    """Every bound is inclusive: n = max_n, max_tokens (or max_completion_tokens) =
    max_tokens_limit, logprobs, prompt_logprobs and top_logprobs = max_logprobs, max_stop stop
    strings, one of them max_stop_chars long."""
    limits = {"max_n": 2, "max_tokens_limit": 8, "max_stop": 2, "max_stop_chars": 10}
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    bodies = {
        "/v1/completions": {"prompt": [5], "n": 2, "max_tokens": 8, "logprobs": 3,
                            "prompt_logprobs": 3, "stop": ["a" * 10, "b"]},
        "/v1/chat/completions": {**chat, "n": 2, "max_completion_tokens": 8,
                                 "top_logprobs": 3, "stop": "c" * 10},
    }  # fmt: skip
    async with running(ckpt, client_factory=scripted(ckpt), max_logprobs=3, **limits) as live:
        for path, body in bodies.items():
            status, _, raw = await live.post(path, body)
            assert status == 200, (path, raw)
            assert len(orjson.loads(raw)["choices"]) == 2


async def test_max_tokens_limit_bounds_requests_that_ask_none(ckpt):
    """Chat clients rarely send max_tokens: the limit is then what a request gets (not the
    rest of the context); a completion's default 16 stays when the limit is above it."""
    for limit, want_chat, want_completion in ((3, 3, 3), (20, 20, 16)):
        async with running(ckpt, client_factory=scripted(ckpt), max_tokens_limit=limit) as live:
            chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
            status, _, raw = await live.post("/v1/chat/completions", chat)
            assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == want_chat
            body = {"prompt": [5], "ignore_eos": True}
            status, _, raw = await live.post("/v1/completions", body)
            usage = orjson.loads(raw)["usage"]
            assert status == 200 and usage["completion_tokens"] == want_completion


async def test_max_loops_limit_refuses_deeper_requests_naming_the_field_sent(ckpt):
    """A request asking more loops than --max-loops-limit (max_loops, Huginn's num_steps, or a
    min_loops above it) is a 400 naming the field as sent; at the limit it is served."""
    async with running(ckpt, client_factory=scripted(ckpt), max_loops_limit=4) as live:
        for field in ("max_loops", "num_steps", "min_loops"):
            status, _, raw = await live.post("/v1/completions", {"prompt": [5], field: 5})
            error = error_of(raw)
            assert (status, error["param"], error["message"]) == (
                400,
                field,
                f"{field}=5: must be <= 4 (this server's max_loops_limit)",
            )
            status, _, raw = await live.post("/v1/completions", {"prompt": [5], field: 4})
            assert status == 200, raw
        chat = {**BODIES["/v1/chat/completions"], "num_steps": 64}
        status, _, raw = await live.post("/v1/chat/completions", chat)
        assert (status, error_of(raw)["param"]) == (400, "num_steps")


async def test_max_loops_limit_bounds_requests_that_ask_none(ckpt):
    """A request asking no depth runs the model's (4 loops here) unless the limit is lower,
    as max_tokens_limit bounds an unasked max_tokens."""
    for limit, want in ((2, 2), (4, None), (None, None)):
        stage = ScriptedStage(scripted_info(ckpt), Script([44, 45]))
        factory = scripted_factory(stage)
        async with running(ckpt, client_factory=factory, max_loops_limit=limit) as live:
            for path, body in BODIES.items():
                assert (await live.post(path, body))[0] == 200
        assert [p.max_loops for p in stage.added_params] == [want, want]


def test_config_rejects_bad_bounds():
    for kwargs, fragment in [
        ({"max_n": 0}, "max_n=0: must be an int in [1, 128]"),
        ({"max_n": 129}, "max_n=129"),
        ({"max_logprobs": 21}, "max_logprobs=21: must be an int in [0, 20]"),
        ({"max_tokens_limit": 0}, "max_tokens_limit=0"),
        ({"idle_timeout_s": 0}, "idle_timeout_s=0"),
        ({"stream_stall_timeout_s": -1.0}, "stream_stall_timeout_s=-1.0"),
        ({"max_header_bytes": 10}, "max_header_bytes=10"),
        ({"metrics_auth": "yes"}, "metrics_auth='yes'"),
    ]:
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            ServerConfig(**kwargs)


async def test_every_stop_string_is_bounded_not_only_the_first(ckpt):
    async with running(ckpt, client_factory=scripted(ckpt), max_stop_chars=10) as live:
        body = {"prompt": [5], "stop": ["a", "x" * 11]}
        status, _, raw = await live.post("/v1/completions", body)
        error = error_of(raw)
        assert (status, error["param"]) == (400, "stop"), error
        assert "a string of 11 characters" in error["message"], error
