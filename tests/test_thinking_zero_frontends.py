"""A thinking budget of 0 through the front ends (``LLM``, ``AsyncLLM``; the HTTP body's
``thinking_token_budget``: test_http_request_rules.py): a chat that thinks answers at once
after the forced ``</think>``, as a run of its prompt with ``</think>`` appended; a prompt whose
span is closed (a template's "thinking off" pre-fill) or never opened runs without it."""

from __future__ import annotations

import pytest
from async_llm_util import DELTA, ENGINE, collect
from reference import Reference
from reference_parts import thinking_logprobs

from rltserve import LLM, AsyncLLM, SamplingParams

THINK = {"chat_template_kwargs": {"enable_thinking": True}}
MESSAGES = [{"role": "user", "content": "Why?"}]
PROMPT = "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\n"
ZERO = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, thinking_token_budget=0)


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny), **ENGINE) as llm:
        yield llm


def _lp(sample) -> list[float]:
    return [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)]


def test_chat_answers_after_the_forced_end_as_the_prompt_with_it(llm, tiny):
    end = llm.tokenizer.get_vocab()["</think>"]
    params = ZERO.replace(logprobs=1, n=2, temperature=1.0, seed=11)
    (out,) = llm.chat(MESSAGES, params, use_tqdm=False, **THINK)
    prompt = out.prompt_token_ids
    plain = params.replace(thinking_token_budget=None, max_tokens=7, prompt_logprobs=0)
    (want,) = llm.generate({"prompt_token_ids": prompt + [end]}, plain, use_tqdm=False)
    for sample, expected in zip(out.outputs, want.outputs):
        assert sample.token_ids == [end, *expected.token_ids]
        assert sample.text == "</think>" + expected.text
        assert _lp(sample)[1:] == pytest.approx(_lp(expected), abs=1e-5)
        # The forced token's logprob: the model's score of it after the prompt.
        assert _lp(sample)[0] == pytest.approx(want.prompt_logprobs[-1][end].logprob, abs=1e-5)
        total = sum(_lp(sample))
        assert sample.cumulative_logprob == pytest.approx(total)
    (greedy,) = llm.chat(MESSAGES, ZERO.replace(logprobs=0), use_tqdm=False, **THINK)
    sample = greedy.outputs[0]
    oracle = thinking_logprobs(
        Reference.load(tiny), prompt, sample.token_ids, sample.exit_depths, {0}, 0
    )
    assert _lp(sample)[0] == pytest.approx(oracle[0][0], abs=1e-4)


def test_a_closed_or_unopened_span_runs_without_the_budget(llm):
    plain = ZERO.replace(thinking_token_budget=None)
    for prompt in (
        "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n",
    ):
        (out,), (want,) = (llm.generate(prompt, p, use_tqdm=False) for p in (ZERO, plain))
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    (out,), (want,) = (llm.chat(MESSAGES, p, use_tqdm=False) for p in (ZERO, plain))
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_stop_string_in_the_forced_text_ends_the_output_scored(llm):
    params = ZERO.replace(logprobs=1, stop=["</think>"], include_stop_str_in_output=True)
    (out,) = llm.chat(MESSAGES, params, use_tqdm=False, **THINK)
    sample = out.outputs[0]
    assert sample.text == "</think>" and sample.finish_reason == "stop"
    assert len(sample.logprobs) == 1 and _lp(sample)[0] < 0


async def test_async_llm_streams_the_forced_end_first(tiny, llm):
    engine = AsyncLLM(str(tiny), **ENGINE)
    try:
        end = engine.tokenizer.get_vocab()["</think>"]
        (want,) = llm.chat(MESSAGES, ZERO, use_tqdm=False, **THINK)
        prompt = {"prompt_token_ids": want.prompt_token_ids}
        outs = await collect(engine, prompt, ZERO.replace(output_kind=DELTA))
        pieces = [o.outputs[0].token_ids for o in outs]
        assert pieces[0][0] == end and sum(pieces, []) == want.outputs[0].token_ids
        assert "".join(o.outputs[0].text for o in outs) == want.outputs[0].text
    finally:
        engine.shutdown()


async def test_async_llm_delta_yields_nothing_for_a_late_score(tiny, llm):
    """The forced id's score comes one step after it: that update yields no empty part (the
    delta keeps the entry it went out with, as README says of streams)."""
    engine = AsyncLLM(str(tiny), **ENGINE)
    try:
        params = ZERO.replace(logprobs=1)
        (want,) = llm.chat(MESSAGES, params, use_tqdm=False, **THINK)
        prompt = {"prompt_token_ids": want.prompt_token_ids}
        outs = await collect(engine, prompt, params.replace(output_kind=DELTA))
        assert all(o.outputs[0].token_ids for o in outs[:-1])
        assert sum((o.outputs[0].token_ids for o in outs), []) == want.outputs[0].token_ids
        assert outs[0].outputs[0].logprobs[0] == {}  # (went out before its score came)
        assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(
            want.outputs[0].cumulative_logprob
        )
    finally:
        engine.shutdown()


async def test_http_chat_answers_without_thinking(tiny):
    """vLLM's request field: the answer is all content, the (empty) reasoning is the span the
    forced ``</think>`` closed, which usage counts; a stream sends no chunk for that token."""
    import orjson
    from test_http_harness import running, sse_payloads

    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "thinking_token_budget": 0, "logprobs": True, **THINK}  # fmt: skip
    async with running(tiny, engine={"num_blocks": 128}) as live:
        status, _, raw = await live.post("/v1/chat/completions", body)
        assert status == 200, raw
        (choice,) = orjson.loads(raw)["choices"]
        usage = orjson.loads(raw)["usage"]
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        status, _, raw = await live.post("/v1/chat/completions", streamed)
        # Completions' echo scores the prompt: the forced id goes out with the prompt's
        # logprobs, its own score among them, in the stream as in the whole response.
        echo = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                "thinking_token_budget": 0, "logprobs": 1, "echo": True}  # fmt: skip
        _, _, whole = await live.post("/v1/completions", echo)
        _, _, echoed = await live.post("/v1/completions", {**echo, "stream": True})
        # Without echo the forced id's score comes after it: that update sends no chunk.
        _, _, plain = await live.post("/v1/completions", {**echo, "echo": False, "stream": True})
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == ""
    tokens = [e["token"] for e in choice["logprobs"]["content"]]
    assert tokens[0] == "</think>" and message["content"] == "".join(tokens[1:])
    assert choice["logprobs"]["content"][0]["logprob"] < 0  # (scored, as later ones)
    assert usage["completion_tokens"] == 6
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 1}
    events = sse_payloads(raw)
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) == {"content"} for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == message["content"]
    want = orjson.loads(whole)["choices"][0]["logprobs"]["token_logprobs"]
    chunks = [e["choices"][0]["logprobs"]["token_logprobs"] for e in sse_payloads(echoed)[:-1]]
    assert sum(chunks, []) == want and want[-3] < 0  # (the forced id's: scored)
    texts = [e["choices"][0]["text"] for e in sse_payloads(plain)[:-1]]
    assert texts[0] == "</think>" and all(texts) and len(texts) == 3, texts
    streamed_usage = events[-2]["usage"]  # (its prompt came from the prefix cache)
    assert streamed_usage["completion_tokens_details"] == {"reasoning_tokens": 1}
    assert streamed_usage["completion_tokens"] == 6
