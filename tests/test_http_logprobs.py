"""Logprobs in HTTP bodies, with a scripted stage and the real ouro-tiny tokenizer: completion
and chat shapes, -inf clamping, the sampled token first among top_logprobs, forced tokens left
out of chat logprobs, prompt_logprobs=0, and (on the real engine) the depth echo scores at."""

from __future__ import annotations

import orjson
import pytest
from test_http_harness import (
    RewritingStage,
    Script,
    body_of,
    first_updates,
    hi_token_ids,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    stage_for,
    tiny_checkpoint,
)

from rltserve.models.tokenizer import Tokenizer, load_tokenizer
from rltserve.updates import RequestUpdate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def hi_tokens(ckpt) -> list[int]:
    return hi_token_ids(ckpt)


async def test_logprobs_shapes(ckpt, hi_tokens):
    stage = stage_for(ckpt, hi_tokens)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5], "max_tokens": 2, "logprobs": 1}
        _, _, raw = await live.post("/v1/completions", body)
        (choice,) = sse_payloads(b"data: " + raw + b"\n\n")[0]["choices"]
        assert choice["logprobs"] == {
            "tokens": [" ", "H"],
            "token_logprobs": [-0.5, -0.5],
            "top_logprobs": [{" ": -0.5}, {"H": -0.5}],
            "text_offset": [0, 1],
        }
        chat = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": 1,
        }
        _, _, raw = await live.post("/v1/chat/completions", chat)
    (choice,) = sse_payloads(b"data: " + raw + b"\n\n")[0]["choices"]
    assert choice["logprobs"] == {
        "content": [
            {
                "token": " ",
                "logprob": -0.5,
                "bytes": [32],
                "top_logprobs": [{"token": " ", "logprob": -0.5, "bytes": [32]}],
            }
        ]
    }


async def test_minus_infinity_logprobs_are_clamped(ckpt, hi_tokens):
    """JSON has no -inf: a logprob the engine reports as -inf (a masked token) is -9999.0, as
    vLLM clamps it, in completions and chat; chat's ``logprobs: true`` without
    ``top_logprobs`` lists each token with no alternatives."""

    def masked(update: RequestUpdate) -> RequestUpdate:
        update.new_logprobs = [float("-inf") for _ in update.new_logprobs]
        update.new_top_logprobs = [
            [(t, float("-inf")) for t, _ in top or []] for top in update.new_top_logprobs
        ]
        return update

    stage = RewritingStage(scripted_info(ckpt), Script(hi_tokens), masked)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5], "max_tokens": 2, "logprobs": 1}
        _, _, raw = await live.post("/v1/completions", body)
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True}
        _, _, chat_raw = await live.post("/v1/chat/completions", chat)
    assert body_of(raw)["choices"][0]["logprobs"] == {
        "tokens": [" ", "H"],
        "token_logprobs": [-9999.0, -9999.0],
        "top_logprobs": [{" ": -9999.0}, {"H": -9999.0}],
        "text_offset": [0, 1],
    }
    assert body_of(chat_raw)["choices"][0]["logprobs"] == {
        "content": [{"token": " ", "logprob": -9999.0, "bytes": [32], "top_logprobs": []}]
    }


async def test_completions_top_logprobs_list_the_sampled_token_first(ckpt, hi_tokens):
    """A completions choice's ``top_logprobs`` holds the sampled token besides the top k (up
    to logprobs+1 entries, OpenAI's and vLLM's), so ``logprobs: 0`` lists the token alone."""
    i = hi_tokens[2]

    def unlikely(update: RequestUpdate) -> RequestUpdate:
        update.new_logprobs = [-2.0 for _ in update.new_logprobs]
        update.new_top_logprobs = [[(i, -0.1)][: len(top or [])] for top in update.new_top_logprobs]
        return update

    stage = RewritingStage(scripted_info(ckpt), Script(hi_tokens), unlikely)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        tops = []
        for k in (1, 0):
            body = {"prompt": [5], "max_tokens": 2, "logprobs": k}
            _, _, raw = await live.post("/v1/completions", body)
            tops.append(body_of(raw)["choices"][0]["logprobs"]["top_logprobs"])
    assert tops[0] == [{" ": -2.0, "i": -0.1}, {"H": -2.0, "i": -0.1}]
    assert [list(top) for top in tops[0]] == [[" ", "i"], ["H", "i"]]
    assert tops[1] == [{" ": -2.0}, {"H": -2.0}]


async def test_chat_logprobs_leave_out_forced_tokens(ckpt, hi_tokens):
    """A token the engine appends without sampling it (bounded thinking's interruption and
    ``</think>``) has no logprob: chat's ``logprobs.content`` leaves it out (OpenAI's schema
    has a number for every entry), streamed or not; completions list it with null."""

    def forced_second(update: RequestUpdate) -> RequestUpdate:
        update.new_logprobs = [
            None if t == hi_tokens[1] else lp
            for t, lp in zip(update.new_token_ids, update.new_logprobs)
        ]
        return update

    stage = RewritingStage(scripted_info(ckpt), Script(hi_tokens), forced_second)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logprobs": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, raw = await live.post("/v1/chat/completions", chat)
        _, _, streamed = await live.post("/v1/chat/completions", {**chat, "stream": True})
        body = {"prompt": [5], "max_tokens": 2, "logprobs": 0}
        _, _, completion = await live.post("/v1/completions", body)
    content = body_of(raw)["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [(" ", -0.5), ("i", -0.5)]
    chunks = [c["choices"] for c in sse_payloads(streamed)[:-1]]
    listed = [c[0]["logprobs"]["content"] for c in chunks if c and c[0]["logprobs"]]
    assert [e["token"] for entries in listed for e in entries] == [" ", "i"]
    logprobs = body_of(completion)["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [-0.5, None]
    assert logprobs["top_logprobs"] == [{" ": -0.5}, {}]


async def test_prompt_logprobs_zero_lists_the_prompt_tokens(ckpt, hi_tokens):
    """vLLM's ``prompt_logprobs: 0`` asks for each prompt token's own logprob (no
    alternatives): the list is there, null for the first token."""

    def scored(update: RequestUpdate) -> None:
        update.prompt_logprobs = [(-1.25, [], 7), (-2.5, [], 1)]

    stage = RewritingStage(scripted_info(ckpt), Script(hi_tokens), first_updates(scored))
    tok = load_tokenizer(ckpt)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": 0}
        status, _, raw = await live.post("/v1/completions", body)
    assert status == 200
    assert body_of(raw)["choices"][0]["prompt_logprobs"] == [
        None,
        {"6": {"logprob": -1.25, "rank": 7, "decoded_token": tok.decode([6])}},
        {"7": {"logprob": -2.5, "rank": 1, "decoded_token": tok.decode([7])}},
    ]


async def test_logprob_texts_decode_each_token_once(ckpt, hi_tokens, monkeypatch):
    """A body names the same ids many times (n choices each echoing the prompt, k alternatives
    per token): each id's text is decoded once (the tokenizer's cache), not once per entry,
    which held the event loop for seconds on one request of a large n (completions and chat
    alike, ``bytes`` included)."""

    def scored(update: RequestUpdate) -> None:
        update.prompt_logprobs = [(-1.0, [(6, -1.0), (9, -2.0)], 1), (-2.0, [(9, -1.5)], 2)]

    singles: list[int] = []
    decode = Tokenizer.decode

    def counting(self, ids, skip_special_tokens=True):
        if len(ids) == 1 and not skip_special_tokens:  # (a token's text alone: not detokenizing)
            singles.append(ids[0])
        return decode(self, ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", counting)
    stage = RewritingStage(scripted_info(ckpt), Script(hi_tokens), first_updates(scored))
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "n": 8, "echo": True, "logprobs": 2}
    chat = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "n": 8,
        "logprobs": True,
        "top_logprobs": 2,
    }
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
        chat_status, _, chat_raw = await live.post("/v1/chat/completions", chat)
    assert (status, chat_status) == (200, 200)
    choices = body_of(raw)["choices"]
    assert len(choices) == 8
    assert all(len(c["logprobs"]["tokens"]) == 5 for c in choices)
    assert all(len(c["logprobs"]["content"]) == 2 for c in body_of(chat_raw)["choices"])
    assert len(singles) == len(set(singles))


async def test_chat_logprob_bytes_are_each_tokens_own(ckpt):
    """A character split across tokens: each token's text is U+FFFD, its ``bytes`` its own
    bytes (OpenAI's), which join into the character."""
    ids = load_tokenizer(ckpt).encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    stage = stage_for(ckpt, ids)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": len(ids)}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, raw = await live.post("/v1/chat/completions", {**chat, "logprobs": True})
    (choice,) = body_of(raw)["choices"]
    assert choice["message"]["content"] == "😀"
    content = choice["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["\ufffd"] * len(ids)
    assert b"".join(bytes(entry["bytes"]) for entry in content) == "😀".encode()


async def test_a_stop_string_waits_for_the_forced_tokens_scores(ckpt, hi_tokens):
    """Bounded thinking: a forced token goes out without a logprob and a later update scores
    it (``forced_logprobs``). A stop string that ends the choice before that keeps the
    engine request until the score came: the non-streaming body lists every token's logprob
    (aligned with ``token_ids``); a stream ends as before, leaving the forced entry out."""
    forced = hi_tokens[1]

    def forced_then_scored(update: RequestUpdate) -> RequestUpdate:
        if update.new_token_ids[:1] == [forced]:
            update.new_logprobs, update.new_top_logprobs = [None], [None]
        elif update.new_token_ids[:1] == [hi_tokens[2]]:  # (the next step scores it)
            update.forced_logprobs = [(1, -3.0, [(forced, -3.0)], 1)]
        return update

    stage = RewritingStage(scripted_info(ckpt), Script(hi_tokens), forced_then_scored)
    chat = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 1,
        "stop": ["H"],
        "return_token_ids": True,
    }
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, raw = await live.post("/v1/chat/completions", chat)
        _, _, streamed = await live.post("/v1/chat/completions", {**chat, "stream": True})
    (choice,) = body_of(raw)["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == " "
    assert choice["token_ids"] == hi_tokens[:2]
    content = choice["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [(" ", -0.5), ("H", -3.0)]
    assert content[1]["top_logprobs"] == [{"token": "H", "logprob": -3.0, "bytes": [72]}]
    assert len(stage.aborted) == 2  # (each request, once scored)
    chunks = [c["choices"] for c in sse_payloads(streamed)[:-1]]
    assert [c[0]["finish_reason"] for c in chunks if c][-1] == "stop"
    listed = [c[0]["logprobs"]["content"] for c in chunks if c and c[0].get("logprobs")]
    assert [e["token"] for entries in listed for e in entries] == [" "]
    assert streamed.endswith(b"data: [DONE]\n\n")


async def test_echo_scores_the_prompt_at_max_loops_whatever_the_exit(ckpt):
    """Echo's prompt logprobs (prompt_logprobs') come after ``max_loops`` loops: a scoring
    request's ``exit_threshold`` changes nothing, while its ``max_loops`` sets the depth."""
    score = {"prompt": [5, 9, 14, 3, 7], "echo": True, "max_tokens": 0, "logprobs": 1}
    async with running(ckpt) as live:

        async def scored(**fields) -> list:
            status, _, raw = await live.post("/v1/completions", {**score, **fields})
            assert status == 200, raw
            return orjson.loads(raw)["choices"][0]["logprobs"]["token_logprobs"]

        full = await scored()
        assert await scored(exit_threshold=0.3) == full
        assert await scored(exit_threshold=0.3, max_loops=4) == full  # (ouro-tiny's depth)
        assert await scored(exit_threshold=0.3, max_loops=2) != full


async def test_tokens_as_token_ids_per_request_and_by_the_server(ckpt, hi_tokens):
    """vLLM's ``return_tokens_as_token_ids``: logprobs name each token ``token_id:N`` (its
    bytes: that text's), asked per request or as the server's default, which a request's own
    ``false`` turns off."""
    a, b = hi_tokens[:2]
    completion = {"prompt": [5], "max_tokens": 2, "logprobs": 1}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True}
    chat["top_logprobs"] = 1
    named = f"token_id:{a}"
    for flags, ask, as_ids in (
        ({}, True, True),
        ({"return_tokens_as_token_ids": True}, None, True),
        ({"return_tokens_as_token_ids": True}, False, False),
    ):
        extra = {} if ask is None else {"return_tokens_as_token_ids": ask}
        stage = stage_for(ckpt, hi_tokens)
        async with running(ckpt, client_factory=scripted_factory(stage), **flags) as live:
            _, _, raw = await live.post("/v1/completions", {**completion, **extra})
            logprobs = body_of(raw)["choices"][0]["logprobs"]
            _, _, raw = await live.post("/v1/chat/completions", {**chat, **extra})
            (content,) = body_of(raw)["choices"][0]["logprobs"]["content"]
        if as_ids:
            assert logprobs["tokens"] == [named, f"token_id:{b}"]
            assert logprobs["top_logprobs"][0] == {named: -0.5}
            assert logprobs["text_offset"] == [0, len(named)]  # (vLLM's: the names' lengths)
            assert content["token"] == named and content["bytes"] == list(named.encode())
            assert content["top_logprobs"][0]["token"] == named
        else:
            assert logprobs["tokens"] == [" ", "H"] and content["token"] == " "
