"""``toktrain``: the special-token layout's checks and the trained tokenizer's vocabulary."""

from __future__ import annotations

import pytest

from rltserve.models import toktrain
from rltserve.models.preset_configs import ouro_layout
from rltserve.models.toktrain import CHATML_TEMPLATE, TokenizerLayout, build_tokenizer


def _layout(vocab: int, specials, **roles) -> TokenizerLayout:
    return TokenizerLayout(vocab, specials, chat_template=CHATML_TEMPLATE, **roles)


def _roles(**given: str) -> dict[str, str | None]:
    return {"bos": None, "eos": None, "pad": None, "unk": None} | given


def test_layout_refuses_duplicate_ids_and_contents() -> None:
    with pytest.raises(ValueError, match="must be unique"):
        _layout(512, ((0, "<a>", True), (0, "<b>", True)), **_roles())
    with pytest.raises(ValueError, match="must be unique"):
        _layout(512, ((0, "<a>", True), (1, "<a>", True)), **_roles())


def test_layout_refuses_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match=r"must lie in \[0, 512\)"):
        _layout(512, ((512, "<a>", True),), **_roles())
    with pytest.raises(ValueError, match=r"must lie in \[0, 512\)"):
        _layout(512, ((-1, "<a>", True),), **_roles())


def test_layout_needs_room_for_bytes_and_some_merges() -> None:
    specials = ((0, "<a>", True), (1, "<b>", True))
    assert _layout(2 + 256 + 16, specials, **_roles()).vocab_size == 274
    with pytest.raises(ValueError, match="too few ids for byte-level BPE"):
        _layout(2 + 256 + 15, specials, **_roles())


def test_layout_roles_must_name_special_tokens() -> None:
    with pytest.raises(ValueError, match="'<eos>' is not one of the special tokens"):
        _layout(512, ((0, "<a>", True),), **_roles(bos="<a>", eos="<eos>"))


def test_word_ids_are_the_merged_tokens() -> None:
    layout = ouro_layout(512, 2048)
    tok = build_tokenizer(layout)
    bytes_ = layout.regular_ids()[:256]
    assert layout.word_ids() == layout.regular_ids()[256:]
    assert all(len(tok.id_to_token(i)) == 1 for i in bytes_)
    assert all(len(tok.id_to_token(i)) >= 2 for i in layout.word_ids())


def test_a_large_vocabulary_is_fully_trained_and_deterministic() -> None:
    layout = ouro_layout(2048, 2048)  # beyond what the corpus alone supports
    tok = build_tokenizer(layout)
    assert tok.get_vocab_size() == 2048
    assert not [t for t in tok.get_vocab() if t.startswith("<unused_")]
    assert build_tokenizer(layout).to_str() == tok.to_str()


def test_ids_the_corpus_cannot_fill_are_unused_tokens_that_decode(monkeypatch) -> None:
    monkeypatch.setattr(toktrain, "_CORPUS_CAPACITY", 10**9)  # no pseudo-words
    tok = build_tokenizer(ouro_layout(2048, 2048))
    assert tok.get_vocab_size() == 2048
    unused = tok.token_to_id("<unused_0>")
    assert unused is not None and tok.decode([unused]) == "<unused_0>"
    assert tok.decode([2047]).startswith("<unused_")
