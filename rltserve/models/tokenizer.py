"""Tokenizer loading, chat templates, stop ids and incremental detokenization.

``load_tokenizer(path)`` reads ``tokenizer.json`` with the ``tokenizers`` library and renders chat
templates with jinja2 (``chat_template``), which is what ``transformers.AutoTokenizer`` does for
these files, without importing transformers (about 2 s of start-up). Only a directory without
``tokenizer.json`` (a SentencePiece model, vocab/merges files) goes through transformers. It
returns None when the checkpoint has no tokenizer files: such a checkpoint still loads and serves
token-id prompts. Results are plain ``list[int]`` / ``str`` either way.

Stop ids (``eos_token_ids``) are the tokenizer's eos, the ``eos_token_id`` of ``config.json`` and
``generation_config.json``, and the family's chat terminators found in the vocabulary: the real
configs get these wrong (MODELS.md §1.7: Ouro says eos=0 while chat turns end with
``<|im_end|>``=2), so an engine must stop on all of them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from rltserve.models.chat_template import ChatTemplate
from rltserve.models.hfconfig import generation_eos_ids, lenient_ids, read_json_object
from rltserve.models.tokenizer_backend import (
    FastBackend,
    TokenizerBackend,
    TransformersBackend,
    quiet_transformers,
)
from rltserve.models.tokenizer_files import NAMED_TOKENS, TokenizerFiles, template_origin

FAST_FILE = "tokenizer.json"
# Files whose presence means "this directory has a tokenizer" (vocabulary-bearing files).
TOKENIZER_FILES = (FAST_FILE, "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# Chat/text terminators per config.json model_type; looked up by content, so ids may differ.
FAMILY_STOP_TOKENS: dict[str, tuple[str, ...]] = {
    "ouro": ("<|endoftext|>", "<|im_end|>"),
    "huginn_raven": ("<|end_text|>", "<|end_turn|>"),
    "nanbeige": ("<|im_end|>", "<|endoftext|>"),
}
DEFAULT_STOP_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|end_turn|>", "<|eot_id|>")
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model")
TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\r?\n")  # a tiktoken file's first line


@cache
def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE vocabulary's character for each byte, inverted (GPT-2's table: the
    printable Latin-1 bytes stand for themselves, the others for chars from U+0100 up)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update({b: chr(0x100 + n) for n, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


class TokenizerError(ValueError):
    """A tokenizer that exists but cannot be loaded or used (corrupt files, no chat template)."""


class Tokenizer:
    """Encode/decode, chat templates and stop ids of one checkpoint. Build with
    ``load_tokenizer``. ``backend`` does the encoding; ``files`` holds the special tokens and
    chat templates."""

    def __init__(self, backend: TokenizerBackend, files: TokenizerFiles, path: Path) -> None:
        self.backend = backend
        self.files = files
        self.path = path
        vocab = backend.get_vocab()
        self.vocab_size: int = backend.vocab_size
        # The named special tokens as text, the template variables transformers passes too.
        self.special_tokens: dict[str, str] = {
            k: files.named[k] for k in NAMED_TOKENS if k in files.named
        }
        ids = {k: vocab.get(v) for k, v in self.special_tokens.items()}
        self.bos_token_id: int | None = ids.get("bos_token")
        self.eos_token_id: int | None = ids.get("eos_token")
        self.pad_token_id: int | None = ids.get("pad_token")
        config = read_json_object(path / "config.json")
        stops: list[int] = lenient_ids(self.eos_token_id)
        stops += lenient_ids(config.get("eos_token_id"))
        stops += generation_eos_ids(path)
        names = FAMILY_STOP_TOKENS.get(config.get("model_type"), DEFAULT_STOP_TOKENS)
        stops += [vocab[n] for n in names if n in vocab]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        # Ids that decode(skip_special_tokens=True) drops: special added tokens plus the named
        # and extra special tokens (transformers' all_special_ids).
        named = [vocab.get(t) for t in (*self.special_tokens.values(), *files.extra)]
        self.special_ids: frozenset[int] = frozenset(
            backend.special_added_ids() | {i for i in named if i is not None}
        )
        self.has_think_token = "<think>" in vocab  # (thinking-model chat prefixes)
        self._pieces: dict[int, str] | None = None  # id -> token, built on first use
        self._texts: dict[int, str] = {}  # id -> its text alone (``token_text``), as asked
        self._token_ids: dict[str, int | None] = {}  # token -> its id (``token_id``), as asked
        # A tokenizer whose post-processor closes every text with an end token (Huginn's
        # appends <|end_text|>): a prompt to continue must not end with it.
        plain, full = backend.encode("a", False), backend.encode("a", True)
        last = full[-1] if len(full) > len(plain) else None
        self.appended_end: int | None = last if last in self.eos_token_ids else None
        source = files.chat_template
        try:
            self._template = ChatTemplate(source) if source else None
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            origin = template_origin(path)
            raise TokenizerError(f"invalid chat_template in {origin}: {exc}") from exc

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    def hf(self) -> Any:
        """The same files as a Hugging Face tokenizer (``AutoTokenizer``, never remote code;
        transformers is imported on the first call, about 2 s), for code written against
        that API; cached. It encodes as this one does."""
        hf = getattr(self.backend, "hf", None)
        if hf is None:
            hf = self.__dict__.get("_hf")
        if hf is None:
            from transformers import AutoTokenizer

            with quiet_transformers():
                hf = AutoTokenizer.from_pretrained(
                    str(self.path), trust_remote_code=False, local_files_only=True
                )
            self._hf = hf
        return hf

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def chat_template_sources(self) -> dict[str, str]:
        """The Jinja source of each chat template chats render with, by name (``default``,
        ``tool_use``); {} without one."""
        return dict(self._template.sources) if self._template is not None else {}

    def use_chat_template(self, source: str) -> None:
        """Renders chats with ``source`` (a Jinja template) instead of the checkpoint's."""
        self._template = ChatTemplate(source)

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included."""
        return self.backend.get_vocab()

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` as the vocabulary spells it (added tokens too; None: not in
        it), cached. For the fixed tags the front ends look up per request (``<think>``,
        ``</think>``, a turn start, tool-call tags): ``get_vocab`` copies the whole vocabulary,
        about 28 ms at Ouro's 49k ids, which every chat request paid."""
        try:
            return self._token_ids[token]
        except KeyError:
            found = self._token_ids[token] = self.backend.get_vocab().get(token)
            return found

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens)

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's ids, special tokens added, without an end token the tokenizer
        appends to every text (``appended_end``; Huginn's README strips it the same way): the
        model is to continue the text, not to see it ended."""
        ids = self.encode(text, True)
        if self.appended_end is not None and ids and ids[-1] == self.appended_end:
            ids.pop()
        return ids

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (transformers' ``convert_ids_to_tokens``:
        ``"Ġthe"``, not ``" the"``)."""
        if self._pieces is None:
            self._pieces = {i: t for t, i in self.backend.get_vocab().items()}
        return [self._pieces.get(i, "") for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text alone, special tokens kept (a logprob's ``decoded_token``),
        cached: a dataset's logprobs name the same ids again and again, and a decode call for
        each was most of ``generate``'s time after the engine finished (one string per id,
        shared by every entry, not one per entry)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (OpenAI's logprob ``bytes``): its text's UTF-8, except that a
        token holding part of a character (its text alone decodes to U+FFFD) gives the bytes
        its vocabulary entry stands for (byte-level BPE's alphabet, or a ``<0xHH>`` byte
        token), so that the bytes of consecutive tokens join into the character."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode()
        (piece,) = self.token_strings([token_id])
        if match := BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        alphabet = byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return text.encode()

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **chat_template_kwargs: Any,
    ) -> list[int] | str:
        """Renders ``messages`` with the checkpoint's template: token ids (``tokenize=True``,
        encoded without extra special tokens, as the templates already hold them) or the text.
        Extra keyword arguments (e.g. ``enable_thinking=True``) are template variables. As in
        Hugging Face's: ``chat_template`` (a Jinja source) replaces the checkpoint's, and
        ``continue_final_message`` ends the text with the last message's content, left open
        for the model to continue (cut where that content last appears)."""
        template = self._template if chat_template is None else ChatTemplate(chat_template)
        if template is None:
            raise TokenizerError(f"the tokenizer in {self.path} has no chat_template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: not with add_generation_prompt")
        text = template.render(
            list(messages), add_generation_prompt, self.special_tokens, **chat_template_kwargs
        )
        if continue_final_message:
            text = _open_final(text, messages[-1].get("content") if messages else None)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def detokenizer(
        self,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        kept_ids: frozenset[int] = frozenset(),
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens, kept_ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation (plus ``flush()``) equals
    ``tokenizer.decode(all generated ids)``, except that the first token is rendered after the
    prompt's last ones: it keeps the space a SentencePiece tokenizer would strip at the start of
    a text (``' world'`` after a prompt, where ``decode`` alone gives ``'world'``; as vLLM's).

    The prefix/read-offset method (as in vLLM): the text of the new tokens is the decode of a
    short window ``ids[prefix:]`` minus the decode of ``ids[prefix:read]``, so context-dependent
    rendering (byte-level spaces, SentencePiece prefix spaces) comes out right. A delta that ends
    in U+FFFD is held back: the token split a multi-byte UTF-8 character whose remaining bytes are
    still to come. Offsets only advance past text that ended cleanly, so every window starts on a
    character boundary.
    """

    _CONTEXT = 5  # prompt tokens kept as left context of the first window

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        kept_ids: frozenset[int] = frozenset(),
    ) -> None:
        """``kept_ids``: special tokens whose text stays even when ``skip_special_tokens``
        drops the others (a reasoning split's ``</think>``)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._kept = kept_ids
        self._ids: list[int] = [t for t in prompt_ids if not self._skipped(t)]
        self._read = len(self._ids)
        self._prefix = max(0, self._read - self._CONTEXT)
        self.text = ""  # everything returned so far

    def _skipped(self, token_id: int) -> bool:
        special = self.skip_special_tokens and token_id in self.tokenizer.special_ids
        return special and token_id not in self._kept

    def _decode(self, ids: list[int]) -> str:
        # With kept ids the other special ids are already out of ``ids`` (``_skipped``), so a
        # decode that skips nothing renders the kept ones and drops no other.
        skip = self.skip_special_tokens and not self._kept
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def add(self, token_id: int) -> str:
        """Feeds one generated token; returns the newly completed text ("" if none yet)."""
        if self._skipped(token_id):
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text held back at the end of generation (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


def has_tokenizer_files(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer stored in checkpoint directory ``path``, or None if it has none.

    Raises ``TokenizerError`` (naming the directory) when tokenizer files exist but do not load.
    """
    from rltserve.checkpoint_files import missing_link_targets

    path = Path(path)
    if (problem := missing_link_targets(path)) is not None:  # (else taken for no files)
        raise TokenizerError(problem)
    if not has_tokenizer_files(path):
        if (path / "tokenizer_config.json").is_file():  # (a download that stopped short?)
            raise TokenizerError(
                f"{path} has tokenizer_config.json but no {FAST_FILE} (nor vocabulary files): "
                f"the tokenizer is incomplete; add {FAST_FILE}, or run on token ids alone "
                "(skip_tokenizer_init=True, or without tokenizer_config.json)"
            )
        return None
    if not (path / FAST_FILE).is_file() and (problem := _sentencepiece_problem(path)):
        raise TokenizerError(problem)
    try:
        files = TokenizerFiles.read(path)
        if (path / FAST_FILE).is_file():
            backend: TokenizerBackend = FastBackend.from_file(path / FAST_FILE, files)
        else:
            backend, files = TransformersBackend.load(path, files)
    except Exception as exc:  # noqa: BLE001 - any failure here means unusable tokenizer files
        raise TokenizerError(
            f"cannot load the tokenizer in {path}: {type(exc).__name__}: {exc}"
        ) from exc
    return Tokenizer(backend, files, path)


def _sentencepiece_problem(path: Path) -> str | None:
    """Why the SentencePiece model of a directory without ``tokenizer.json`` cannot be read
    here: transformers needs the ``sentencepiece`` package for it (not a dependency), and
    without it reports that ``tiktoken`` is missing. None when it can (or there is none; a
    tiktoken ``tokenizer.model``, base64 text, is transformers' business)."""
    import importlib.util

    model = next((path / n for n in SENTENCEPIECE_FILES if (path / n).is_file()), None)
    if model is None or importlib.util.find_spec("sentencepiece") is not None:
        return None
    with open(model, "rb") as f:
        if TIKTOKEN_LINE.match(f.read(256)):
            return None
    return (
        f"{model}: a SentencePiece model, the tokenizer's only vocabulary (there is no "
        f"{FAST_FILE}); reading it needs the sentencepiece package: `pip install "
        f"sentencepiece` (or give the checkpoint a {FAST_FILE})"
    )


def _open_final(text: str, final: object) -> str:
    """``text`` cut after the last appearance of the final message's content ``final`` (an
    empty one leaves it as it is, as Hugging Face's does)."""
    if isinstance(final, str) and not final.strip():
        return text
    if not isinstance(final, str) or final.strip() not in text:
        raise ValueError(
            "continue_final_message: the final message's text does not appear in the rendered chat"
        )
    content = final if final in text else final.strip()
    return text[: text.rindex(content) + len(content)]
