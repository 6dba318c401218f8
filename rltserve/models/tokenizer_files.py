"""What a checkpoint's tokenizer files say beside the vocabulary: named special tokens, extra
special tokens and chat templates, read the way ``transformers`` reads them.

- Named tokens (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``,
  ``cls_token``, ``mask_token``) and extra special tokens (``additional_special_tokens`` /
  ``extra_special_tokens``) come from ``tokenizer_config.json``; ``special_tokens_map.json``
  overrides them only when the config has no ``added_tokens_decoder`` (legacy layouts). A token is
  a string or a serialised ``AddedToken`` (a dict with ``content``).
- Added tokens: ``tokenizer_config.json``'s ``added_tokens_decoder`` entries, in id order, which
  transformers adds to the tokenizer (``tokenizer.json`` may lack some of them).
- Chat templates: ``chat_template.jinja`` and ``additional_chat_templates/<name>.jinja`` take
  priority over the config's ``chat_template``, which is a string or a list of
  ``{"name", "template"}`` entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
NAMED_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_EXTRA_KEYS = ("additional_special_tokens", "extra_special_tokens")


class TokenizerFilesError(ValueError):
    """A tokenizer metadata file exists but is not valid JSON of the expected shape."""


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerFilesError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerFilesError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def token_text(value: object) -> str | None:
    """A special token's text from its serialised form (string or AddedToken dict)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _extras(value: object) -> list[str]:
    if isinstance(value, dict):  # named model-specific tokens
        value = list(value.values())
    if not isinstance(value, list):
        return []
    return [t for t in (token_text(v) for v in value) if t is not None]


def _added(value: object) -> tuple[dict[str, Any], ...]:
    """The serialised ``AddedToken``s of an ``added_tokens_decoder``, in id order."""
    if not isinstance(value, dict):
        return ()
    entries = [
        (int(key), entry)
        for key, entry in value.items()
        if isinstance(key, str) and key.isdigit() and token_text(entry) is not None
    ]
    return tuple(entry for _, entry in sorted(entries, key=lambda e: e[0]))


def _templates(root: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    named: dict[str, str] = {}
    if (root / TEMPLATE_FILE).is_file():
        named["default"] = (root / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (root / TEMPLATE_DIR).is_dir():
        for file in sorted((root / TEMPLATE_DIR).glob("*.jinja")):
            named[file.stem] = file.read_text(encoding="utf-8")
    if named:
        return named["default"] if list(named) == ["default"] else named
    source = config.get("chat_template")
    if isinstance(source, list):
        entries = {e.get("name"): e.get("template") for e in source if isinstance(e, dict)}
        return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, str)}
    return source if isinstance(source, str) and source else None


def template_origin(root: Path) -> Path:
    """The file (or folder) the chat templates of ``root`` come from, as ``_templates`` reads
    them: for an error to name what to fix."""
    for name in (TEMPLATE_FILE, TEMPLATE_DIR):
        if (root / name).exists():
            return root / name
    return root / CONFIG_FILE


@dataclass(frozen=True)
class TokenizerFiles:
    """Special tokens and chat templates of one tokenizer directory (see module docstring)."""

    named: dict[str, str] = field(default_factory=dict)  # e.g. {"eos_token": "<|im_end|>"}
    extra: tuple[str, ...] = ()
    chat_template: str | dict[str, str] | None = None
    added: tuple[dict[str, Any], ...] = ()  # added_tokens_decoder's entries, in id order

    @classmethod
    def read(cls, root: str | Path) -> TokenizerFiles:
        root = Path(root)
        config = _load_json(root / CONFIG_FILE)
        tokens: dict[str, object] = {k: config[k] for k in NAMED_TOKENS if k in config}
        extra = next((_extras(config[k]) for k in _EXTRA_KEYS if config.get(k)), [])
        if "added_tokens_decoder" not in config:
            legacy = _load_json(root / SPECIAL_MAP_FILE)
            tokens.update({k: legacy[k] for k in NAMED_TOKENS if k in legacy})
            for key in _EXTRA_KEYS:
                extra += [t for t in _extras(legacy.get(key)) if t not in extra]
        named = {k: t for k, t in ((k, token_text(v)) for k, v in tokens.items()) if t}
        return cls(
            named=named,
            extra=tuple(extra),
            chat_template=_templates(root, config),
            added=_added(config.get("added_tokens_decoder")),
        )
