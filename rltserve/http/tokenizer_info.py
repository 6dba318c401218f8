"""``GET /tokenizer_info`` (vLLM's, behind ``--enable-tokenizer-info-endpoint``): the served
tokenizer's configuration, from which a client builds a tokenizer that encodes through
``/tokenize`` and ``/detokenize`` instead of a local copy of the files. lm-eval's
``local-completions`` reads it this way (``tokenizer_backend="remote"``, which its default
``"auto"`` picks wherever this answers with an ``eos_token``).

The shape is vLLM's ``TokenizerInfo``: ``tokenizer_config.json`` as Hugging Face loads it (its
``init_kwargs``) less the vocabulary file paths, every serialised ``AddedToken`` as its text,
the named special tokens (``special_tokens_map.json``'s in legacy layouts), ``tokenizer_class``,
and ``chat_template``: the one the server renders chats with (``--chat-template`` included).
"""

from __future__ import annotations

from typing import Any

from rltserve.models.hfconfig import read_json_object
from rltserve.models.tokenizer import Tokenizer
from rltserve.models.tokenizer_files import CONFIG_FILE

# (vLLM drops these: paths on the server's disk, of no use to a client)
_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file")
_DEFAULT_CLASS = "PreTrainedTokenizerFast"  # (what AutoTokenizer builds from tokenizer.json)


def _plain(value: Any) -> Any:
    """``value`` with each serialised ``AddedToken`` (a dict with ``content``) as its text."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def tokenizer_info(tokenizer: Tokenizer) -> dict[str, Any]:
    """The body of ``GET /tokenizer_info`` for ``tokenizer``."""
    config = read_json_object(tokenizer.path / CONFIG_FILE)
    info = {k: _plain(v) for k, v in config.items() if k not in _FILE_KEYS}
    info.update(tokenizer.special_tokens)
    info["tokenizer_class"] = info.get("tokenizer_class") or _DEFAULT_CLASS
    templates = tokenizer.chat_template_sources
    if list(templates) == ["default"]:
        info["chat_template"] = templates["default"]
    elif templates:  # (a named set, as transformers writes one into tokenizer_config.json)
        info["chat_template"] = [{"name": k, "template": v} for k, v in templates.items()]
    else:
        info.pop("chat_template", None)
    return info
