"""``GET /tokenizer_info`` (vLLM's, behind ``--enable-tokenizer-info-endpoint``): what lm-eval's
``local-completions`` probes for before it encodes through ``/tokenize`` and ``/detokenize``
(its remote tokenizer) instead of loading the tokenizer from a local copy."""

from __future__ import annotations

import json

import orjson
import pytest
from test_http_harness import running, scripted_factory, stage_for, tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


async def test_off_by_default_with_a_404_naming_the_flag(ckpt):
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        status, _, raw = await live.get("/tokenizer_info")
    error = orjson.loads(raw)["error"]
    assert status == 404 and "--enable-tokenizer-info-endpoint" in error["message"]


async def test_a_remote_tokenizer_built_from_it_encodes_as_the_server(ckpt):
    """lm-eval's check (an ``eos_token`` in the body) and what its ``RemoteTokenizer`` then
    does: the special tokens' ids by encoding their text without special tokens added."""
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    stage = stage_for(ckpt)
    flags = {"enable_tokenizer_info_endpoint": True}
    async with running(ckpt, client_factory=scripted_factory(stage), **flags) as live:
        status, _, raw = await live.get("/tokenizer_info")
        assert status == 200
        info = orjson.loads(raw)
        tok = live.state.require_frontend().tokenizer
        ids = {}
        for name in ("eos_token", "bos_token"):
            body = {"prompt": info[name], "add_special_tokens": False}
            _, _, out = await live.post("/tokenize", body)
            ids[name] = orjson.loads(out)["tokens"]
    assert info["eos_token"] == "<|endoftext|>" and ids["eos_token"] == [tok.eos_token_id]
    assert ids["bos_token"] == [tok.bos_token_id]
    assert info["tokenizer_class"] == config["tokenizer_class"]
    assert info["chat_template"] == config["chat_template"]
    assert info["model_max_length"] == config["model_max_length"]
    # Serialised AddedTokens as their text (vLLM's); no paths on the server's disk.
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>"
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)


async def test_it_shows_the_chat_template_the_server_renders_with(ckpt, tmp_path):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    flags = {"enable_tokenizer_info_endpoint": True, "chat_template": template}
    stage = stage_for(ckpt)
    async with running(ckpt, client_factory=scripted_factory(stage), **flags) as live:
        _, _, raw = await live.get("/tokenizer_info")
    assert orjson.loads(raw)["chat_template"] == template


async def test_it_needs_the_api_key_as_tokenize_does(ckpt):
    flags = {"enable_tokenizer_info_endpoint": True, "api_key": "k"}
    stage = stage_for(ckpt)
    async with running(ckpt, client_factory=scripted_factory(stage), **flags) as live:
        status, _, _ = await live.get("/tokenizer_info")
        assert status == 401
        status, _, _ = await live.get("/tokenizer_info", headers={"Authorization": "Bearer k"})
        assert status == 200
