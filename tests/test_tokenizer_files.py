"""``TokenizerFiles``: what it reads from a checkpoint's tokenizer files (named and extra
special tokens, templates inline, in files and named) and how it takes malformed files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltserve.models.tokenizer_files import TokenizerFiles, TokenizerFilesError


def test_tokenizer_files_read_errors(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        TokenizerFiles.read(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        TokenizerFiles.read(tmp_path)
    assert TokenizerFiles.read(tmp_path / "absent") == TokenizerFiles()


def test_tokenizer_files_named_and_extra_tokens_and_template_files(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": {"content": "<e>", "special": True},
                "pad_token": None,
                "extra_special_tokens": {"image_token": "<img>", "audio": {"content": "<aud>"}},
            }
        )
    )
    files = TokenizerFiles.read(a)
    assert files.named == {"eos_token": "<e>"} and files.extra == ("<img>", "<aud>")
    # Legacy layout: special_tokens_map.json adds its extra tokens, each once.
    b = tmp_path / "b"
    b.mkdir()
    (b / "tokenizer_config.json").write_text(json.dumps({"additional_special_tokens": ["<a>"]}))
    smap = {"additional_special_tokens": ["<a>", "<b>"], "bos_token": "<s>"}
    (b / "special_tokens_map.json").write_text(json.dumps(smap))
    files = TokenizerFiles.read(b)
    assert files.extra == ("<a>", "<b>") and files.named == {"bos_token": "<s>"}
    # chat_template.jinja alone is the template; with additional_chat_templates/ a named set.
    (b / "chat_template.jinja").write_text("J")
    assert TokenizerFiles.read(b).chat_template == "J"
    (b / "additional_chat_templates").mkdir()
    (b / "additional_chat_templates" / "tool_use.jinja").write_text("T")
    assert TokenizerFiles.read(b).chat_template == {"default": "J", "tool_use": "T"}


def test_tokenizer_files_ignore_malformed_tokens_and_templates(tmp_path: Path) -> None:
    config = {
        "eos_token": {"content": 5},
        "bos_token": "<s>",
        "chat_template": [{"name": "default", "template": "D"}, {"name": "broken"}, "x"],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    files = TokenizerFiles.read(tmp_path)
    assert files.named == {"bos_token": "<s>"}
    assert files.chat_template == {"default": "D"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": ""}))
    assert TokenizerFiles.read(tmp_path).chat_template is None


def test_tokenizer_files_of_invalid_utf8_are_a_tokenizer_files_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_bytes(b'{"bos_token": "\xff"}')
    with pytest.raises(TokenizerFilesError, match="invalid JSON"):
        TokenizerFiles.read(tmp_path)


def test_only_jinja_files_are_named_templates(tmp_path: Path) -> None:
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("T")
    (tmp_path / "additional_chat_templates" / "README.md").write_text("notes")
    assert TokenizerFiles.read(tmp_path).chat_template == {"tool_use": "T"}
