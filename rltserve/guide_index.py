"""Structured outputs compiled for a tokenizer: ``GuideIndex``, outlines-core's ``Index`` (a DFA
over token ids) of a request's regex, and ``bind``, which the front ends call on every request
with ``structured_outputs`` before it goes to the engine.

The vocabulary is built from the local tokenizer, never downloaded: each token id's bytes
(byte-level BPE's alphabet mapped back to bytes, SentencePiece's ``<0xHH>`` byte tokens and
``▁`` spaces), special tokens left out (a constraint never produces them) and the first of the
tokenizer's stop ids as its end. Compiling takes time on a large vocabulary (seconds for a JSON
schema over 150k tokens), so indexes are cached per (regex, tokenizer), a bounded number of
them. Torch-free.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from rltserve.structured import StructuredOutputsParams, outlines_core

if TYPE_CHECKING:
    from rltserve.models.tokenizer import Tokenizer
    from rltserve.sampling import SamplingParams

CACHE_SIZE = 64  # compiled indexes kept per tokenizer (least recently used dropped)
SPIECE_SPACE = "\u2581"  # SentencePiece's word boundary


@dataclass(frozen=True, eq=False)
class GuideIndex:
    """A regex compiled for one vocabulary: ``index`` is outlines-core's ``Index`` (its states
    are ints; ``get_allowed_tokens``, ``get_next_state``, ``is_final_state``), ``eos`` the id it
    allows where the regex is matched in full."""

    pattern: str
    index: Any
    eos: int


class _Compiled:
    """One tokenizer's vocabulary (built once) and its compiled indexes (LRU)."""

    def __init__(self, vocabulary: Any, eos: int) -> None:
        self.vocabulary = vocabulary
        self.eos = eos
        self.indexes: OrderedDict[str, GuideIndex] = OrderedDict()


_compiled: WeakKeyDictionary[Any, _Compiled] = WeakKeyDictionary()
_lock = threading.Lock()  # (the server compiles on worker threads)


def token_bytes_table(tokenizer: Tokenizer) -> tuple[dict[bytes, list[int]], int]:
    """The vocabulary as outlines-core takes it: each byte string's token ids, the special ids
    left out, and the end id (the tokenizer's first stop id)."""
    if not tokenizer.eos_token_ids:
        raise ValueError("structured outputs: the tokenizer names no end-of-sequence token")
    eos = tokenizer.eos_token_ids[0]
    vocab = tokenizer.get_vocab()
    skipped = tokenizer.special_ids | set(tokenizer.eos_token_ids)
    alphabet = _byte_alphabet()
    spiece = any(piece.startswith(SPIECE_SPACE) for piece in vocab)
    table: dict[bytes, list[int]] = {}
    for piece, token in vocab.items():
        if token in skipped or not piece:
            continue
        data = _piece_bytes(piece, spiece, alphabet)
        if data:
            table.setdefault(data, []).append(token)
    return table, eos


def _byte_alphabet() -> dict[str, int]:
    from rltserve.models.tokenizer import byte_level_alphabet

    return byte_level_alphabet()


def _piece_bytes(piece: str, spiece: bool, alphabet: dict[str, int]) -> bytes:
    """A vocabulary entry's bytes: SentencePiece's (``<0xHH>``, ``▁`` a space) where the
    vocabulary is one, else byte-level BPE's (each char one byte of GPT-2's table), else the
    entry's UTF-8 (an added token outside the alphabet)."""
    if spiece:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace(SPIECE_SPACE, " ").encode()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return piece.encode()


def compile_index(pattern: str, tokenizer: Tokenizer, field: str = "regex") -> GuideIndex:
    """``pattern`` compiled for ``tokenizer`` (cached). An invalid regex, or one the vocabulary
    cannot spell, is a ValueError naming ``field``."""
    core = outlines_core()
    with _lock:
        compiled = _compiled.get(tokenizer)
        if compiled is None:
            table, eos = token_bytes_table(tokenizer)
            compiled = _compiled[tokenizer] = _Compiled(core.Vocabulary(eos, table), eos)
        known = compiled.indexes.get(pattern)
        if known is not None:
            compiled.indexes.move_to_end(pattern)
            return known
    # Compiled outside the lock: a long compile does not hold up requests whose index is known.
    try:
        index = core.Index(pattern, compiled.vocabulary)
    except Exception as exc:  # (outlines-core's ValueError: a bad regex, unspellable text)
        raise ValueError(f"{field}: cannot compile this constraint: {exc}") from None
    guide = GuideIndex(pattern, index, compiled.eos)
    with _lock:
        compiled.indexes[pattern] = guide
        while len(compiled.indexes) > CACHE_SIZE:
            compiled.indexes.popitem(last=False)
    return guide


def bind(params: SamplingParams, tokenizer: Tokenizer | None) -> SamplingParams:
    """``params`` with their structured outputs compiled for ``tokenizer`` (the engine takes a
    constraint only so); unchanged without one."""
    structured = params.structured_outputs
    if structured is None:
        return params
    _check_combination(params)
    if compiled_index(structured) is not None:
        return params
    if tokenizer is None:
        raise ValueError(
            f"structured_outputs: {structured.kind} needs the model's tokenizer, which this "
            "checkpoint lacks"
        )
    guide = compile_index(structured.pattern(), tokenizer, structured.kind)
    return params.replace(structured_outputs=with_index(structured, guide))


def with_index(structured: StructuredOutputsParams, guide: GuideIndex) -> StructuredOutputsParams:
    """A copy of ``structured`` carrying its compiled ``guide`` (to the engine, pickled along
    with the params to a worker process)."""
    bound = replace(structured)
    object.__setattr__(bound, "_index", guide)
    return bound


def compiled_index(structured: StructuredOutputsParams) -> GuideIndex | None:
    return getattr(structured, "_index", None)


def check_bound(params: SamplingParams) -> None:
    """The engine's check of a request with structured outputs: compiled (``bind``), and
    without what it cannot combine with."""
    structured = params.structured_outputs
    if structured is None:
        return
    _check_combination(params)
    if compiled_index(structured) is None:
        raise ValueError(
            "structured_outputs: not compiled for the model's tokenizer (LLM, AsyncLLM and the "
            "server compile it; rltserve.guide_index.bind(params, tokenizer) does)"
        )


def _check_combination(params: SamplingParams) -> None:
    if params.max_thinking_tokens is not None:  # (its forced tokens would break the match)
        raise ValueError(
            "structured_outputs: does not combine with bounded thinking (max_thinking_tokens)"
        )
