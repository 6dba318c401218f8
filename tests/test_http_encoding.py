"""Prompt encoding off the event loop and the character bound that rejects hopeless prompts
before encoding (``rltserve.http.encoding``)."""

from __future__ import annotations

import asyncio
import random
import threading
import types

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
    wait_for,
)
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from rltserve.http.encoding import INLINE_SIZE, max_token_chars
from rltserve.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return load_tokenizer(ckpt)


def test_token_chars_is_the_longest_token_string(tokenizer):
    vocab = tokenizer.backend.tok.get_vocab(with_added_tokens=True)
    assert max_token_chars(tokenizer) == max(len(t) for t in vocab) == 13


def test_the_bound_holds_for_any_text(tokenizer):
    # A text of C characters never encodes to fewer than C / L tokens: random texts over
    # ASCII, whitespace runs, accents, CJK, emoji and the special tokens' own spelling.
    bound = max_token_chars(tokenizer)
    pieces = [*"abc xyz", "    ", "\n\n", "é", "ü", "日本", "🙂", "<|im_end|>", "-" * 20, "the"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        assert len(tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text), text


def test_no_bound_for_tokenizers_that_merge_or_drop_characters():
    def wrapped(tok: HFTokenizer):
        return types.SimpleNamespace(backend=types.SimpleNamespace(tok=tok))

    # Without an unk token (and no byte-level alphabet) BPE silently drops unknown characters.
    assert max_token_chars(wrapped(HFTokenizer(models.BPE(vocab={"a": 0}, merges=[])))) is None
    bpe = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "<u>": 2}, merges=[], unk_token="<u>"))
    assert max_token_chars(wrapped(bpe)) == 3
    for unsafe in (
        pre_tokenizers.Whitespace(),
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.BertPreTokenizer(),
        pre_tokenizers.Split(" ", behavior="removed"),
    ):
        bpe.pre_tokenizer = unsafe
        assert max_token_chars(wrapped(bpe)) is None, unsafe
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(), pre_tokenizers.Split(" ", behavior="isolated")]
    )
    assert max_token_chars(wrapped(bpe)) == 3
    byte_level = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_token_chars(wrapped(byte_level)) == 2
    bpe.pre_tokenizer = None
    bpe.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.NFD()])
    assert max_token_chars(wrapped(bpe)) == 3
    for unsafe in (normalizers.NFKC(), normalizers.Strip(), normalizers.BertNormalizer()):
        bpe.normalizer = unsafe
        assert max_token_chars(wrapped(bpe)) is None, unsafe
    fused = HFTokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>",
                                   fuse_unk=True))  # fmt: skip
    assert max_token_chars(wrapped(fused)) is None
    wordpiece = HFTokenizer(models.WordPiece(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert max_token_chars(wrapped(wordpiece)) is None
    assert max_token_chars(types.SimpleNamespace(backend=object())) is None


def test_bound_needs_every_part_safe():
    """Sequences are safe only when every member is; Replace only one character by others;
    a ByteLevel anywhere in a pre-tokenizer sequence makes BPE need no unk token; byte
    fallback covers Unigram too."""

    def wrapped(tok: HFTokenizer):
        return types.SimpleNamespace(backend=types.SimpleNamespace(tok=tok))

    bpe = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "<u>": 2}, merges=[], unk_token="<u>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.NFKC()])
    assert max_token_chars(wrapped(bpe)) is None
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    assert max_token_chars(wrapped(bpe)) == 3
    bpe.normalizer = normalizers.Replace("  ", " ")  # merges two spaces into one
    assert max_token_chars(wrapped(bpe)) is None
    bpe.normalizer = None
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(), pre_tokenizers.Whitespace()]
    )
    assert max_token_chars(wrapped(bpe)) is None
    no_unk = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    no_unk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()]
    )
    assert max_token_chars(wrapped(no_unk)) == 2
    unigram = HFTokenizer(
        models.Unigram([("<unk>", 0.0), ("a", -1.0), ("abcd", -2.0)], unk_id=0, byte_fallback=True)
    )
    assert max_token_chars(wrapped(unigram)) == 5


def stage_for(ckpt, max_model_len: int) -> ScriptedStage:
    info = scripted_info(ckpt, max_model_len=max_model_len)
    return ScriptedStage(info, Script([44, 77], interval_s=0.01))


async def test_a_long_prompt_does_not_stall_a_concurrent_stream(ckpt, monkeypatch):
    """While a long prompt is being encoded, another stream keeps receiving events: the
    encoder waits (in its thread) until the stream has seen three more events, which could never
    happen if encoding blocked the event loop."""
    stage = stage_for(ckpt, max_model_len=10**7)
    log: list[str] = []
    progressed = threading.Event()
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        codec = live.state.require_frontend().codec
        real_encode = codec.tokenizer.encode

        def encode(text: str, add_special_tokens: bool = True) -> list[int]:
            if len(text) <= INLINE_SIZE:
                return real_encode(text, add_special_tokens)
            log.append("encode-start")
            progressed.wait(10)  # bounded: an on-loop encode fails the test, never hangs it
            log.append("encode-end")
            return real_encode(text, add_special_tokens)

        monkeypatch.setattr(codec.tokenizer, "encode", encode)

        async def stream() -> None:
            body = {"prompt": [5], "max_tokens": 1000, "stream": True}
            async with live.stream("/v1/completions", body) as r:
                while True:
                    await r.content.readuntil(b"\n\n")
                    log.append("event")
                    if "encode-start" in log:
                        since = log[log.index("encode-start") :]
                        if since.count("event") >= 3:
                            progressed.set()
                            return

        streaming = asyncio.create_task(stream())
        await wait_for(lambda: "event" in log)
        big = "hello world " * 25_000  # 300 kB: encoded on the pool
        body = {"prompt": big, "max_tokens": 1}
        status, _, raw = await asyncio.wait_for(live.post("/v1/completions", body), 60)
        await asyncio.wait_for(streaming, 10)
    assert status == 200, raw
    assert orjson.loads(raw)["usage"]["prompt_tokens"] == len(real_encode(big))
    start, end = log.index("encode-start"), log.index("encode-end")
    assert log[start + 1 : end].count("event") >= 3, log


async def test_a_chat_of_many_short_messages_renders_off_the_event_loop(ckpt, monkeypatch):
    """The render's size counts each message, not only its content: thousands of empty
    messages (a few bytes each in the body) took the template seconds on the event loop,
    freezing every stream; a short chat still renders inline."""
    stage = stage_for(ckpt, max_model_len=10**7)
    threads: list[bool] = []  # per render: whether it ran on the event loop's thread
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        tokenizer = live.state.require_frontend().codec.tokenizer
        real_render = tokenizer.apply_chat_template
        loop_thread = threading.get_ident()

        def render(*args, **kwargs):
            threads.append(threading.get_ident() == loop_thread)
            return real_render(*args, **kwargs)

        monkeypatch.setattr(tokenizer, "apply_chat_template", render)
        for count in (2, 2000):
            body = {"messages": [{"role": "user", "content": ""}] * count}
            status, _, raw = await live.post("/tokenize", body)
            assert status == 200, raw
    assert threads == [True, False]


async def test_an_oversized_prompt_is_a_400_before_encoding(ckpt, monkeypatch):
    stage = stage_for(ckpt, max_model_len=64)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        codec = live.state.require_frontend().codec
        assert codec.limit_chars == 64 * 13
        calls: list[int] = []
        real_encode = codec.tokenizer.encode

        def encode(text: str, add_special_tokens: bool = True) -> list[int]:
            calls.append(len(text))
            return real_encode(text, add_special_tokens)

        monkeypatch.setattr(codec.tokenizer, "encode", encode)
        body = {"prompt": "x" * 2_000_000, "max_tokens": 1}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 400 and orjson.loads(raw)["error"] == {
            "message": "This model's maximum context length is 64 tokens. However, your request "
            "has 2000000 input characters, more than 832 (no token covers more than 13). Please "
            "reduce the length of the input messages.",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": 400,
        }
        chat = {"messages": [{"role": "user", "content": "y" * 5000}]}
        status, _, raw = await live.post("/v1/chat/completions", chat)
        error = orjson.loads(raw)["error"]
        assert status == 400 and error["param"] == "messages"
        assert error["message"].startswith(
            "This model's maximum context length is 64 tokens. However, your request has 5"
        )
        assert calls == []  # neither was encoded
        # just under the bound: encoded, then refused on its token count
        status, _, raw = await live.post("/v1/completions", {"prompt": "x" * 832})
        message = orjson.loads(raw)["error"]["message"]
        assert status == 400 and message.endswith(
            "input tokens. Please reduce the length of the input messages."
        )
        assert calls == [832]
        # /tokenize: the same bound, on its prompt and on its rendered messages
        status, _, raw = await live.post("/tokenize", {"prompt": "x" * 5000})
        assert status == 400 and orjson.loads(raw)["error"] == {
            "message": "This model's maximum context length is 64 tokens. However, your request "
            "has 5000 input characters, more than 832 (no token covers more than 13). Please "
            "reduce the length of the input messages.",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": 400,
        }
        status, _, raw = await live.post("/tokenize", chat)
        error = orjson.loads(raw)["error"]
        assert status == 400 and error["param"] == "messages"
        assert error["message"].startswith(
            "This model's maximum context length is 64 tokens. However, your request has 5"
        )
        assert calls == [832]  # neither was encoded
        # under the bound /tokenize counts what it is given, even past the context
        status, _, raw = await live.post("/tokenize", {"prompt": "x" * 832})
        assert status == 200 and orjson.loads(raw)["count"] == len(real_encode("x" * 832)) > 64


def test_no_bound_for_normalizers_that_compose_or_delete():
    def wrapped(tok: HFTokenizer):
        return types.SimpleNamespace(backend=types.SimpleNamespace(tok=tok))

    bpe = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "<u>": 2}, merges=[], unk_token="<u>"))
    # NFC composes "e" + U+0301 into one "é"; a Replace with nothing deletes its match
    for unsafe in (normalizers.NFC(), normalizers.Replace("a", "")):
        bpe.normalizer = unsafe
        assert max_token_chars(wrapped(bpe)) is None, unsafe


async def test_special_tokens_are_added_only_to_text_prompts(ckpt, monkeypatch):
    """A tokenizer that adds a BOS: a text prompt gets it (unless add_special_tokens=false), a
    rendered chat (whose template spells its own special tokens) does not get a second one."""
    stage = stage_for(ckpt, max_model_len=64)
    messages = [{"role": "user", "content": "Hi"}]
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:

        async def tokens(body: dict) -> list[int]:
            status, _, raw = await live.post("/tokenize", body)
            assert status == 200, raw
            return orjson.loads(raw)["tokens"]

        chat = await tokens({"messages": messages})
        codec = live.state.require_frontend().codec
        real_encode = codec.tokenizer.encode
        plain = real_encode("Hi", False)

        def encode(text: str, add_special_tokens: bool = True) -> list[int]:
            ids = real_encode(text, add_special_tokens)
            return [0, *ids] if add_special_tokens else ids  # (0: the "BOS" here)

        monkeypatch.setattr(codec.tokenizer, "encode", encode)
        assert await tokens({"prompt": "Hi"}) == [0, *plain]
        assert await tokens({"prompt": "Hi", "add_special_tokens": False}) == plain
        assert await tokens({"messages": messages}) == chat
        assert await tokens({"messages": messages, "add_special_tokens": True}) == [0, *chat]
        assert await tokens({"prompt": "Hi", "add_special_tokens": None}) == [0, *plain]
        # the generation routes take vLLM's add_special_tokens too: on by default for a text
        # completion, off for a chat (whose template renders its own)
        for path, body, want in (
            ("/v1/completions", {"prompt": "Hi"}, [0, *plain]),
            ("/v1/completions", {"prompt": "Hi", "add_special_tokens": False}, plain),
            ("/v1/chat/completions", {"messages": messages}, chat),
            ("/v1/chat/completions", {"messages": messages, "add_special_tokens": True},
             [0, *chat]),
        ):  # fmt: skip
            status, _, raw = await live.post(path, {**body, "max_tokens": 1})
            assert status == 200, raw
            assert stage.added_prompts[-1] == want, (path, body)


async def test_tokenize_returns_token_strings_when_asked(ckpt):
    stage = stage_for(ckpt, max_model_len=64)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/tokenize", {"prompt": " Hi"})
        assert status == 200 and "token_strs" not in orjson.loads(raw)
        status, _, raw = await live.post("/tokenize", {"prompt": " Hi", "return_token_strs": True})
        body = orjson.loads(raw)
        tok = live.state.require_frontend().codec.tokenizer
        assert body["token_strs"] == [tok.backend.tok.id_to_token(i) for i in body["tokens"]]
        assert body["token_strs"][0].startswith("\u0120")  # (byte-level BPE's space, as spelled)
        messages = [{"role": "user", "content": "Hi"}]
        body = {"messages": messages, "return_token_strs": True}
        status, _, raw = await live.post("/tokenize", body)
        out = orjson.loads(raw)
        assert len(out["token_strs"]) == out["count"] and "<|im_start|>" in out["token_strs"]


async def test_detokenize_keeps_special_tokens_and_echo_leaves_them_out(ckpt):
    stage = stage_for(ckpt, max_model_len=64)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/detokenize", {"tokens": [44, 77, 2]})  # 2: <|im_end|>
        assert status == 200 and orjson.loads(raw) == {"prompt": "Hi<|im_end|>"}  # (vLLM's)
        body = {"tokens": [44, 77, 2], "skip_special_tokens": True}
        status, _, raw = await live.post("/detokenize", body)
        assert status == 200 and orjson.loads(raw) == {"prompt": "Hi"}
        body = {"prompt": [44, 77, 2], "max_tokens": 1, "echo": True}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200 and orjson.loads(raw)["choices"][0]["text"] == "HiH"
