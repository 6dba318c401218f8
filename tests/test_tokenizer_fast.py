"""The tokenizers/jinja2 tokenizer gives what transformers' AutoTokenizer gives on the same files:
ids, special ids, decode (with and without special tokens), incremental text and chat templates."""

from __future__ import annotations

import json
import random
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rltserve.models.presets import make_model
from rltserve.models.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from rltserve.models.tokenizer_backend import FastBackend, TransformersBackend

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


@pytest.mark.parametrize(
    "bad, match",
    [
        ("{% set ns = namespace() %}{% set ns._x = 1 %}{{ messages[0].content }}", "underscore"),
        # (refused when the namespace is made, not only when the name is set later)
        ("{% set ns = namespace(_x=1) %}{{ ns._x }}", "underscore-prefixed attributes \\('_x'\\)"),
    ],
)
def test_template_sandbox_rejects_underscore_attributes(
    dirs: dict, tmp_path: Path, bad: str, match: str
) -> None:
    path = _with_config(dirs["ouro-tiny"], tmp_path / "t", chat_template=bad)
    tok = load_tokenizer(path)
    assert tok is not None
    with pytest.raises(Exception, match=match):
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
    with pytest.raises(TokenizerError, match="invalid chat_template in .*tokenizer_config.json"):
        load_tokenizer(path)
    (path / "chat_template.jinja").write_text("{% for %}")  # (this file wins: it is named)
    with pytest.raises(TokenizerError, match="invalid chat_template in .*chat_template.jinja"):
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


def test_config_tokens_win_over_special_tokens_map_with_added_tokens_decoder(
    dirs: dict, tmp_path: Path
) -> None:
    path = _with_config(dirs["ouro-tiny"], tmp_path / "t")
    smap = json.loads((path / "special_tokens_map.json").read_text())
    (path / "special_tokens_map.json").write_text(json.dumps({**smap, "eos_token": "<|im_end|>"}))
    tok, hf = load_tokenizer(path), _hf(path)
    assert tok is not None
    assert tok.special_tokens["eos_token"] == str(hf.eos_token) == "<|endoftext|>"
    assert tok.eos_token_id == hf.eos_token_id == 0


def test_block_whitespace_and_null_fields_match_transformers(dirs: dict, tmp_path: Path) -> None:
    # trim_blocks/lstrip_blocks: block tags on lines of their own leave no blank lines or
    # indentation; a None field is absent (``is defined`` is false), as in transformers.
    template = (
        "{% for m in messages %}\n"
        "  {% if m.name is defined %}\n"
        "{{ m.name }}:\n"
        "  {% endif %}\n"
        "{{ m.content }}\n"
        "{% endfor %}\n"
        "end"
    )
    path = _with_config(dirs["ouro-tiny"], tmp_path / "t", chat_template=template)
    tok, hf = load_tokenizer(path), _hf(path)
    assert tok is not None
    chat = [
        {"role": "user", "content": "a", "name": None},
        {"role": "user", "content": "b", "name": "bob"},
    ]
    got = tok.apply_chat_template(chat, tokenize=False)
    assert got == hf.apply_chat_template(chat, tokenize=False) == "a\nbob:\nb\nend"


def test_template_variables_of_other_types_are_opaque(dirs: dict, tmp_path: Path) -> None:
    class Secret:
        token = "s3cret"

    path = _with_config(dirs["ouro-tiny"], tmp_path / "t", chat_template="{{ x.token }}|{{ x }}")
    tok = load_tokenizer(path)
    assert tok is not None
    assert tok.apply_chat_template([], tokenize=False, x=Secret()) == "|<Secret>"


def test_transformers_fallback_decodes_without_clean_up_and_restores_logging(
    dirs: dict, tmp_path: Path
) -> None:
    from transformers.utils import logging as hf_logging

    src = dirs["ouro-tiny"]
    dst = tmp_path / "slow"
    dst.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(src / name, dst / name)
    load_tokenizer(src).backend.tok.model.save(str(dst))  # type: ignore[union-attr]
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    try:
        tok = load_tokenizer(dst)
        assert hf_logging.get_verbosity() == hf_logging.INFO
    finally:
        hf_logging.set_verbosity(before)
    assert tok is not None and isinstance(tok.backend, TransformersBackend)
    text = "a , b . c 's d n't e ?"
    assert tok.decode(tok.encode(text, False)) == text


def test_every_reasoning_field_reaches_the_template_under_both_names(
    dirs: dict, tmp_path: Path
) -> None:
    template = "{% for m in messages %}{{ m.thinking }}|{{ m.reasoning_content }};{% endfor %}"
    path = _with_config(dirs["ouro-tiny"], tmp_path / "t", chat_template=template)
    tok = load_tokenizer(path)
    assert tok is not None
    chat = [
        {"role": "assistant", "content": "x", field: field[:3]}
        for field in ("reasoning_content", "thinking", "reasoning")
    ]
    assert tok.apply_chat_template(chat, tokenize=False) == "rea|rea;thi|thi;rea|rea;"


def test_template_globals_and_objects_with_model_dump(dirs: dict, tmp_path: Path) -> None:
    import datetime

    class Tool:  # (as a pydantic model)
        def model_dump(self) -> dict:
            return {"name": "f", "args": ("a", 1)}

    template = "{{ strftime_now('%Y') }} {{ tools[0].name }}{{ tools[0].args | list }}"
    path = _with_config(dirs["ouro-tiny"], tmp_path / "t", chat_template=template)
    tok = load_tokenizer(path)
    assert tok is not None
    year = datetime.datetime.now().strftime("%Y")
    assert tok.apply_chat_template([], tokenize=False, tools=[Tool()]) == f"{year} f['a', 1]"


def test_named_templates_without_a_default_are_refused(dirs: dict, tmp_path: Path) -> None:
    listed = _with_config(
        dirs["ouro-tiny"],
        tmp_path / "listed",
        chat_template=[{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}],
    )
    tok = load_tokenizer(listed)
    assert tok is not None
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs, tokenize=False, tools=[{"a": 1}]) == "T"
    with pytest.raises(ValueError, match="none is named 'default': rag, tool_use"):
        tok.apply_chat_template(msgs, tokenize=False)


def test_a_wordpiece_vocabulary_decodes_without_clean_up(tmp_path: Path) -> None:
    # (transformers skips its clean-up for BPE tokenizers anyway; a WordPiece one shows it)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", ",", ".", "'", "s"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok is not None and isinstance(tok.backend, TransformersBackend)
    ids = tok.encode("a , b . a 's", False)
    assert ids == [5, 7, 6, 8, 5, 9, 10]
    want = tok.backend.hf.decode(ids, clean_up_tokenization_spaces=False)
    assert tok.decode(ids) == want == "a, b. a ' s"


def test_named_tokens_of_the_base_vocabulary_are_special_as_in_transformers(
    tmp_path: Path,
) -> None:
    # A named token that tokenizer.json lists in its model's vocabulary but not among its added
    # tokens: transformers makes it a special added token (same id), so a skipping decode drops
    # it, and so does the incremental detokenizer.
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.save(str(tmp_path / "tokenizer.json"))
    config = {"unk_token": "<unk>", "eos_token": "▁again"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, hf = load_tokenizer(tmp_path), _hf(tmp_path)
    assert tok is not None
    assert tok.vocab_size == len(hf) and tok.special_ids == {0, 3}
    ids = [1, 0, 2, 3]
    want = hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids) == want == "Hello world"
    det = tok.detokenizer()
    assert "".join(det.add(i) for i in ids) + det.flush() == want
    text = "Hello <unk> world again"
    assert tok.encode(text, False) == hf.encode(text, add_special_tokens=False) == [1, 0, 0, 2, 3]


def test_added_tokens_of_tokenizer_config_alone_are_added_as_in_transformers(
    dirs: dict, tmp_path: Path
) -> None:
    """tokenizer_config.json's ``added_tokens_decoder`` lists a token tokenizer.json lacks as
    an added token (in its vocabulary, or new): transformers adds it, so it encodes whole
    (a tool token added by hand, a hand-edited tokenizer.json). It was split into pieces."""
    path = tmp_path / "ouro"
    shutil.copytree(dirs["ouro-tiny"], path)
    fast = json.loads((path / "tokenizer.json").read_text())
    fast["added_tokens"] = [t for t in fast["added_tokens"] if t["content"] != "<think>"]
    (path / "tokenizer.json").write_text(json.dumps(fast))
    config = json.loads((path / "tokenizer_config.json").read_text())
    flags = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    config["added_tokens_decoder"]["512"] = {"content": "<|tool|>", "special": True, **flags}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, hf = load_tokenizer(path), _hf(path)
    assert tok is not None and tok.vocab_size == len(hf) == 513
    text = "a <think>b</think> <|tool|> c"
    for add in (True, False):
        assert tok.encode(text, add) == hf.encode(text, add_special_tokens=add)
    ids = tok.encode(text, False)
    assert 3 in ids and 512 in ids and 512 in tok.special_ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_added_tokens_of_tokenizer_config_with_other_flags_take_them_as_in_transformers(
    dirs: dict, tmp_path: Path
) -> None:
    """tokenizer_config.json gives a token tokenizer.json holds as an added token other flags
    (lstrip/rstrip, special): transformers adds it again with the config's, same id."""
    path = tmp_path / "ouro"
    shutil.copytree(dirs["ouro-tiny"], path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    decoder["3"] = {**decoder["3"], "lstrip": True, "rstrip": True}  # <think>
    decoder["4"] = {**decoder["4"], "special": True}  # </think>
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, hf = load_tokenizer(path), _hf(path)
    assert tok is not None and tok.vocab_size == len(hf)
    text = "a <think> b </think> c"
    for add in (True, False):
        assert tok.encode(text, add) == hf.encode(text, add_special_tokens=add)
    ids = tok.encode(text, False)
    assert 4 in tok.special_ids and 3 not in tok.special_ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == "a<think>b  c"


def test_encoding_lets_other_threads_run(dirs: dict) -> None:
    """The server encodes on a codec thread: other threads (its event loop) keep running while a
    large text is encoded. tokenizers' ``encode`` holds the GIL nearly throughout (another
    thread runs only at its rare switches); ``FastBackend`` encodes without it."""
    backend = load_tokenizer(dirs["ouro-tiny"]).backend
    assert isinstance(backend, FastBackend)
    text = "".join(f"w{i} " for i in range(100_000))

    def ticks_while(encode: Callable[[], object]) -> int:
        """How often this thread runs while ``encode`` runs on another."""
        started, ticks = threading.Event(), 0

        def run() -> None:
            started.set()
            encode()

        worker = threading.Thread(target=run)
        worker.start()
        started.wait()
        while worker.is_alive():
            ticks += 1
        return ticks

    held = ticks_while(lambda: backend.tok.encode(text, add_special_tokens=False))
    free = ticks_while(lambda: backend.encode(text, add_special_tokens=False))
    assert free > 5 * held, (free, held)  # (measured: 15-30 times as many)
    assert backend.encode(text, False) == backend.tok.encode(text, add_special_tokens=False).ids
