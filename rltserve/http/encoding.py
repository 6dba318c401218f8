"""Tokenizer work kept off the event loop, and a character bound that rejects hopeless prompts
before they are encoded.

Encoding megabytes of text takes seconds; on the event loop that would freeze every stream.
Texts (and token lists) longer than ``INLINE_SIZE`` are encoded, rendered or decoded on the
server's tokenizer thread pool instead; shorter ones stay inline, where a thread hop would cost
more than the work.

The bound: if no token of the vocabulary covers more than ``L`` characters of the input, a text
of ``C`` characters needs at least ``C / L`` tokens, so ``C > max_model_len * L`` can never fit
and is rejected without encoding. ``L`` is the longest token string of the vocabulary, which is
at least the number of input characters that token covers when the tokenizer represents every
input character in its tokens and never merges or drops characters first: byte-level BPE (one
symbol per byte, and a character has at least one byte), SentencePiece/Metaspace (``▁`` per
space), byte fallback (``<0xE9>`` per byte). ``max_token_chars`` returns None, and no bound is
applied, for anything else: normalizers that can merge or drop characters (NFC, NFKC, strip,
BERT's), unknown-token fusion (one ``<unk>`` for a run of characters), WordPiece (``[UNK]`` for
a whole word), or a tokenizer whose backend it cannot inspect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

from rltserve.http.context_limit import chars_too_many
from rltserve.http.errors import bad_request
from rltserve.models.tokenizer import Tokenizer
from rltserve.thinking import ChatPrompt, chat_prompt

INLINE_SIZE = 4096  # characters (or token ids) handled on the event loop itself
TURN_SIZE = 32  # what one chat message counts towards INLINE_SIZE besides its content
_T = TypeVar("_T")
# Normalizers that never merge or drop characters (each input character stays at least one).
_SAFE_NORMALIZERS = frozenset({"Lowercase", "NFD", "NFKD", "Prepend"})
_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation"})


def max_token_chars(tokenizer: Tokenizer) -> int | None:
    """The most input characters one token can cover, or None when no safe bound is known (see
    the module docstring)."""
    backend = _fast_tokenizer(tokenizer)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        vocab = backend.get_vocab(with_added_tokens=True)
    except Exception:  # noqa: BLE001 - a slow (Python) tokenizer: nothing to inspect
        return None
    pre = spec.get("pre_tokenizer")
    if not (
        _normalizer_is_safe(spec.get("normalizer"))
        and _pre_tokenizer_is_safe(pre)
        and _model_is_safe(spec.get("model"), byte_level=_has_byte_level(pre))
    ):
        return None
    return max((len(token) for token in vocab), default=0) or None


def _fast_tokenizer(tokenizer: Tokenizer) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer``, or None for a slow (Python) one."""
    backend = tokenizer.backend
    fast = getattr(backend, "tok", None)  # read from tokenizer.json
    if fast is None:  # loaded through transformers
        fast = getattr(getattr(backend, "hf", None), "backend_tokenizer", None)
    return fast


def _normalizer_is_safe(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_normalizer_is_safe(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":  # e.g. " " -> "▁": one character for one
        pattern = normalizer.get("pattern", {}).get("String")
        return isinstance(pattern, str) and len(pattern) == 1 and bool(normalizer.get("content"))
    return kind in _SAFE_NORMALIZERS


def _pre_tokenizer_is_safe(pre: dict | None) -> bool:
    """Pre-tokenizers that split without dropping characters (Whitespace, WhitespaceSplit and
    BERT's drop the spaces; a ``Split`` may remove its matches)."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_is_safe(p) for p in pre.get("pretokenizers", []))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    return kind in _SAFE_PRE_TOKENIZERS


def _has_byte_level(pre: dict | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"


def _model_is_safe(model: dict | None, byte_level: bool) -> bool:
    if not isinstance(model, dict):
        return False
    kind = model.get("type")
    if model.get("byte_fallback"):
        return kind in ("BPE", "Unigram")
    if kind != "BPE":
        return False
    if byte_level:  # every byte is a symbol of the alphabet: nothing is unknown
        return True
    # Without an unk token, BPE drops characters it does not know; a fused <unk> could stand
    # for any run of them.
    return model.get("unk_token") is not None and not model.get("fuse_unk", False)


class TextCodec:
    """The frontend's tokenizer calls, each inline or on ``executor`` by input size."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        executor: Executor | None,
        token_chars: int | None,
        pool_limited: bool = False,
    ) -> None:
        """``pool_limited``: ``max_model_len`` is what the KV pool holds (``EngineInfo``'s)."""
        self.tokenizer = tokenizer
        self.pool_limited = pool_limited
        self.max_model_len = max_model_len
        self._executor = executor
        self.token_chars = token_chars
        # None: no provably safe bound, so every prompt is encoded and then checked.
        self.limit_chars = max_model_len * token_chars if token_chars else None

    async def run(self, size: int, fn: Callable[..., _T], *args: Any) -> _T:
        if size <= INLINE_SIZE or self._executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def check_chars(self, text: str, param: str) -> None:
        """A 400 for a text too long to fit the context whatever its tokens."""
        limit = self.limit_chars
        if limit is not None and len(text) > limit:
            message = chars_too_many(
                len(text), self.max_model_len, self.token_chars, self.pool_limited
            )
            raise bad_request(message, param)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids (``encode_any``); a text that cannot fit is a 400 before any
        encoding."""
        self.check_chars(text, param)
        return await self.encode_any(text, add_special_tokens)

    async def encode_any(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of any text, however long (a prompt to truncate may exceed the context): with
        ``add_special_tokens``, a text prompt's as ``Tokenizer.encode_prompt`` has them."""
        if add_special_tokens:
            return await self.run(len(text), self.tokenizer.encode_prompt, text)
        return await self.run(len(text), self.tokenizer.encode, text, False)

    async def chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict,
        continue_final_message: bool = False,
    ) -> ChatPrompt:
        """The chat template rendered as the engine takes it, its thinking span judged
        (``thinking.chat_prompt``; on the pool for long conversations)."""
        # Each message costs the template a turn (its header, its role's rules) whatever its
        # content: a conversation of many empty messages is as slow to render as a long text.
        size = sum(len(str(m.get("content") or "")) + TURN_SIZE for m in messages)

        def render(turns, generation_prompt: bool, continue_final: bool) -> str:
            text = self.tokenizer.apply_chat_template(
                turns,
                generation_prompt,
                tokenize=False,
                continue_final_message=continue_final,
                **template_kwargs,
            )
            assert isinstance(text, str)
            return text

        return await self.run(
            size,
            chat_prompt,
            render,
            messages,
            add_generation_prompt,
            continue_final_message,
            template_kwargs,
            self.tokenizer,
        )

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return await self.run(len(ids), self.tokenizer.decode, ids, skip_special_tokens)
