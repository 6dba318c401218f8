"""Request fields at the edges: unknown fields (ignored with one warning per name, or 400 with
``strict_fields``), the seed's range, ``min_tokens`` against ``max_tokens`` and ``max_tokens``
against the context. Uses the scripted stage (context of 64 tokens)."""

from __future__ import annotations

import dataclasses
import json
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
    tiny_checkpoint,
)

from rltserve.http.config import ServerConfig
from rltserve.models.tokenizer import load_tokenizer

CHAT = {"messages": [{"role": "user", "content": "x"}]}
EXTRAS = {"store": False, "metadata": {"k": "v"}, "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def factory(ckpt):
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=64), Script([44, 77]))
    return scripted_factory(stage)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


async def test_unknown_fields_are_ignored_with_one_warning_per_name(ckpt, caplog):
    caplog.set_level(logging.WARNING, logger="rltserve.http")
    async with running(ckpt, client_factory=factory(ckpt)) as live:
        body = {"prompt": [5], "max_tokens": 2, "service_tier": "auto", **EXTRAS}
        for _ in range(2):
            status, _, raw = await live.post("/v1/completions", body)
            assert status == 200, raw
            assert orjson.loads(raw)["usage"]["completion_tokens"] == 2
        chat = {
            "messages": [
                {"role": "user", "content": "x", "extra_a": 1},
                {"role": "user", "content": "y", "extra_a": 2},
            ],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True, "extra_b": 1},
            "store": True,
        }
        status, _, _ = await live.post("/v1/chat/completions", chat)
        assert status == 200
        # a known field with a bad value is still a 400
        status, _, raw = await live.post("/v1/completions", {**body, "temperature": 9})
        assert status == 400 and error_of(raw)["param"] == "temperature"
        # a request refused for another reason ignored nothing: its unknown fields go unnamed
        refused = {**body, "temperature": 9, "refused_only": 1}
        status, _, raw = await live.post("/v1/completions", refused)
        assert status == 400 and error_of(raw)["param"] == "temperature"
        parts = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
        status, _, raw = await live.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]}
        )
        assert status == 400, raw
    ignored = sorted(m for m in warnings_of(caplog) if m.startswith("ignoring unknown"))
    # each named with the request that sent it first (its response id)
    names = [("messages[].extra_a", "chatcmpl-test"), ("metadata", "cmpl-test"),
             ("parallel_tool_calls", "cmpl-test"), ("service_tier", "cmpl-test"),
             ("store", "cmpl-test"), ("stream_options.extra_b", "chatcmpl-test")]  # fmt: skip
    assert ignored == [
        f"ignoring unknown request field {n!r} (request {rid}) (--strict-fields rejects it)"
        for n, rid in names
    ]


async def test_unknown_field_warnings_are_bounded(ckpt, caplog):
    # Clients choose the names: 100 distinct (long) ones give 64 named warnings and one more.
    caplog.set_level(logging.WARNING, logger="rltserve.http")
    async with running(ckpt, client_factory=factory(ckpt)) as live:
        for i in range(10):
            extra = {f"x{i}_{j}_" + "y" * 200: 1 for j in range(10)}
            status, _, raw = await live.post("/v1/completions", {"prompt": [5], **extra})
            assert status == 200, raw
    ignored = [m for m in warnings_of(caplog) if m.startswith("ignoring")]
    assert len(ignored) == 65
    assert ignored[-1] == "ignoring further unknown request fields without naming them"
    assert all(len(m) < 180 for m in ignored)  # (names cut at 80 characters)


async def test_strict_fields_rejects_unknown_fields(ckpt):
    async with running(ckpt, client_factory=factory(ckpt), strict_fields=True) as live:
        cases = [
            ("completions", {"prompt": "x", "temprature": 0.5}, "temprature"),
            ("completions", {"prompt": "x", "stream": True, "stream_options": {"usage": True}},
             "stream_options.usage"),
            ("chat/completions", {"messages": [{"role": "user", "text": "x"}]},
             "messages[0].text"),
        ]  # fmt: skip
        for endpoint, body, param in cases:
            status, _, raw = await live.post(f"/v1/{endpoint}", body)
            assert status == 400, raw
            assert error_of(raw)["param"] == param
            assert error_of(raw)["message"] == f"{param}: unknown field"
        status, _, _ = await live.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200


def test_strict_fields_is_a_validated_config_flag():
    assert ServerConfig().strict_fields is False
    with pytest.raises(ValueError, match="strict_fields='yes': must be a bool"):
        ServerConfig(strict_fields="yes")


async def test_seed_range_min_tokens_and_unsupported_chat_fields(ckpt):
    async with running(ckpt, client_factory=factory(ckpt)) as live:
        range_ = "[-9223372036854775808, 9223372036854775807]"
        for seed in (2**70, 2**63, -(2**63) - 1):
            # orjson cannot write such integers; the standard library can, as clients do
            raw_body = json.dumps({"prompt": [5], "seed": seed})
            headers = {"Content-Type": "application/json"}
            async with live.session.post(
                live.url + "/v1/completions", data=raw_body, headers=headers
            ) as r:
                status, raw = r.status, await r.read()
            error = error_of(raw)
            assert (status, error["param"]) == (400, "seed"), raw
            assert error["message"].endswith(f": must be an integer in {range_}"), error
        for seed in (2**63 - 1, -(2**63)):
            body = {"prompt": [5], "seed": seed, "max_tokens": 2, "n": 2}
            assert (await live.post("/v1/completions", body))[0] == 200
        body = {"prompt": [5], "max_tokens": 4, "min_tokens": 5}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 400 and error_of(raw) == {
            "message": "min_tokens=5: must be <= max_tokens (4)",
            "type": "invalid_request_error",
            "param": "min_tokens",
            "code": 400,
        }
        status, _, raw = await live.post("/v1/chat/completions", {**CHAT, "min_tokens": 500})
        assert status == 400 and error_of(raw)["param"] == "min_tokens"
        message = error_of(raw)["message"]
        assert message.startswith("min_tokens=500: must be <= the default max_tokens ("), message
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "min_tokens": 17})
        assert error_of(raw)["message"] == "min_tokens=17: must be <= the default max_tokens (16)"
        for field, value in (
            ("tool_choice", "required"),
            ("response_format", {"type": "grammar"}),
        ):
            status, _, raw = await live.post("/v1/chat/completions", {**CHAT, field: value})
            assert status == 400 and error_of(raw)["param"] == field
        ok = {**CHAT, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
        assert (await live.post("/v1/chat/completions", {**ok, "max_tokens": 2}))[0] == 200
        ok = {**ok, "modalities": ["text"], "max_tokens": 2}
        assert (await live.post("/v1/chat/completions", ok))[0] == 200
        plain = {"prompt": [5], "max_tokens": 2, "response_format": {"type": "text"}}
        assert (await live.post("/v1/completions", plain))[0] == 200


async def test_sampling_fields_reach_the_engine(ckpt):
    """Fields that only the engine reads arrive in the request's SamplingParams: Huginn's
    ``init_state`` and ``exit_criterion`` (a threshold sent, 1 included, is kept; one not sent is
    the criterion's default), ``logit_bias`` (string keys), ``allowed_token_ids``, the seeds of
    n samples (a derived -1 seeds); ``num_steps`` errors name ``num_steps``."""
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=64), Script([44, 77]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5], "max_tokens": 2, "init_state": "zero", "logit_bias": {"7": -2}}
        assert (await live.post("/v1/completions", {**body, "allowed_token_ids": [7, 9]}))[0] == 200
        (params,) = stage.added_params
        assert params.init_state == "zero" and params.logit_bias == {7: -2}
        assert params.allowed_token_ids == [7, 9]
        assert (await live.post("/v1/completions", {"prompt": [5], "max_tokens": 2}))[0] == 200
        assert stage.added_params[-1].init_state is None  # (the model's: Huginn's random)
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "init_state": "one"})
        assert status == 400 and error_of(raw)["param"] == "init_state"
        chat = {**CHAT, "max_tokens": 2, "exit_criterion": "entropy-diff"}
        assert (await live.post("/v1/chat/completions", chat))[0] == 200
        params = stage.added_params[-1]
        assert (params.exit_criterion, params.exit_threshold) == ("entropy-diff", 1e-3)
        body = {"prompt": [5], "exit_criterion": "kl", "exit_threshold": 0.01}
        assert (await live.post("/v1/completions", body))[0] == 200
        assert stage.added_params[-1].exit_threshold == 0.01
        for bad in ("argmax", 5):
            body = {"prompt": [5], "exit_criterion": bad}
            status, _, raw = await live.post("/v1/completions", body)
            assert status == 400 and error_of(raw)["param"] == "exit_criterion", raw
        body = {"prompt": [5], "exit_criterion": "argmax-stability", "exit_threshold": 3}
        assert (await live.post("/v1/completions", body))[0] == 200
        assert stage.added_params[-1].exit_threshold == 3
        status, _, raw = await live.post("/v1/completions", {**body, "exit_threshold": 2.5})
        assert status == 400 and error_of(raw)["param"] == "exit_threshold", raw
        for criterion in ("argmax-stability", "kl"):
            body = {"prompt": [5], "exit_criterion": criterion, "exit_threshold": 1}
            assert (await live.post("/v1/completions", body))[0] == 200
            assert stage.added_params[-1].exit_threshold == 1
        body = {"prompt": [5], "max_tokens": 2, "n": 3, "seed": -2}
        assert (await live.post("/v1/completions", body))[0] == 200
        assert [p.seed for p in stage.added_params[-3:]] == [-2, 2**64 - 1, 0]
        assert (await live.post("/v1/completions", {"prompt": [5], "kv_policy": "full"}))[0] == 200
        assert stage.added_params[-1].kv_policy == "full"
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "kv_policy": "ring:2"})
        assert status == 400 and error_of(raw)["param"] == "kv_policy", raw
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "kv_policy": "shared"})
        assert status == 400 and error_of(raw)["param"] == "kv_policy", raw
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "num_steps": 0})
        error = error_of(raw)
        assert (status, error["param"]) == (400, "num_steps"), error
        assert error["message"] == "num_steps=0: must be >= 1", error
        body = {"prompt": [5], "num_steps": 1, "min_loops": 2}
        status, _, raw = await live.post("/v1/completions", body)
        error = error_of(raw)
        assert (status, error["param"]) == (400, "num_steps"), error
        assert error["message"] == "num_steps=1: must be >= min_loops (2)", error
        # (above the model's cap, checked against the model: named as sent too)
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "num_steps": 10**4})
        error = error_of(raw)
        assert (status, error["param"]) == (400, "num_steps"), error
        assert error["message"].startswith("num_steps=10000: this model allows at most"), error


async def test_thinking_fields_by_vllms_names_and_as_token_ids(ckpt):
    """``thinking_token_budget`` (vLLM's) bounds thinking as ``max_thinking_tokens`` does, and
    errors name it as sent; ``thinking_interruption`` may be token ids, checked against the
    vocabulary. (The prompt ends with ``<think>``, id 3: a thinking span the budget bounds.)"""
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=64), Script([44, 77]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5, 3], "max_tokens": 2, "thinking_token_budget": 1,
                "thinking_interruption": [10, 11]}  # fmt: skip
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200, raw
        params = stage.added_params[-1]
        assert (params.max_thinking_tokens, params.thinking_interruption) == (1, (10, 11))
        assert params.thinking_end_token_ids == (4,)  # (</think>)
        vocab = scripted_info(ckpt).vocab_size
        status, _, raw = await live.post(
            "/v1/completions", {**body, "thinking_interruption": [10, vocab]}
        )
        assert status == 400 and error_of(raw) == {
            "message": f"thinking_interruption: token id {vocab} is outside the vocabulary "
            f"[0, {vocab})",
            "type": "invalid_request_error",
            "param": "thinking_interruption",
            "code": 400,
        }
        # (Penalties count the forced tokens: the engine takes both.)
        status, _, raw = await live.post("/v1/completions", {**body, "repetition_penalty": 1.1})
        assert status == 200, raw
        params = stage.added_params[-1]
        assert (params.max_thinking_tokens, params.repetition_penalty) == (1, 1.1)


async def test_max_tokens_beyond_the_context_is_a_400(ckpt):
    async with running(ckpt, client_factory=factory(ckpt)) as live:
        status, _, raw = await live.post(
            "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 100_000}
        )
        assert status == 400 and error_of(raw) == {
            "message": "This model's maximum context length is 64 tokens. However, you "
            "requested 100003 tokens (3 in the messages, 100000 in the completion). Please "
            "reduce the length of the messages or completion.",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": 400,
        }
        # exactly filling the context is fine
        body = {"prompt": [5, 6, 7], "max_tokens": 61}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 61
        status, _, raw = await live.post("/v1/completions", {**body, "max_tokens": 62})
        assert status == 400 and "requested 65 tokens" in error_of(raw)["message"]
        chat = {**CHAT, "max_completion_tokens": 100}
        status, _, raw = await live.post("/v1/chat/completions", chat)
        assert status == 400 and error_of(raw)["param"] == "max_completion_tokens"
        # completions without max_tokens get 16, or what the context leaves
        for prompt, expected in (([5] * 10, 16), ([5] * 60, 4)):
            status, _, raw = await live.post("/v1/completions", {"prompt": prompt})
            assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == expected
        # ... and with an explicit null the rest of the context, as vLLM's
        body = {"prompt": [5] * 10, "max_tokens": None}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200 and orjson.loads(raw)["usage"]["completion_tokens"] == 54
        # chat without a limit uses the rest of the context
        status, _, raw = await live.post("/v1/chat/completions", CHAT)
        usage = orjson.loads(raw)["usage"]
        assert status == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == 64


async def test_continue_final_message_leaves_the_last_message_open(ckpt):
    """vLLM's ``continue_final_message``: the assistant prefill is rendered without its end of
    turn, in chat and ``/tokenize`` alike (as ``Tokenizer.apply_chat_template`` renders it);
    ``/tokenize`` refuses a request's ``chat_template`` as chat does."""
    prefill = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "It is"}]
    closed = {"messages": prefill, "add_generation_prompt": False}
    opened = {**closed, "continue_final_message": True}
    tokenizer = load_tokenizer(str(ckpt))
    async with running(ckpt, client_factory=factory(ckpt)) as live:
        ids = []
        for body in (closed, opened):
            status, _, raw = await live.post("/tokenize", body)
            assert status == 200, raw
            ids.append(orjson.loads(raw)["tokens"])
        assert ids[1] == tokenizer.apply_chat_template(prefill, False, continue_final_message=True)
        assert tokenizer.decode(ids[1], skip_special_tokens=False).endswith("It is")
        assert len(ids[1]) < len(ids[0]) and ids[0][: len(ids[1])] == ids[1]
        status, _, raw = await live.post("/v1/chat/completions", {**opened, "max_tokens": 2})
        assert status == 200 and orjson.loads(raw)["usage"]["prompt_tokens"] == len(ids[1])
        status, _, raw = await live.post("/tokenize", {**opened, "add_generation_prompt": True})
        assert status == 400 and error_of(raw)["param"] == "continue_final_message"
        status, _, raw = await live.post("/tokenize", {**closed, "chat_template": "{{ 1 }}"})
        assert status == 400 and error_of(raw)["param"] == "chat_template"


async def test_an_assistant_refusal_part_renders_as_its_text(ckpt):
    """OpenAI's assistant ``refusal`` part (a history replayed from an OpenAI model) renders as
    the text it said; another role's refusal part is still not text."""
    said = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "I cannot"}]
    refused = [
        said[0],
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot"}]},
    ]
    async with running(ckpt, client_factory=factory(ckpt)) as live:
        tokens = []
        for messages in (said, refused):
            status, _, raw = await live.post("/tokenize", {"messages": messages})
            assert status == 200, raw
            tokens.append(orjson.loads(raw)["tokens"])
        assert tokens[0] == tokens[1]
        user = [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
        status, _, raw = await live.post("/tokenize", {"messages": user})
        assert (status, error_of(raw)["param"]) == (400, "messages[0].content[0]")


async def test_left_out_sampling_fields_take_the_generation_config(ckpt, tmp_path):
    """vLLM's ``--generation-config auto``: temperature, top_p, top_k, min_p,
    repetition_penalty and chat's max_tokens come from the checkpoint's
    generation_config.json when the request leaves them out; given ones win; ``vllm`` ignores
    the file; a file with a bad value stops the server from starting (health says why)."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(ckpt, model)
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3}
    (model / "generation_config.json").write_text(json.dumps(config))
    stage = ScriptedStage(scripted_info(model, max_model_len=64), Script([44, 77]))
    async with running(model, client_factory=scripted_factory(stage)) as live:
        assert (await live.post("/v1/chat/completions", CHAT))[0] == 200
        given = {"prompt": [5], "temperature": 0.0, "top_k": 5, "repetition_penalty": 1.2}
        assert (await live.post("/v1/completions", given))[0] == 200
        chat, completion = stage.added_params
        assert (chat.temperature, chat.top_p, chat.top_k, chat.max_tokens) == (0.6, 0.9, 20, 3)
        assert (chat.min_p, chat.repetition_penalty) == (0.0, 1.0)
        assert (completion.temperature, completion.top_k, completion.top_p) == (0.0, 5, 0.9)
        assert completion.repetition_penalty == 1.2 and completion.max_tokens == 16
    stage = ScriptedStage(scripted_info(model, max_model_len=64), Script([44, 77]))
    async with running(
        model, client_factory=scripted_factory(stage), generation_config="vllm"
    ) as live:
        assert (await live.post("/v1/chat/completions", CHAT))[0] == 200
        (chat,) = stage.added_params
        assert (chat.temperature, chat.top_p, chat.top_k) == (1.0, 1.0, -1)
        assert chat.max_tokens > 3  # the rest of the context
    (model / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    async with running(model, client_factory=factory(model), wait=False) as live:
        await live.state.ready.wait()
        assert "generation_config.json: top_p=0: must be in (0, 1]" in live.state.load_error
    with pytest.raises(ValueError, match="generation_config='nowhere': must be 'auto', 'vllm'"):
        ServerConfig(generation_config="nowhere")


async def test_a_request_may_name_the_servers_own_kv_policy(ckpt):
    """On a ring:2 server a request's kv_policy "ring:2" is the server's own (a no-op), as
    last_exited is on a last_exited server; any other is refused before the engine sees it."""
    info = dataclasses.replace(scripted_info(ckpt, max_model_len=64), kv_policy="ring:2")
    stage = ScriptedStage(info, Script([44, 77]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5], "max_tokens": 2, "kv_policy": "ring:2"}
        assert (await live.post("/v1/completions", body))[0] == 200
        assert stage.added_params[-1].kv_policy == "ring:2"
        for other in ("ring:3", "shared", "full"):
            status, _, raw = await live.post("/v1/completions", {**body, "kv_policy": other})
            error = error_of(raw)
            assert (status, error["param"]) == (400, "kv_policy"), raw
            assert error["message"].startswith(
                f"kv_policy='{other}': this engine runs kv_policy='ring:2', whose planes"
            )
        assert len(stage.added_params) == 1
