"""The part of a tokenizer that turns text into ids and back.

``FastBackend`` runs ``tokenizer.json`` in the ``tokenizers`` library directly: this is the
backend ``transformers`` builds for the same file (it ignores ``add_bos_token`` /
``add_eos_token`` when ``tokenizer.json`` exists, and its decode is the library's decode without
clean-up), minus the 2 s import. ``TransformersBackend`` covers directories without
``tokenizer.json``; transformers is imported only then.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from rltserve.models.tokenizer_files import NAMED_TOKENS, TokenizerFiles


class TokenizerBackend(Protocol):
    vocab_size: int  # added tokens included

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...

    def special_added_ids(self) -> set[int]: ...


class FastBackend:
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: Path, files: TokenizerFiles) -> FastBackend:
        from tokenizers import AddedToken, Tokenizer

        tok = Tokenizer.from_file(str(path))
        # As transformers does: tokenizer_config.json's added tokens that tokenizer.json does
        # not hold as added tokens, or holds with other flags, become ones with the config's
        # flags (a named token special); a token of the base vocabulary or one already added
        # keeps its id (matched whole from then on), others get new ids at the end.
        present = {_flags(t) for t in tok.get_added_tokens_decoder().values()}
        named = set(files.named.values())
        config = [_added_token(AddedToken, e, e["content"] in named) for e in files.added]
        added = [t for t in config if _flags(t) not in present]
        if added:
            tok.add_tokens(added)
        # Then named or extra special tokens that are not special added tokens
        # yet become ones (new ids at the end for those missing from the vocabulary; a token of
        # the base vocabulary keeps its id), so decode(skip_special_tokens=True) drops them all.
        special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        wanted = dict.fromkeys([*files.named.values(), *files.extra])
        missing = [t for t in wanted if t not in special]
        if missing:
            tok.add_special_tokens([AddedToken(t, special=True) for t in missing])
        return cls(tok)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # ``encode_batch`` lets go of the GIL while it works; ``encode`` holds it throughout,
        # so a large text encoded on the server's codec thread froze the event loop and every
        # stream with it (7 s for a 7 MB /tokenize). A few microseconds more on a short text.
        (encoding,) = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.tok.get_vocab(with_added_tokens=True))

    def special_added_ids(self) -> set[int]:
        return {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}


def _added_token(cls: Any, entry: dict[str, Any], named: bool = False) -> Any:
    """A ``tokenizers.AddedToken`` from its serialised form (transformers' defaults); a
    ``named`` one (bos_token, eos_token, ...) is special, as transformers makes it."""
    flags = {"special": False, "lstrip": False, "rstrip": False, "single_word": False}
    kwargs = {k: bool(entry.get(k, v)) for k, v in flags.items()}
    normalized = entry.get("normalized", not kwargs["special"])
    kwargs["special"] = kwargs["special"] or named
    return cls(entry["content"], normalized=bool(normalized), **kwargs)


def _flags(token: Any) -> tuple:
    """An added token's content and flags: what tells two apart."""
    t = token
    return (t.content, t.special, t.lstrip, t.rstrip, t.single_word, t.normalized)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silences transformers' warnings about unknown ``model_type`` (our families have no
    transformers config class) while the tokenizer loads."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(level)


class TransformersBackend:
    """A transformers tokenizer, for directories without ``tokenizer.json``."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.vocab_size: int = len(hf)

    @classmethod
    def load(cls, path: Path, files: TokenizerFiles) -> tuple[TransformersBackend, TokenizerFiles]:
        """The backend and the special tokens / template as transformers resolved them."""
        from transformers import AutoTokenizer

        with quiet_transformers():
            hf = AutoTokenizer.from_pretrained(
                str(path), trust_remote_code=False, local_files_only=True
            )
        named = {
            k: str(v)
            for k, v in hf.special_tokens_map.items()
            if k in NAMED_TOKENS and isinstance(v, str)
        }
        extra = tuple(str(t) for t in hf.all_special_tokens if str(t) not in named.values())
        template = getattr(hf, "chat_template", None) or files.chat_template
        return cls(hf), TokenizerFiles(named=named, extra=extra, chat_template=template)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(
            self.hf.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        )

    def get_vocab(self) -> dict[str, int]:
        return dict(self.hf.get_vocab())

    def special_added_ids(self) -> set[int]:
        backend = getattr(self.hf, "backend_tokenizer", None)
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        return {i for i, t in added.items() if t.special} | set(self.hf.all_special_ids)
