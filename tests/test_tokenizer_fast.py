"""The tokenizers/jinja2 tokenizer gives what transformers' AutoTokenizer gives on the same files:
ids, special ids, decode (with and without special tokens), incremental text and chat templates."""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from rltserve.models.presets import make_model
from rltserve.models.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from rltserve.models.tokenizer_backend import FastBackend, TransformersBackend
from rltserve.models.tokenizer_files import TokenizerFiles

NAMES = ("ouro-tiny", "huginn-tiny", "nanbeige-tiny")
TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "The café serves crème brûlée.",
    "日本語の文章 and 中文, emoji 🙂🚀",
    "line one\nline two\n\ttabbed",
    "",
    "<|im_start|>user\nHi<|im_end|>\n<think>x</think>",
    "<|begin_text|><|begin_header|>user<|end_header|>\n\nHi<|end_turn|>",
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi \n"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "short"},
        {"role": "user", "content": "Again", "name": None},
    ],
]
# Exercises the environment: tojson (no HTML escaping), namespace, loop controls, the generation
# block, special-token variables, raise_exception and caller variables overriding tokens.
FEATURE_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{{ bos_token }}"
    "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.role }}: {{ m.content | tojson }}\n{% endif %}"
    "{% if m.thinking is defined %}[{{ m.thinking }}]{% endif %}{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
    "n={{ ns.n }} eos={{ eos_token }}{% if add_generation_prompt %}>>{% endif %}"
    "{% if messages | length > 5 %}{{ raise_exception('too many') }}{% endif %}"
)


def _hf(path: Path) -> Any:
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fasttok")
    return {n: make_model(n, root / n) for n in NAMES}


@pytest.fixture(scope="module")
def pairs(dirs: dict[str, Path]) -> dict[str, tuple[Tokenizer, Any]]:
    out = {}
    for name, path in dirs.items():
        tok = load_tokenizer(path)
        assert tok is not None and isinstance(tok.backend, FastBackend)
        out[name] = (tok, _hf(path))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_ids_and_specials_match_transformers(pairs: dict, name: str) -> None:
    tok, hf = pairs[name]
    assert tok.vocab_size == len(hf)
    assert tok.get_vocab() == hf.get_vocab()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert set(hf.all_special_ids) <= tok.special_ids
    assert tok.special_tokens == {k: str(v) for k, v in hf.special_tokens_map.items()}
    for text in TEXTS:
        for add in (True, False):
            assert tok.encode(text, add) == hf.encode(text, add_special_tokens=add), (text, add)


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_transformers(pairs: dict, name: str) -> None:
    tok, hf = pairs[name]
    rng = random.Random(7)
    specials = sorted(tok.special_ids)
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 16))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            want = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert tok.decode(ids, skip) == want, (ids, skip)


@pytest.mark.parametrize("name", NAMES)
def test_incremental_text_matches_transformers_decode(pairs: dict, name: str) -> None:
    tok, hf = pairs[name]
    rng = random.Random(3)
    for skip in (True, False):
        for _ in range(20):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 24))]
            det = tok.detokenizer([1, 2, 3], skip_special_tokens=skip)
            text = "".join(det.add(t) for t in ids) + det.flush()
            want = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert text == want


@pytest.mark.parametrize("name", NAMES)
def test_chat_template_matches_transformers(pairs: dict, name: str) -> None:
    tok, hf = pairs[name]
    for chat in CHATS:
        for gen in (True, False):
            for extra in ({}, {"enable_thinking": True}):
                want = hf.apply_chat_template(
                    chat, add_generation_prompt=gen, tokenize=False, **extra
                )
                got = tok.apply_chat_template(
                    chat, add_generation_prompt=gen, tokenize=False, **extra
                )
                assert got == want
                ids = tok.apply_chat_template(chat, add_generation_prompt=gen, **extra)
                assert ids == hf.encode(want, add_special_tokens=False)


def _with_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_template_features_match_transformers(dirs: dict, tmp_path: Path) -> None:
    path = _with_config(dirs["ouro-tiny"], tmp_path / "t", chat_template=FEATURE_TEMPLATE)
    tok, hf = load_tokenizer(path), _hf(path)
    assert tok is not None
    chat = [
        {"role": "user", "content": 'say "<b>&</b>" ünïcode'},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "ok", "thinking": "t"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}, {"eos_token": "<override>"}):
        want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
        got = tok.apply_chat_template(chat, tokenize=False, **kwargs)
        assert got == want
    assert '\\"<b>&</b>\\" ünïcode' in str(got) and "eos=<override>" in str(got)
    with pytest.raises(Exception, match="too many"):
        tok.apply_chat_template(chat * 2, tokenize=False)


def test_template_sandbox_rejects_underscore_attributes(dirs: dict, tmp_path: Path) -> None:
    bad = "{% set ns = namespace() %}{% set ns._x = 1 %}{{ messages[0].content }}"
    path = _with_config(dirs["ouro-tiny"], tmp_path / "t", chat_template=bad)
    tok = load_tokenizer(path)
    assert tok is not None
    with pytest.raises(Exception, match="underscore"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def test_template_file_and_named_templates(dirs: dict, tmp_path: Path) -> None:
    src = dirs["ouro-tiny"]
    listed = _with_config(
        src,
        tmp_path / "listed",
        chat_template=[
            {"name": "default", "template": "D{{ messages[0].content }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}"},
        ],
    )
    tok = load_tokenizer(listed)
    assert tok is not None
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "Dx"
    assert tok.apply_chat_template(msgs, tokenize=False, tools=[{"a": 1}]) == "T1"
    jinja = _with_config(src, tmp_path / "jinja")
    (jinja / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    tok = load_tokenizer(jinja)
    assert tok is not None and tok.apply_chat_template(msgs, tokenize=False) == "Jx"
    assert _hf(jinja).apply_chat_template(msgs, tokenize=False) == "Jx"


def test_invalid_template_is_a_clear_error(dirs: dict, tmp_path: Path) -> None:
    path = _with_config(dirs["ouro-tiny"], tmp_path / "t", chat_template="{% if %}")
    with pytest.raises(TokenizerError, match="invalid chat_template in"):
        load_tokenizer(path)


def test_legacy_special_tokens_map_and_missing_tokens(dirs: dict, tmp_path: Path) -> None:
    # Without added_tokens_decoder, special_tokens_map.json decides the named tokens; a named
    # token absent from the vocabulary is added as a new special id.
    path = _with_config(dirs["nanbeige-tiny"], tmp_path / "t", added_tokens_decoder=None)
    smap = json.loads((path / "special_tokens_map.json").read_text())
    smap["pad_token"] = {"content": "<|newpad|>", "special": True}
    (path / "special_tokens_map.json").write_text(json.dumps(smap))
    tok, hf = load_tokenizer(path), _hf(path)
    assert tok is not None
    assert tok.pad_token_id == hf.pad_token_id == 512 and tok.vocab_size == len(hf) == 513
    assert set(hf.all_special_ids) <= tok.special_ids
    assert tok.decode([5, 512, 6]) == hf.decode([5, 512, 6], skip_special_tokens=True)


def test_without_tokenizer_json_falls_back_to_transformers(dirs: dict, tmp_path: Path) -> None:
    src = dirs["ouro-tiny"]
    fast = load_tokenizer(src)
    assert fast is not None
    dst = tmp_path / "slow"
    dst.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(src / name, dst / name)
    fast.backend.tok.model.save(str(dst))  # type: ignore[attr-defined]  # vocab.json, merges.txt
    tok = load_tokenizer(dst)
    assert tok is not None and isinstance(tok.backend, TransformersBackend)
    for text in TEXTS[:5]:
        assert tok.encode(text, False) == fast.encode(text, False)
        assert tok.decode(tok.encode(text, False)) == text
    chat = CHATS[1]
    assert tok.apply_chat_template(chat, tokenize=False) == fast.apply_chat_template(
        chat, tokenize=False
    )
    assert tok.eos_token_ids == fast.eos_token_ids


def test_a_tokenizer_config_without_a_tokenizer_is_refused(dirs: dict, tmp_path: Path) -> None:
    """A partial download (tokenizer_config.json, no tokenizer.json) is an error naming the
    missing file, not a checkpoint served without text; no tokenizer files at all is none."""
    assert load_tokenizer(tmp_path) is None
    shutil.copy(dirs["ouro-tiny"] / "tokenizer_config.json", tmp_path)
    with pytest.raises(ValueError, match="tokenizer_config.json but no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_tokenizer_files_read_errors(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        TokenizerFiles.read(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        TokenizerFiles.read(tmp_path)
    assert TokenizerFiles.read(tmp_path / "absent") == TokenizerFiles()
