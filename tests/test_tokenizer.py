"""Tokenizer loading, chat templates, stop ids and the incremental detokenizer, on the locally
trained tokenizers that ``make_model`` writes (no network)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rltserve.models.presets import make_model
from rltserve.models.tokenizer import Tokenizer, TokenizerError, load_tokenizer

TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "The café serves crème brûlée. Grüße aus München!",
    "日本語の文章 and 中文 mixed with English.",
    "Emoji 🙂🚀🤔 and math α+β=γ, ∑x² ≥ 0",
    "line one\nline two\n\ttabbed",
    "",
]


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {n: make_model(n, root / n) for n in ("ouro-tiny", "huginn-tiny", "nanbeige-tiny")}


@pytest.fixture(scope="module")
def toks(ckpt_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    out = {}
    for name, path in ckpt_dirs.items():
        tok = load_tokenizer(path)
        assert tok is not None
        out[name] = tok
    return out


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny", "nanbeige-tiny"])
def test_round_trip(toks: dict[str, Tokenizer], name: str) -> None:
    tok = toks[name]
    assert tok.vocab_size == 512
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_ouro_specials_and_stop_ids(toks: dict[str, Tokenizer]) -> None:
    tok = toks["ouro-tiny"]
    vocab = tok.get_vocab()
    assert (vocab["<|endoftext|>"], vocab["<|im_start|>"], vocab["<|im_end|>"]) == (0, 1, 2)
    assert {"<think>", "</think>"} <= set(vocab)
    assert {0, 2} <= set(tok.eos_token_ids)
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi", add_special_tokens=False)
    # <think> is not special: it survives skip_special_tokens, <|im_end|> does not.
    ids = tok.encode("<think>x</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids) == "<think>x</think>"
    assert tok.decode(ids, skip_special_tokens=False) == "<think>x</think><|im_end|>"


def test_ouro_chat_template(toks: dict[str, Tokenizer]) -> None:
    tok = toks["ouro-tiny"]
    messages = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(str(text), add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 1
    think = tok.apply_chat_template(messages, tokenize=False, enable_thinking=True)
    assert think == str(text) + "<think>\n"
    no_gen = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_gen == "<|im_start|>user\nHi<|im_end|>\n"
    multi = [{"role": "system", "content": "Be brief."}, *messages]
    assert tok.apply_chat_template(multi, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n" + str(text)
    )


def test_chatml_template_without_thinking(toks: dict[str, Tokenizer]) -> None:
    tok = toks["ouro-tiny"]
    messages = [{"role": "user", "content": "Hi"}]
    off = tok.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert off == tok.apply_chat_template(messages, tokenize=False)
    assert not str(off).endswith("<think>\n")


def test_huginn_template_and_ids(toks: dict[str, Tokenizer], ckpt_dirs: dict[str, Path]) -> None:
    tok = toks["huginn-tiny"]
    cfg = json.loads((ckpt_dirs["huginn-tiny"] / "config.json").read_text())
    vocab = tok.get_vocab()
    assert vocab["<|begin_text|>"] == cfg["bos_token_id"] == 512 - 32
    assert vocab["<|end_text|>"] == cfg["eos_token_id"] == 512 - 31
    assert vocab["<|end_turn|>"] == 512 - 28 and vocab["<|pad|>"] == cfg["pad_token_id"]
    text = tok.apply_chat_template([{"role": "user", "content": " Hi \n"}], tokenize=False)
    assert text == (
        "<|begin_text|><|begin_header|>user<|end_header|>\n\nHi<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\n"
    )
    assert {vocab["<|end_text|>"], vocab["<|end_turn|>"]} <= set(tok.eos_token_ids)
    # add_special_tokens=True wraps text in begin/end (the README strips the appended end).
    ids = tok.encode("Hi", add_special_tokens=True)
    assert ids[0] == cfg["bos_token_id"] and ids[-1] == cfg["eos_token_id"]
    assert ids[1:-1] == tok.encode("Hi", add_special_tokens=False)
    # ... and so does a text prompt to continue (LLM and /v1/completions): it is not ended.
    assert tok.appended_end == cfg["eos_token_id"] and tok.encode_prompt("Hi") == ids[:-1]


@pytest.mark.parametrize("name", ["ouro-tiny", "nanbeige-tiny"])
def test_a_prompt_is_encoded_as_text_where_nothing_is_appended(toks, name) -> None:
    tok = toks[name]
    assert tok.appended_end is None
    assert tok.encode_prompt("Hi there") == tok.encode("Hi there", add_special_tokens=True)


def test_nanbeige_template_and_ids(toks: dict[str, Tokenizer], ckpt_dirs: dict[str, Path]) -> None:
    tok = toks["nanbeige-tiny"]
    cfg = json.loads((ckpt_dirs["nanbeige-tiny"] / "config.json").read_text())
    vocab = tok.get_vocab()
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (468, 469, 0)
    assert vocab["<|im_start|>"] == 468 and vocab["<|im_end|>"] == 469
    assert cfg["eos_token_id"] in tok.eos_token_ids
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_nanbeige_think_survives_skip_and_pad_is_the_configs(
    toks: dict[str, Tokenizer], ckpt_dirs: dict[str, Path]
) -> None:
    tok = toks["nanbeige-tiny"]
    cfg = json.loads((ckpt_dirs["nanbeige-tiny"] / "config.json").read_text())
    assert tok.pad_token_id == cfg["pad_token_id"] == tok.get_vocab()["<unk>"]
    ids = tok.encode("<think>x</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids) == "<think>x</think>"


def test_huginn_specials_are_all_special(toks: dict[str, Tokenizer]) -> None:
    tok = toks["huginn-tiny"]
    assert tok.special_ids == set(range(512 - 32, 512))
    assert tok.decode([tok.get_vocab()["<|pad|>"], tok.get_vocab()["<|c_0|>"]]) == ""


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny", "nanbeige-tiny"])
def test_tokenizer_files_fit_the_checkpoint(ckpt_dirs: dict[str, Path], name: str) -> None:
    path = ckpt_dirs[name]
    cfg = json.loads((path / "config.json").read_text())
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    smap = json.loads((path / "special_tokens_map.json").read_text())
    assert tok_cfg["model_max_length"] == cfg.get("max_position_embeddings", cfg.get("block_size"))
    # A role the family lacks (Huginn's unk) is left out, not written as null.
    assert None not in smap.values() and None not in tok_cfg.values()
    assert ("unk_token" in smap) == (name != "huginn-tiny")


def _stream(tok: Tokenizer, ids: list[int], skip: bool, prompt: list[int] | None = None) -> str:
    det = tok.detokenizer(prompt or [], skip_special_tokens=skip)
    deltas = [det.add(i) for i in ids]
    out = "".join(deltas) + det.flush()
    assert det.text == out
    return out


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny", "nanbeige-tiny"])
def test_incremental_matches_full_decode_on_random_ids(toks: dict[str, Tokenizer], name: str):
    tok = toks[name]
    rng = random.Random(1234)
    byte_ids = [tok.encode(c, add_special_tokens=False) for c in "éü中🙂"]
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.5:  # splice in multi-byte characters split across tokens
            for piece in rng.sample(byte_ids, 2):
                at = rng.randrange(len(ids) + 1)
                ids[at:at] = piece
        for skip in (True, False):
            assert _stream(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", ["ouro-tiny", "nanbeige-tiny"])
def test_incremental_multibyte_text_with_prompt(toks: dict[str, Tokenizer], name: str) -> None:
    tok = toks[name]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert isinstance(prompt, list)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        det = tok.detokenizer(prompt)
        deltas = [det.add(i) for i in ids]
        assert "".join(deltas) == text  # valid UTF-8: nothing held back at the end
        assert det.flush() == ""
        assert not any("\ufffd" in d for d in deltas)
    # A character split across tokens is emitted whole, once its last byte arrives.
    pieces = tok.encode("中", add_special_tokens=False)
    assert len(pieces) > 1
    det = tok.detokenizer()
    assert [det.add(i) for i in pieces] == [""] * (len(pieces) - 1) + ["中"]


def test_incremental_skips_special_tokens(toks: dict[str, Tokenizer]) -> None:
    tok = toks["ouro-tiny"]
    ids = tok.encode("Hi<|im_end|> there", add_special_tokens=False)
    assert _stream(tok, ids, skip=True) == "Hi there"
    assert _stream(tok, ids, skip=False) == "Hi<|im_end|> there"


def test_dir_without_tokenizer_returns_none(tmp_path: Path) -> None:
    make_model("ouro-tiny", tmp_path, tokenizer=False)
    assert load_tokenizer(tmp_path) is None
    assert load_tokenizer(tmp_path / "missing") is None


def test_corrupt_tokenizer_raises_clear_error(tmp_path: Path, ckpt_dirs: dict[str, Path]) -> None:
    src = ckpt_dirs["ouro-tiny"]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", ')
    with pytest.raises(TokenizerError, match="cannot load the tokenizer in") as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_a_sentencepiece_model_alone_names_the_package_it_needs(
    tmp_path: Path, ckpt_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint whose tokenizer is ``tokenizer.model`` only (no ``tokenizer.json``) goes
    through transformers, which without the sentencepiece package said that `tiktoken` was
    required."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sentencepiece" else real(name, *a),
    )
    src = ckpt_dirs["nanbeige-tiny"]
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    assert str(err.value) == (
        f"{tmp_path}/tokenizer.model: a SentencePiece model, the tokenizer's only vocabulary "
        "(there is no tokenizer.json); reading it needs the sentencepiece package: `pip "
        "install sentencepiece` (or give the checkpoint a tokenizer.json)"
    )
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nIg== 1\n")  # (tiktoken's: not this)
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    assert "sentencepiece package" not in str(err.value)


def test_missing_chat_template_raises(tmp_path: Path, ckpt_dirs: dict[str, Path]) -> None:
    src = ckpt_dirs["ouro-tiny"]
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert tok is not None and not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.decode(tok.encode("plain text still works")) == "plain text still works"


def test_the_thinking_prefix_needs_a_think_token(toks: dict[str, Tokenizer]) -> None:
    """``enable_thinking`` appends ``<think>\\n`` where the vocabulary has the token (Ouro,
    Nanbeige); Huginn's has none, so its prompt is left as its template rendered it."""
    from rltserve.thinking import chat_prompt_text, with_thinking_prefix

    chat = [{"role": "user", "content": "Hi"}]
    think = {"enable_thinking": True}
    for name, prefixed in (("ouro-tiny", True), ("nanbeige-tiny", True), ("huginn-tiny", False)):
        tok = toks[name]
        rendered = tok.apply_chat_template(chat, tokenize=False, **think)
        text = chat_prompt_text(rendered, True, think, tok)
        assert text == (with_thinking_prefix(rendered) if prefixed else rendered), name
        assert text.endswith("<think>\n") == prefixed, name
        assert chat_prompt_text(rendered, False, think, tok) == rendered


def test_continue_final_message_leaves_the_last_message_open(toks: dict[str, Tokenizer]) -> None:
    tok = toks["ouro-tiny"]
    # The cut is after the LAST appearance of the content, keeping its trailing space.
    messages = [{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "Hi "}]
    text = tok.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False, continue_final_message=True
    )
    assert text == "<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\nHi "
    with pytest.raises(ValueError, match="continue_final_message"):
        tok.apply_chat_template(messages, continue_final_message=True)


def test_stop_ids_include_generation_config_and_skip_ids_the_special_added_tokens(
    toks: dict[str, Tokenizer], ckpt_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # <|im_start|> is a special added token but no named one: decode(skip) still drops it.
    assert toks["ouro-tiny"].get_vocab()["<|im_start|>"] in toks["ouro-tiny"].special_ids
    src = ckpt_dirs["ouro-tiny"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    tok = load_tokenizer(tmp_path)
    assert tok is not None and 7 in tok.eos_token_ids


def _tokenizer_copy(src: Path, dst: Path, config: dict | None, **tokenizer_config) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_config)
    (dst / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if v is not None})
    )
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_stop_ids_in_order_tokenizer_eos_config_generation_config_then_family(
    ckpt_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # Huginn's "!" is id 0: an eos id 0 from config.json counts like any other (MODELS.md §1.7:
    # Ouro's config says eos=0).
    config = {"model_type": "huginn_raven", "eos_token_id": [0, 481]}
    path = _tokenizer_copy(ckpt_dirs["huginn-tiny"], tmp_path / "h", config)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    tok = load_tokenizer(path)
    assert tok is not None and tok.get_vocab()["!"] == 0
    assert tok.eos_token_ids == (481, 0, 7, 484)  # <|end_text|>, !, gen config, <|end_turn|>


def test_chat_terminators_follow_the_config_model_type(
    ckpt_dirs: dict[str, Path], tmp_path: Path
) -> None:
    src = ckpt_dirs["ouro-tiny"]  # <|endoftext|> = 0 (its eos), <|im_end|> = 2
    for model_type, want in (("ouro", (0, 2)), ("huginn_raven", (0,)), (None, (0, 2))):
        config = {} if model_type is None else {"model_type": model_type}
        tok = load_tokenizer(_tokenizer_copy(src, tmp_path / str(model_type), config))
        assert tok is not None and tok.eos_token_ids == want, model_type


def test_special_ids_are_the_ids_skipped_decode_drops(
    toks: dict[str, Tokenizer], ckpt_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # <|im_start|> and <|im_end|> stay special added tokens without additional_special_tokens.
    bare = _tokenizer_copy(
        ckpt_dirs["ouro-tiny"], tmp_path / "bare", None, additional_special_tokens=None
    )
    tok = load_tokenizer(bare)
    assert tok is not None and tok.files.extra == ()
    for t in (*toks.values(), tok):
        dropped = {i for i in range(t.vocab_size) if t.decode([i], skip_special_tokens=True) == ""}
        assert t.special_ids == dropped
    assert tok.special_ids == {0, 1, 2}


def test_streamed_text_keeps_the_prefix_space_the_prompt_gives(tmp_path: Path) -> None:
    # A SentencePiece-style (Metaspace) tokenizer drops the "▁" of a text's first token; the
    # first generated token follows the prompt, so its space is kept.
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok is not None and tok.encode("Hello world again", False) == [1, 2, 3]
    assert tok.decode([2, 3]) == "world again"
    det = tok.detokenizer([1])
    assert [det.add(2), det.add(3), det.flush()] == [" world", " again", ""]
    det = tok.detokenizer()  # no prompt: as decode() renders the text alone
    assert [det.add(2), det.add(3)] == ["world", " again"]


def test_an_appended_token_that_is_no_stop_id_stays_in_a_prompt(
    ckpt_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # Huginn's post-processor appends <|end_text|>; here it is no stop id (the eos is
    # <|end_turn|> and the family's terminators are not in the vocabulary), so it is text.
    config = {"model_type": "ouro", "eos_token_id": 484}
    path = _tokenizer_copy(
        ckpt_dirs["huginn-tiny"], tmp_path / "h", config, eos_token="<|end_turn|>"
    )
    tok = load_tokenizer(path)
    assert tok is not None and tok.eos_token_ids == (484,)
    ids = tok.encode("Hi", add_special_tokens=True)
    assert ids[-1] == 481 and tok.appended_end is None
    assert tok.encode_prompt("Hi") == ids


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny", "nanbeige-tiny"])
def test_token_bytes_join_into_the_characters_split_across_tokens(toks, name) -> None:
    """A token holding part of a character decodes to U+FFFD alone; its bytes (OpenAI's
    logprob ``bytes``) are its own, so a text's tokens' bytes join into its UTF-8."""
    tok = toks[name]
    text = "😀 é中 the"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # (some character is split)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    for i in ids:
        piece = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" not in piece:
            assert tok.token_bytes(i) == piece.encode()
    special = min(tok.special_ids)
    assert tok.token_bytes(special) == tok.decode([special], skip_special_tokens=False).encode()


def test_token_bytes_of_a_sentencepiece_byte_token(toks, monkeypatch) -> None:
    tok = toks["ouro-tiny"]
    monkeypatch.setattr(tok, "decode", lambda ids, skip_special_tokens=True: "\ufffd")
    monkeypatch.setattr(tok, "token_strings", lambda ids: ["<0xF0>"])
    assert tok.token_bytes(7) == b"\xf0"
    monkeypatch.setattr(tok, "token_strings", lambda ids: ["▁x"])  # (no byte-level alphabet)
    assert tok.token_bytes(7) == "\ufffd".encode()


def test_token_id_reads_the_vocabulary_once_per_token(toks: dict[str, Tokenizer], monkeypatch):
    tok = toks["ouro-tiny"]
    vocab = tok.get_vocab()
    reads = []
    read = tok.backend.get_vocab
    monkeypatch.setattr(tok.backend, "get_vocab", lambda: reads.append(1) or read())
    for token in ("<think>", "</think>", "<|im_start|>", "no such token"):
        for _ in range(3):
            assert tok.token_id(token) == vocab.get(token)
    assert vocab.get("<think>") is not None and tok.token_id("no such token") is None
    assert len(reads) <= 4  # (at most one read per token, however often it is asked)
