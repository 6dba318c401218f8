"""Request fields that shape tokens: stop strings and special tokens in the text,
``min_tokens`` against stop strings, ``truncate_prompt_tokens``, and repeated or out-of-vocab
token ids. Uses the scripted stage (context of 64 tokens)."""

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
    tiny_checkpoint,
)

from rltserve.models.tokenizer import load_tokenizer

CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


async def test_stop_string_and_special_token_fields_shape_the_text(ckpt):
    """vLLM's ``include_stop_str_in_output`` and ``skip_special_tokens`` reach the text, in
    both endpoints' bodies and streams alike."""
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=64), Script([44, 77]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        tokenizer = load_tokenizer(str(ckpt))
        first, second = tokenizer.decode([44]), tokenizer.decode([77])
        assert second and second not in first
        body = {"prompt": [5], "max_tokens": 4, "stop": [second], "temperature": 0.0}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200 and orjson.loads(raw)["choices"][0]["text"] == first
        kept = {**body, "include_stop_str_in_output": True}
        status, _, raw = await live.post("/v1/completions", kept)
        assert orjson.loads(raw)["choices"][0]["text"] == first + second
        params = stage.added_params[-1]
        assert params.include_stop_str_in_output and params.skip_special_tokens
        plain = {"prompt": [5], "max_tokens": 1, "skip_special_tokens": False}
        assert (await live.post("/v1/completions", plain))[0] == 200
        assert stage.added_params[-1].skip_special_tokens is False
        status, _, raw = await live.post("/v1/completions", {**plain, "skip_special_tokens": 1})
        assert status == 400 and error_of(raw)["param"] == "skip_special_tokens", raw


async def test_min_tokens_holds_off_stop_strings(ckpt):
    """``min_tokens``: a stop string in the text of the first min_tokens tokens does not end
    the choice, as in the engine; the first match after them does."""
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=64), Script([44, 77]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        tokenizer = load_tokenizer(str(ckpt))
        first, second = tokenizer.decode([44]), tokenizer.decode([77])
        body = {"prompt": [5], "max_tokens": 4, "min_tokens": 3, "stop": [second]}
        status, _, raw = await live.post("/v1/completions", body)
        choice = orjson.loads(raw)["choices"][0]
        assert status == 200, raw
        assert (choice["text"], choice["finish_reason"]) == (first + second + first, "stop")


async def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(ckpt):
    """vLLM's ``truncate_prompt_tokens``: k keeps the prompt's last k tokens (text, ids and
    chat alike, before the context check: a prompt too long for the context runs), -1 as many
    as leave room for a token; usage counts what ran, echo shows it; 0, -2 and a k above the
    context are 400s naming the field."""
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=64), Script([44, 77]))
    long_ids = list(range(3, 103))  # 100 tokens: beyond the context of 64
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": long_ids, "max_tokens": 2})
        assert status == 400 and error_of(raw)["param"] == "prompt"
        body = {"prompt": long_ids, "max_tokens": 2, "truncate_prompt_tokens": 10}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200 and orjson.loads(raw)["usage"]["prompt_tokens"] == 10
        assert stage.added_prompts[-1] == long_ids[-10:]
        assert stage.added_params[-1].truncate_prompt_tokens == 10
        body = {"prompt": long_ids, "truncate_prompt_tokens": -1}
        status, _, raw = await live.post("/v1/completions", body)
        usage = orjson.loads(raw)["usage"]
        assert status == 200 and (usage["prompt_tokens"], usage["completion_tokens"]) == (63, 1)
        assert stage.added_prompts[-1] == long_ids[-63:]
        # a short prompt is left whole
        body = {"prompt": [5, 6], "max_tokens": 1, "truncate_prompt_tokens": 10}
        assert (await live.post("/v1/completions", body))[0] == 200
        assert stage.added_prompts[-1] == [5, 6]
        # text far beyond what the context could hold, echoed as what ran
        tokenizer = load_tokenizer(ckpt)
        text = "hello world " * 2000
        body = {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 5, "echo": True}
        status, _, raw = await live.post("/v1/completions", body)
        kept = tokenizer.encode(text)[-5:]
        assert status == 200 and stage.added_prompts[-1] == kept
        assert orjson.loads(raw)["choices"][0]["text"].startswith(tokenizer.decode(kept))
        chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
        status, _, raw = await live.post("/v1/chat/completions", chat)
        assert status == 400 and error_of(raw)["param"] == "messages"
        status, _, raw = await live.post(
            "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 20}
        )
        assert status == 200 and orjson.loads(raw)["usage"]["prompt_tokens"] == 20
        assert len(stage.added_prompts[-1]) == 20
        n = len(stage.added_prompts)
        for bad, words in ((0, "must be >= 1"), (-2, "must be >= 1"), (65, "greater than")):
            body = {"prompt": long_ids, "truncate_prompt_tokens": bad}
            status, _, raw = await live.post("/v1/completions", body)
            error = error_of(raw)
            assert (status, error["param"]) == (400, "truncate_prompt_tokens"), error
            assert words in error["message"], error
        status, _, raw = await live.post("/v1/completions", {**body, "truncate_prompt_tokens": "5"})
        assert (status, error_of(raw)["param"]) == (400, "truncate_prompt_tokens")
        assert len(stage.added_prompts) == n  # (nothing reached the engine)


async def test_repeated_token_ids_are_sent_once_and_stop_ids_outside_the_vocab_dropped(ckpt):
    """Repeats in ``stop_token_ids`` and ``allowed_token_ids`` reach the engine once each;
    a stop id outside the vocabulary (it never comes) is dropped as vLLM would take it, an
    allowed one is a 400 as vLLM's."""
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=64), Script([44, 77]))
    vocab = scripted_info(ckpt).vocab_size
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5], "max_tokens": 2, "n": 2,
                "stop_token_ids": [9, vocab + 3, 7, 9, 7] * 1000,
                "allowed_token_ids": [44, 77, 44] * 1000}  # fmt: skip
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200, raw
        assert [(p.stop_token_ids, p.allowed_token_ids) for p in stage.added_params] == [
            ([9, 7], [44, 77])
        ] * 2
        for chat in (False, True):
            path, prompt = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", body)
            status, _, raw = await live.post(path, {**prompt, "allowed_token_ids": [44, vocab]})
            assert status == 400 and error_of(raw) == {
                "message": f"allowed_token_ids: token id {vocab} is outside the vocabulary "
                f"[0, {vocab})",
                "type": "invalid_request_error",
                "param": "allowed_token_ids",
                "code": 400,
            }
        assert len(stage.added_params) == 2
