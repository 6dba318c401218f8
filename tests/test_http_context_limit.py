"""The context-limit refusals in vLLM's words: the messages themselves, then the server's
refusals end to end (a pool-lowered context, a prompt that fills the context, a default
max_tokens held to what the pool holds)."""

from __future__ import annotations

import orjson
import pytest
from test_http_harness import error_of, running, tiny_checkpoint

from rltserve.http.context_limit import chars_too_many, prompt_too_long, tokens_too_many

HEAD = "This model's maximum context length is 64 tokens. "
NOTE = " (This limit is what the server's KV cache holds.)"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def test_a_prompt_past_the_context_in_vllms_words():
    assert prompt_too_long(70, 64, False) == (
        HEAD + "However, your request has 70 input tokens. Please reduce the length of the "
        "input messages."
    )
    assert prompt_too_long(64, 64, True) == (
        HEAD + "However, your request has 64 input tokens, which leave no room for the "
        "completion. Please reduce the length of the input messages." + NOTE
    )


def test_max_tokens_past_the_context_in_vllms_words():
    assert tokens_too_many(10, 60, 64, False) == (
        HEAD + "However, you requested 70 tokens (10 in the messages, 60 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    assert tokens_too_many(10, 60, 64, True).endswith("or completion." + NOTE)


def test_a_text_past_the_character_bound_in_vllms_words():
    assert chars_too_many(1000, 64, 13, True) == (
        HEAD + "However, your request has 1000 input characters, more than 832 (no token covers "
        "more than 13). Please reduce the length of the input messages." + NOTE
    )


async def test_a_context_the_pool_lowered_is_refused_in_vllms_words_and_says_so(ckpt):
    """The phrase agent frameworks look for ("maximum context length") in every context
    overflow, the pool's part said for the client (the operator's advice is the log's)."""
    note = " (This limit is what the server's KV cache holds.)"
    async with running(ckpt, engine={"num_blocks": 8, "block_size": 4}) as live:
        chat = {"messages": [{"role": "user", "content": "x " * 40}]}
        status, _, raw = await live.post("/v1/chat/completions", chat)
        error = error_of(raw)
        assert (status, error["param"], error["code"]) == (400, "messages", 400)
        assert error["message"].startswith(
            "This model's maximum context length is 9 tokens. However, your request has "
        )
        assert error["message"].endswith("Please reduce the length of the input messages." + note)
        status, _, raw = await live.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 20})
        assert (status, error_of(raw)["param"], error_of(raw)["message"]) == (
            400,
            "max_tokens",
            "This model's maximum context length is 9 tokens. However, you requested 22 tokens "
            "(2 in the messages, 20 in the completion). Please reduce the length of the "
            "messages or completion." + note,
        )


async def test_a_prompt_that_fills_the_context_is_scored_alone(ckpt):
    """echo with max_tokens=0 (lm-eval's loglikelihood) of a prompt of max_model_len tokens
    is scored, as vLLM's check (prompt + max_tokens) allows: the engine's one dropped token
    takes no place in the context. Its logprobs extend those of its prefix. More is refused,
    and so is the whole context where the pool holds only the context less one position."""
    prompt = [5, 9, 14, 3, 7, 11, 2, 8, 6, 4, 13, 10, 12, 15, 1, 16]
    score = {"echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    async with running(ckpt, engine={"max_model_len": 16}) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": prompt, **score})
        assert status == 200, raw
        body = orjson.loads(raw)
        whole = body["choices"][0]["logprobs"]["token_logprobs"]
        assert (len(whole), whole[0], body["usage"]["completion_tokens"]) == (16, None, 0)
        status, _, raw = await live.post("/v1/completions", {"prompt": prompt[:15], **score})
        assert orjson.loads(raw)["choices"][0]["logprobs"]["token_logprobs"] == whole[:15]
        for body, message in (
            (
                {"prompt": [*prompt, 5], **score},
                "This model's maximum context length is 16 tokens. However, your request has "
                "17 input tokens. Please reduce the length of the input messages.",
            ),
            (
                {"prompt": prompt, **score, "max_tokens": 1},
                "This model's maximum context length is 16 tokens. However, your request has "
                "16 input tokens, which leave no room for the completion. Please reduce the "
                "length of the input messages.",
            ),
        ):
            status, _, raw = await live.post("/v1/completions", body)
            assert (status, error_of(raw)["message"]) == (400, message)
    async with running(ckpt, engine={"num_blocks": 8, "block_size": 4}) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": [5] * 9, **score})
        assert (status, error_of(raw)["message"]) == (
            400,
            "This model's maximum context length is 9 tokens. However, your request has 9 "
            "input tokens, which leave no room for the completion. Please reduce the length of "
            "the input messages. (This limit is what the server's KV cache holds.)",
        )


async def test_a_default_max_tokens_is_held_to_what_the_kv_pool_holds_at_its_depth(ckpt):
    """A request without max_tokens whose default (chat: the rest of the context; completions:
    16) the whole KV pool cannot hold at the depth it asks for runs to what the pool holds for
    it alone there and ends "length"; one that sent such a max_tokens keeps the engine's 400,
    and so does a prompt the pool cannot hold at that depth, saying the server chose
    max_tokens. Either names the depth field as sent (max_loops, or num_steps) as its param."""
    engine = {"num_blocks": 64, "block_size": 4, "max_model_len": 64}  # 64 tokens at 4 loops
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_loops": 8, "ignore_eos": True}
    # 8 planes at 8 loops: 8 blocks of 4 a plane hold 32 positions, 33 with the last token's.
    async with running(ckpt, engine=engine) as live:
        assert live.state.require_frontend().info.context_alone(8) == 33
        status, _, raw = await live.post("/v1/chat/completions", chat)
        body = orjson.loads(raw)
        assert (status, body["choices"][0]["finish_reason"]) == (200, "length"), raw
        usage = body["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 33
        body = {"prompt": list(range(1, 21)), "max_loops": 8, "ignore_eos": True}
        status, _, raw = await live.post("/v1/completions", body)
        assert (status, orjson.loads(raw)["usage"]["completion_tokens"]) == (200, 13)
        status, _, raw = await live.post("/v1/chat/completions", {**chat, "max_tokens": 50})
        assert (status, error_of(raw)["param"]) == (400, "max_loops")
        assert error_of(raw)["message"].endswith(
            "but the pool has 64; lower max_tokens or max_loops, or raise num_blocks"
        )
        long = {"prompt": list(range(1, 41)), "max_loops": 8}
        status, _, raw = await live.post("/v1/completions", long)
        assert (status, error_of(raw)["param"]) == (400, "max_loops")
        assert error_of(raw)["message"] == (
            "the request needs 80 KV blocks (40 tokens of prompt and output on 8 KV planes, for "
            "8 loops) but the pool has 64 (max_tokens not set: the prompt alone is more than the "
            "pool holds at this depth); lower max_loops, or raise num_blocks"
        )
        steps = {**long, "max_loops": None, "num_steps": 8}
        for sent in ({}, {"max_tokens": 10}):
            status, _, raw = await live.post("/v1/completions", {**steps, **sent})
            assert (status, error_of(raw)["param"]) == (400, "num_steps"), raw


async def test_a_refused_prompt_of_a_batch_names_its_index(ckpt):
    """A scoring client's batch of 64 prompts is refused for one of them: the message names
    which (as the offline ``LLM``'s), after vLLM's words; a request of one prompt says none."""
    head = "This model's maximum context length is 16 tokens. However, "
    score = {"echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0}
    async with running(ckpt, engine={"max_model_len": 16}) as live:
        cases = (
            ([[5, 6], [7] * 17, [8]], "your request has 17 input tokens.", 1),
            ([[5, 6], [8], [7] * 16], "your request has 16 input tokens, which leave no", 2),
            (["Hi", "x " * 40], "your request has ", 1),
            ([[5, 6], [8, 600]], "prompt: token id 600 is outside the vocabulary", 1),
            ([[8, 600], [5, 6]], "prompt: token id 600 is outside the vocabulary", 0),
        )
        for prompts, words, index in cases:
            status, _, raw = await live.post("/v1/completions", {"prompt": prompts, **score})
            message = error_of(raw)["message"]
            assert status == 400 and words in message, message
            assert message.endswith(f" (prompt index {index})"), message
        body = {"prompt": [[5, 6], [7] * 12], "max_tokens": 8}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 400 and error_of(raw)["message"] == (
            head + "you requested 20 tokens (12 in the messages, 8 in the completion). Please "
            "reduce the length of the messages or completion. (prompt index 1)"
        )
        status, _, raw = await live.post("/v1/completions", {"prompt": [7] * 17, **score})
        assert "prompt index" not in error_of(raw)["message"]
        # The request's own settings are wrong for every prompt: none is named.
        body = {"prompt": [[5, 6], [8]], "max_loops": 99}
        status, _, raw = await live.post("/v1/completions", body)
        message = error_of(raw)["message"]
        assert status == 400 and "max_loops=99" in message and "prompt index" not in message
