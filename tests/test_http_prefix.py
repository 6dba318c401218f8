"""The server on the real engine with prefix caching: a repeated prompt reports its reused
tokens in ``usage.prompt_tokens_details.cached_tokens`` and generates the same output; ``n``
samples share one prefill and equal n separate requests seeded ``seed + j``; the prefix
cache counters reach /metrics."""

from __future__ import annotations

import orjson
import pytest
import pytest_asyncio
from test_http_harness import running, tiny_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")
ENGINE = {"num_blocks": 256, "block_size": 4, "max_num_seqs": 8}
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # 14 tokens: 3 full blocks reusable


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory):
    async with running(tiny_checkpoint(tmp_path_factory), engine=ENGINE) as live:
        yield live


async def complete(server, **body):
    status, _, raw = await server.post("/v1/completions", body)
    assert status == 200, raw
    return orjson.loads(raw)


async def test_repeated_prompt_reports_cached_tokens(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    first = await complete(server, **body)
    assert "prompt_tokens_details" not in first["usage"]
    again = await complete(server, **body)
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}
    assert again["usage"]["prompt_tokens"] == len(PROMPT)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


async def test_n_samples_share_one_prefill_and_equal_separate_requests(server):
    prompt = [30 + i for i in range(11)]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 7,
            "return_token_ids": True}  # fmt: skip
    before = server.state.client.stats
    together = await complete(server, **body, n=4)
    after = server.state.client.stats
    # Each of the 3 followers reuses all but the last prompt token of the first's prefill.
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * (len(prompt) - 1)
    assert "prompt_tokens_details" not in together["usage"]  # the prompt was computed once
    for j in range(4):
        alone = await complete(server, **{**body, "seed": 7 + j})
        assert together["choices"][j]["token_ids"] == alone["choices"][0]["token_ids"]
    status, _, text = await server.get("/metrics")
    assert status == 200
    assert b"rltserve:prefix_cache_hits_total" in text
    assert b"rltserve:prefix_cache_queries_total" in text


async def test_n_out_of_range_is_a_400_naming_the_field(server):
    for n in (0, 10_000):
        status, _, raw = await server.post("/v1/completions", {"prompt": PROMPT, "n": n})
        assert status == 400
        assert orjson.loads(raw)["error"]["param"] == "n"


async def test_cache_salt_shares_blocks_only_within_one_salt(server):
    """vLLM's ``cache_salt``: a prompt cached under one salt is a miss under another or none,
    a hit under the same; the output is the same either way; an empty salt is a 400."""
    prompt = [60 + i for i in range(14)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    first = await complete(server, **body, cache_salt="tenant-a")
    assert "prompt_tokens_details" not in first["usage"]
    for salt in ("tenant-b", None):
        other = await complete(server, **body, cache_salt=salt)
        assert "prompt_tokens_details" not in other["usage"], salt
    for salt in ("tenant-a", "tenant-b"):
        again = await complete(server, **body, cache_salt=salt)
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}, salt
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for bad in ("", 5):
        status, _, raw = await server.post("/v1/chat/completions", {**chat, "cache_salt": bad})
        error = orjson.loads(raw)["error"]
        assert (status, error["param"]) == (400, "cache_salt"), error
