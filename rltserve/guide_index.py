"""Structured outputs compiled for a tokenizer: ``GuideIndex``, outlines-core's ``Index`` (a DFA
over token ids) of a request's regex, and ``bind``, which the front ends call on every request
with ``structured_outputs`` before it goes to the engine.

The vocabulary is built from the local tokenizer, never downloaded: each token id's bytes
(byte-level BPE's alphabet mapped back to bytes, SentencePiece's ``<0xHH>`` byte tokens and
``▁`` spaces), special tokens left out (a constraint never produces them) and the first of the
tokenizer's stop ids as its end. Compiling takes time on a large vocabulary (seconds for a JSON
schema over 150k tokens), so the front end holding the tokenizer (``LLM``, the server's
``Frontend``) owns a ``GuideCompiler``, which keeps a bounded number of them. Torch-free.
"""

from __future__ import annotations

import copy
import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rltserve.structured import StructuredOutputsParams, outlines_core

if TYPE_CHECKING:
    from rltserve.models.tokenizer import Tokenizer
    from rltserve.sampling import SamplingParams

CACHE_SIZE = 64  # compiled indexes a GuideCompiler keeps (least recently used dropped)
# Each regex is compiled followed by an end mark, a pseudo token of the vocabulary (``END_ID``,
# beyond any real id; its text a noncharacter no real token may spell). outlines-core's automaton
# reports a match one byte late, and its index drops a one-byte step out of a state where the
# regex is matched in full: "1" then "0" under choice ["1", "10"], or "." after "3" under
# ``[0-9]+(\.[0-9]+)?``. With the mark, the regex is matched in full only after it, and the
# output may end wherever the mark may follow (``GuideIndex.ends``).
END_ID = 2**31 - 1
END_MARK = "\U0010ffff"
SPIECE_SPACE = "\u2581"  # SentencePiece's word boundary


@dataclass(frozen=True, eq=False)
class GuideIndex:
    """A regex compiled for one vocabulary: ``index`` is outlines-core's ``Index`` (its states
    are ints; ``get_allowed_tokens``, ``get_next_state``, ``is_final_state``), ``eos`` the id it
    allows where the regex is matched in full, ``size`` the ids a bitmask of its allowed ids
    covers: one past the largest real id (the end mark, ``END_ID``, is not one: ``ends``)."""

    pattern: str
    index: Any  # (of the pattern followed by ``END_MARK``)
    eos: int
    size: int = 0

    def ends(self, state: int) -> bool:
        """Whether the output may end in ``state``: the pattern is matched in full there."""
        after = self.index.get_next_state(state, END_ID)
        return after is not None and self.index.is_final_state(after)

    def __reduce__(self) -> tuple:
        # To a worker process with every request that uses it: serialized once (the index is
        # megabytes at a large vocabulary; outlines-core's own form, its rebuild function and
        # bytes), and restored once per process while requests hold it (``_restore``), not as
        # a copy per request.
        reduced = self.__dict__.get("_reduced")
        if reduced is None:
            rebuild, (data,) = self.index.__reduce__()
            reduced = (rebuild, data)
            object.__setattr__(self, "_reduced", reduced)
        return _restore, (self.pattern, self.eos, self.size, *reduced)


# The indexes restored in this process, by content, while requests hold them (weakly: an entry
# goes with the last request using it).
_RESTORED: weakref.WeakValueDictionary[tuple, GuideIndex] = weakref.WeakValueDictionary()
_RESTORING = threading.Lock()


def _restore(pattern: str, eos: int, size: int, rebuild: Any, data: bytes) -> GuideIndex:
    key = (pattern, eos, size, hashlib.blake2b(data, digest_size=16).digest())
    with _RESTORING:
        known = _RESTORED.get(key)
        if known is None:
            known = _RESTORED[key] = GuideIndex(pattern, rebuild(data), eos, size)
        return known


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


def _mask_size(table: dict[bytes, list[int]], eos: int) -> int:
    """The ids a bitmask of a state's allowed ids covers (``GuideIndex.size``): one past the
    largest real id (outlines-core checks a buffer against its count of ids, which a sparse
    vocabulary's largest id can exceed), and no fewer than that count with the end mark and the
    end id, which outlines-core requires. The mark itself, 2**31 - 1, stays outside: a buffer
    covering it would take 256 MB."""
    largest = max((max(ids) for ids in table.values()), default=eos)
    count = sum(len(ids) for ids in table.values())
    return max(largest + 1, eos + 1, count + 2)


def _with_end_mark(pattern: str) -> str:
    body = pattern[:-1]
    if pattern.endswith("$") and (len(body) - len(body.rstrip("\\"))) % 2 == 0:
        pattern = body  # (a trailing ``$`` would assert the end before the mark; whole anyway)
    return f"(?:{pattern}){END_MARK}"


class GuideCompiler:
    """Constraints compiled for one tokenizer (None: a checkpoint without one, whose
    constraints are refused): its vocabulary as outlines-core takes it, built on first use, and
    the last ``cache_size`` indexes compiled (least recently used dropped). Thread-safe: the
    server compiles on worker threads."""

    def __init__(self, tokenizer: Tokenizer | None, cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        # (outlines-core's Vocabulary, end id, one past the largest id)
        self._vocabulary: tuple[Any, int, int] | None = None
        self._indexes: OrderedDict[str, GuideIndex] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, pattern: str, field: str = "regex") -> GuideIndex:
        """``pattern`` compiled (cached). An invalid regex, one the vocabulary cannot spell, or
        no tokenizer is a ValueError naming ``field``."""
        if self.tokenizer is None:
            raise ValueError(f"{field}: this model has no tokenizer to constrain its output")
        core = outlines_core()
        with self._lock:
            if self._vocabulary is None:
                table, eos = token_bytes_table(self.tokenizer)
                # No real token may spell the mark: those holding its lead byte (0xF4, which
                # only begins the private-use characters of plane 16) are left out.
                table = {text: ids for text, ids in table.items() if 0xF4 not in text}
                size = _mask_size(table, eos)
                table[END_MARK.encode()] = [END_ID]
                self._vocabulary = (core.Vocabulary(eos, table), eos, size)
            vocabulary, eos, size = self._vocabulary
            known = self._indexes.get(pattern)
            if known is not None:
                self._indexes.move_to_end(pattern)
                return known
        # Compiled outside the lock: a long compile does not hold up requests whose index is
        # known.
        try:
            index = core.Index(_with_end_mark(pattern), vocabulary)
        except Exception as exc:  # (outlines-core's ValueError: a bad regex, unspellable text)
            raise ValueError(f"{field}: cannot compile this constraint: {exc}") from None
        guide = GuideIndex(pattern, index, eos, size)
        with self._lock:
            self._indexes[pattern] = guide
            while len(self._indexes) > self.cache_size:
                self._indexes.popitem(last=False)
        return guide

    def bind(self, params: SamplingParams) -> SamplingParams:
        """``params`` with their structured outputs compiled (the engine takes a constraint
        only so); unchanged without one."""
        structured = params.structured_outputs
        if structured is None:
            return params
        if compiled_index(structured) is not None:
            return params
        if self.tokenizer is None:
            raise ValueError(
                f"structured_outputs: {structured.kind} needs the model's tokenizer, which this "
                "checkpoint lacks"
            )
        guide = self.compile(structured.pattern(), structured.kind)
        return params.replace(structured_outputs=with_index(structured, guide))


def bind(params: SamplingParams, tokenizer: Tokenizer | None) -> SamplingParams:
    """``params`` compiled for ``tokenizer`` once, uncached (``GuideCompiler.bind``: for
    callers that build engine requests themselves)."""
    return GuideCompiler(tokenizer).bind(params)


def with_index(structured: StructuredOutputsParams, guide: object) -> StructuredOutputsParams:
    """A copy of ``structured`` carrying its compiled ``guide`` (to the engine, pickled along
    with the params to a worker process; or a Ray replica's ``GuideRef`` standing for it), its
    other marks (``after_reasoning``'s) kept."""
    bound = copy.copy(structured)
    object.__setattr__(bound, "_index", guide)
    return bound


def compiled_index(structured: StructuredOutputsParams) -> GuideIndex | None:
    return getattr(structured, "_index", None)


def after_reasoning(structured: StructuredOutputsParams, end_id: int) -> StructuredOutputsParams:
    """A copy of compiled ``structured`` that applies once the output has closed the thinking
    span its prompt left open (token ``end_id``, ``</think>``), as vLLM's structured outputs
    under a reasoning parser: the thinking is free, the answer after it constrained. (A
    constraint from the first token would put the whole answer in the span.) A thinking budget
    in the request's params bounds that span with its own end ids (``Guide.of``)."""
    bound = copy.copy(structured)  # (its index with it)
    object.__setattr__(bound, "_reasoning_end", end_id)
    return bound


def after_open_span(
    params: SamplingParams, thinking: bool | None, end_id: int | None
) -> SamplingParams:
    """``params`` with their constraint bound ``after_reasoning`` where a chat's prompt left a
    thinking span open (``thinking``: ``ChatPrompt.thinking``) and the tokenizer has
    ``</think>`` (``end_id``): a chat's answer is split there, and its constraint starts
    there. Unchanged otherwise (the server's chat and ``LLM.chat`` alike)."""
    structured = params.structured_outputs
    if structured is None or not thinking or end_id is None:
        return params
    return params.replace(structured_outputs=after_reasoning(structured, end_id))


def reasoning_end(structured: StructuredOutputsParams) -> int | None:
    """The id that closes the thinking span before the constraint applies (None: from the
    first token: ``after_reasoning``)."""
    return getattr(structured, "_reasoning_end", None)


def check_bound(params: SamplingParams) -> None:
    """The engine's check of a request with structured outputs: compiled (``bind``)."""
    structured = params.structured_outputs
    if structured is None:
        return
    if compiled_index(structured) is None:
        raise ValueError(
            "structured_outputs: not compiled for the model's tokenizer (LLM, AsyncLLM and the "
            "server compile it; rltserve.guide_index.bind(params, tokenizer) does)"
        )
