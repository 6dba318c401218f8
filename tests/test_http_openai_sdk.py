"""The official ``openai`` SDK against the server on a loopback port (ouro-tiny, in-process
stage): completions and chat, streamed and not, ``n``, ``stop``, ``logprobs``,
``stream_options.include_usage``, token counts in ``usage``, and the SDK's exception classes for
400, 401, 404 and 503."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading

import openai
import pytest
import pytest_asyncio
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
)

from rltserve.models.tokenizer import load_tokenizer

module_loop = pytest.mark.asyncio(loop_scope="module")  # the loop of the module-scoped server
KEY = "sesame"
PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return load_tokenizer(ckpt)


def sdk(url: str, api_key: str = KEY) -> openai.AsyncOpenAI:
    # trust_env=False: a proxy from the environment must not capture loopback traffic
    http = openai.DefaultAsyncHttpxClient(trust_env=False)
    return openai.AsyncOpenAI(
        base_url=url + "/v1", api_key=api_key, max_retries=0, http_client=http
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(ckpt):
    async with running(ckpt, api_key=KEY) as live, sdk(live.url) as client:
        yield client


@module_loop
async def test_completion_and_its_stream_agree(client, tokenizer):
    prompt_tokens = len(tokenizer.encode(PROMPT))
    params = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    done = await client.completions.create(**params, logprobs=2)
    (choice,) = done.choices
    assert done.object == "text_completion" and done.model == "tiny"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, 8)
    assert done.usage.total_tokens == prompt_tokens + 8
    assert choice.finish_reason == "length" and choice.text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    assert "".join(logprobs.tokens) == choice.text
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)

    stream = await client.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}


@module_loop
async def test_completion_n_and_stop(client):
    greedy = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = greedy.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text  # a stop string from the middle of the greedy text
    stopped = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    many = await client.completions.create(
        model="tiny", prompt=[PROMPT, "Hello"], max_tokens=4, n=2, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in many.choices)
    assert many.usage.completion_tokens == 2 * 2 * 4


@module_loop
async def test_logit_bias_and_allowed_token_ids(client):
    """OpenAI's ``logit_bias`` (string keys) and vLLM's ``allowed_token_ids`` reach the
    sampler: the greedy run's first token, biased by -100, is not sampled; an allowed list
    bounds every token, streamed too."""
    params = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    ids = {"return_token_ids": True, "ignore_eos": True}
    free = await client.completions.create(**params, extra_body=ids)
    first = free.choices[0].model_extra["token_ids"][0]
    biased = await client.completions.create(
        **params, logit_bias={str(first): -100}, extra_body=ids
    )
    assert biased.choices[0].model_extra["token_ids"][0] != first
    allowed = [first, 11, 12]
    body = {**ids, "allowed_token_ids": allowed}
    stream = await client.completions.create(**params, stream=True, extra_body=body)
    chunks = [chunk async for chunk in stream]
    tokens = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert len(tokens) == 6 and set(tokens) <= set(allowed)


@module_loop
async def test_echo_with_logprobs_scores_the_prompt(client, tokenizer):
    """Echo with logprobs lists the prompt's tokens first (the first without a logprob) and
    their logprobs, as scoring clients (lm-eval's loglikelihood) read them; ``max_tokens=0``
    returns the prompt alone. Streamed, the first chunk carries them."""
    ids = tokenizer.encode(PROMPT)
    params = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "echo": True, "logprobs": 2}
    alone = await client.completions.create(**params, max_tokens=0)
    (choice,) = alone.choices
    lp = choice.logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (alone.usage.prompt_tokens, alone.usage.completion_tokens) == (len(ids), 0)
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and len(lp.token_logprobs) == len(ids)
    # the top 2 and the prompt's token itself (one of them, or a third)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert all(token in top for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    more = await client.completions.create(**params, max_tokens=3)
    (choice,) = more.choices
    assert choice.text.startswith(PROMPT) and more.usage.completion_tokens == 3
    assert choice.logprobs.token_logprobs[: len(ids)] == lp.token_logprobs
    assert len(choice.logprobs.tokens) == len(ids) + 3

    stream = await client.completions.create(**params, max_tokens=3, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs
    assert chunks[0].choices[0].logprobs.token_logprobs[: len(ids)] == lp.token_logprobs

    # prompt_logprobs beyond logprobs: each echoed position still lists up to logprobs + 1
    wide = await client.completions.create(
        **{**params, "logprobs": 1}, max_tokens=1, extra_body={"prompt_logprobs": 3}
    )
    tops = wide.choices[0].logprobs.top_logprobs
    assert all(1 <= len(top) <= 2 for top in tops[1:])
    assert all(list(top)[0] == token for token, top in zip(lp.tokens[1:], tops[1:]))
    assert len(wide.choices[0].model_extra["prompt_logprobs"][1]) >= 3

    # vLLM's prompt_logprobs extension: the same numbers, keyed by token id, ranked.
    vllm = await client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    first, *rest = vllm.choices[0].model_extra["prompt_logprobs"]
    assert first is None and len(rest) == len(ids) - 1
    for token, entry, value in zip(ids[1:], rest, lp.token_logprobs[1:]):
        assert next(iter(entry)) == str(token) and entry[str(token)]["logprob"] == value
        assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None)[:2] == [1, 2]
    both = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        temperature=0,
        max_tokens=2,
        logprobs=1,
        extra_body={"prompt_logprobs": 1},
    )
    # Without echo, logprobs list the output's tokens only (vLLM's).
    assert len(both.choices[0].logprobs.tokens) == 2
    assert both.choices[0].logprobs.text_offset[0] == 0
    streamed = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 2}
    )
    chunks = [c async for c in streamed]
    assert chunks[0].choices[0].model_extra["prompt_logprobs"] == [first, *rest]
    assert all("prompt_logprobs" not in c.choices[0].model_extra for c in chunks[1:])

    with pytest.raises(openai.BadRequestError, match="max_tokens=0: only with echo"):
        await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)


@module_loop
async def test_chat_and_its_stream_agree(client, tokenizer):
    prompt_tokens = len(tokenizer.apply_chat_template(CHAT))
    params = {"model": "tiny", "messages": CHAT, "max_tokens": 6, "temperature": 0}
    done = await client.chat.completions.create(**params, logprobs=True, top_logprobs=3)
    (choice,) = done.choices
    assert done.object == "chat.completion" and choice.message.role == "assistant"
    assert done.usage.prompt_tokens == prompt_tokens
    content = choice.logprobs.content
    assert len(content) == done.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 for item in content)
    assert "".join(item.token for item in content) == choice.message.content

    stream = await client.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == prompt_tokens

    two = await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=3, n=2, temperature=1.0, seed=5
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.completion_tokens <= 6 and two.usage.prompt_tokens == prompt_tokens


@module_loop
async def test_a_thinking_answer_as_the_sdk_types_it(ckpt):
    """An answer that opens its own thinking span (<think>, "H", </think>, "i"): the SDK reads
    ``reasoning`` and ``usage.completion_tokens_details.reasoning_tokens``, and dumps the
    response without a serialization warning (``metadata`` maps strings to strings)."""
    import warnings

    stage = ScriptedStage(scripted_info(ckpt), Script([3, 44, 4, 77, 2]))
    async with (
        running(ckpt, client_factory=scripted_factory(stage)) as live,
        sdk(live.url) as client,
    ):
        done = await client.chat.completions.create(model="tiny", messages=CHAT)
        stream = await client.chat.completions.create(
            model="tiny", messages=CHAT, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    message = done.choices[0].message
    assert (message.content, message.reasoning, message.reasoning_content) == ("i", "H", "H")
    assert done.usage.completion_tokens_details.reasoning_tokens == 3
    assert done.metadata == {"weight_version": "0"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        done.model_dump()
        done.model_dump_json()
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "H"
    assert "".join(d.content or "" for d in deltas) == "i"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 3


@module_loop
async def test_sdk_error_classes(client):
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model="tiny", prompt=PROMPT, temperature=5)
    assert err.value.status_code == 400 and "temperature" in err.value.message
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100_000)
    assert "maximum context length is 2048 tokens" in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        await client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert err.value.status_code == 404
    wrong = sdk(str(client.base_url).removesuffix("/v1/"), api_key="wrong")
    async with wrong:
        with pytest.raises(openai.AuthenticationError) as err:
            await wrong.models.list()
    assert err.value.status_code == 401
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert (await client.models.retrieve("tiny")).id == "tiny"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4")


@module_loop
async def test_sdk_sees_503_while_loading(ckpt):
    release = threading.Event()
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))

    def slow_factory(config):
        release.wait(10)
        return stage

    loading = running(ckpt, client_factory=slow_factory, wait=False)
    async with loading as live, sdk(live.url, api_key="unused") as client:
        with pytest.raises(openai.InternalServerError) as err:
            await client.completions.create(model="tiny", prompt=PROMPT)
        assert err.value.status_code == 503 and err.value.body["message"] == "Loading model"
        release.set()
        await live.state.ready.wait()
        done = await client.completions.create(model="tiny", prompt=[5], max_tokens=2)
        assert done.usage.completion_tokens == 2


def test_sync_sdk_against_rltserve_serve(ckpt):
    """The real command line: `rltserve serve` in its own process, the key from the
    environment, --strict-fields from its flag, SIGTERM for a clean exit."""
    cmd = [sys.executable, "-m", "rltserve.cli", "serve", "--model", str(ckpt), "--port", "0",
           "--served-model-name", "tiny", "--strict-fields", "--num-blocks", "512",
           "--max-num-seqs", "16"]  # fmt: skip
    env = {**os.environ, "RLTSERVE_API_KEY": KEY}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = _wait_for_url(proc, timeout=180)
        http = openai.DefaultHttpxClient(trust_env=False)
        with openai.OpenAI(
            base_url=url + "/v1", api_key=KEY, max_retries=0, http_client=http
        ) as client:
            done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
            assert done.usage.completion_tokens <= 3 and done.choices[0].finish_reason
            chunks = list(
                client.chat.completions.create(
                    model="tiny", messages=CHAT, max_tokens=3, stream=True,
                    stream_options={"include_usage": True},
                )
            )  # fmt: skip
            assert chunks[0].choices[0].delta.role == "assistant"
            assert 1 <= chunks[-1].usage.completion_tokens <= 3
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="tiny", prompt=PROMPT, extra_body={"store": 1})
            assert err.value.body["message"] == "store: unknown field"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stderr.close()


def _wait_for_url(proc: subprocess.Popen, timeout: float) -> str:
    """The URL from the server's "serving tiny on URL" log line (read on a thread, bounded)."""
    found: list[str] = []
    seen: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            seen.append(line)
            match = re.search(r"serving tiny on (http://\S+)", line)
            if match:
                found.append(match.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found, "server did not come up:\n" + "".join(seen[-20:])
    # keep draining stderr so the server never blocks on a full pipe
    threading.Thread(target=_drain, args=(proc,), daemon=True).start()
    return found[0]


def _drain(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ValueError, OSError):  # the test closed the pipe
        for _ in proc.stderr:
            pass
