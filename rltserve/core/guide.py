"""A guided request's position in its constraint: the sampler state of structured outputs.

The runner keeps one ``Guide`` per guided request beside its sampling generator
(``LiveRequest.guide``). Each step that samples the request masks its logits to the tokens the
guide allows (``Sampler``: with ``allowed_token_ids``, before bans, bias and penalties), and
each sampled token, once its step's result is on the host, advances it (``LiveRequest.commit``).
The runner delivers every earlier step before a step samples (``Step.run``), so the state a mask
is read from always follows the request's last token, async scheduling and token pipelining
included. A request resumed after preemption (recompute or swap) gets a fresh guide advanced
over the tokens it had sampled (``replay``), so its continuation is an uninterrupted run's.

A prompt that leaves a thinking span open (a chat template's ``<think>``) starts its guide
inactive (``after_reasoning``): nothing is masked until the output samples ``</think>``, as
vLLM's reasoning parsers do. A thinking budget (``max_thinking_tokens``: the engine's span is
open from the first output) does the same with its own end ids (``thinking_end_token_ids``),
and the span also closes where the budget is spent: after the K-th thinking token the engine
forces the interruption and the end ids (``core/thinking.py``), which never reach a live guide
(they are not sampled), so the guide turns active at that token and masks the first token
sampled after them, as it would the token after a sampled ``</think>``. A resumed request's
replay skips the forced ids among its outputs (``replay``'s ``num_forced``), so it lands
where the live guide was. (vLLM's budget forces the end as logits masked before sampling, so
there too the constraint starts at the answer's first sampled token.)

Where the regex is matched in full and nothing may follow, only the end id is allowed: the
request stops there ("stop"). A token the guide cannot take (never sampled under its mask)
leaves it at that end too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rltserve.core.staging import move_to, to_device
from rltserve.guide_index import END_ID, GuideIndex, compiled_index, reasoning_end
from rltserve.structured import StructuredOutputsParams, outlines_core

if TYPE_CHECKING:
    from rltserve.sampling import SamplingParams

# Device masks a sampler keeps (least recently used go): [V] bools, 166 KB each at a 166k
# vocabulary (83 MB in all).
MASKS_KEPT = 512
_BITS = torch.tensor([1 << b for b in range(32)], dtype=torch.int64).to(torch.int32)


class Guide:
    """A request's state in its compiled constraint (``state``: None once it ended); advanced
    by each token the request samples. The state is held by an outlines-core ``Guide`` over the
    shared index (``_cursor``), which writes the state's allowed ids as a bitmask: a mask is
    built without a Python list of up to the whole vocabulary."""

    def __init__(
        self,
        compiled: GuideIndex,
        reasoning_end: int | tuple[int, ...] | None = None,
        budget: int | None = None,
    ) -> None:
        self.compiled = compiled
        self._cursor = outlines_core().Guide(compiled.index)
        self.state: int | None = self._cursor.get_state()  # None: at the end
        # The ids that end the thinking span before the constraint applies; None once they
        # have (or where there was none). ``budget``: the span's length at most (a thinking
        # budget's K, whose end the engine forces unsampled); ``_thought`` its tokens so far.
        if isinstance(reasoning_end, int):
            reasoning_end = (reasoning_end,)
        self.budget = budget
        self.reasoning_end = None if budget == 0 else reasoning_end
        self._thought = 0
        self._tail: tuple[int, ...] = ()

    @classmethod
    def of(cls, structured: StructuredOutputsParams, params: SamplingParams | None = None) -> Guide:
        """The guide of a compiled constraint at its start; with ``params`` holding a thinking
        budget, one that applies after the span the budget bounds (see the module doc)."""
        compiled = compiled_index(structured)
        if params is not None and params.max_thinking_tokens is not None:
            return cls(compiled, params.thinking_end_token_ids, params.max_thinking_tokens)
        return cls(compiled, reasoning_end(structured))

    @property
    def active(self) -> bool:
        """Whether the constraint applies to the next token (not while the output thinks)."""
        return self.reasoning_end is None

    def replay(self, tokens: Sequence[int], num_forced: int = 0) -> Guide:
        """Advanced over a resumed request's outputs, ``num_forced`` of which a thinking budget
        forced (they follow its K-th thinking token: the live guide never saw them)."""
        forced = range(0)
        if num_forced and self.budget is not None:
            forced = range(self.budget, self.budget + num_forced)
        for i, token in enumerate(tokens):
            if i not in forced:
                self.advance(token)
        return self

    def advance(self, token: int) -> None:
        end = self.reasoning_end
        if end is not None:
            self._thought += 1
            self._tail = (*self._tail, token)[-len(end) :]
            # (Closed by its end ids, or by the budget: the engine forces the end after them.)
            if self._tail == end or (self.budget is not None and self._thought >= self.budget):
                self.reasoning_end = None
            return
        state = self.state
        if state is None:
            return
        compiled = self.compiled
        # (The end mark is never sampled: the end id stands for it where it may follow.)
        if token == compiled.eos and compiled.ends(state):
            self.state = None
            return
        try:
            self._cursor.advance(token, return_tokens=False)
        except ValueError:  # (a token the state does not allow)
            self.state = None
            return
        self.state = self._cursor.get_state()

    def allowed(self) -> list[int]:
        """The ids the next token may be: the index's, its end mark as the end id."""
        compiled = self.compiled
        if self.state is None:
            return [compiled.eos]
        ids = compiled.index.get_allowed_tokens(self.state)
        if END_ID not in ids:
            return ids
        ids = [t for t in ids if t != END_ID]
        return [*ids, compiled.eos] if compiled.ends(self.state) else ids

    def mask(self, width: int) -> torch.Tensor:
        """[width] bool on the host: ``allowed()`` as a mask (ids past ``width`` dropped)."""
        compiled, state = self.compiled, self.state
        if state is None:
            mask = torch.zeros(width, dtype=torch.bool)
        else:
            # The buffer covers the real ids (``size``: outlines-core checks it against its
            # count of ids, which the largest id may exceed) and not the end mark, 2**31 - 1,
            # which outlines-core leaves out of a buffer that ends before it; whether the mark
            # may follow is ``ends``, the end id's bit below.
            words = torch.empty((max(width, compiled.size) + 31) // 32, dtype=torch.int32)
            self._cursor.write_mask_into(words.data_ptr(), words.numel(), 4)
            mask = (words.unsqueeze(-1) & _BITS).ne(0).view(-1)[:width]
        if compiled.eos < width:
            mask[compiled.eos] = state is None or compiled.ends(state)
        return mask


class GuideMasks:
    """Device masks of guide states, by (constraint, state), the ``size`` last used kept: the
    samples of one request and the requests of one constraint share them (keyed by pattern,
    not by index object: a Ray replica restores an index per call). Owned by one ``Sampler``:
    one device, one vocabulary, one thread."""

    def __init__(self, size: int = MASKS_KEPT) -> None:
        self.size = size
        self._masks: OrderedDict[tuple[str, int, int | None, int], torch.Tensor] = OrderedDict()

    def mask(self, guide: Guide, width: int, device: torch.device) -> torch.Tensor:
        """[width] bool on ``device``: the ids ``guide``'s next token may be."""
        key = (guide.compiled.pattern, guide.compiled.eos, guide.state, width)
        mask = self._masks.get(key)
        if mask is not None:
            self._masks.move_to_end(key)
            return mask
        mask = self._masks[key] = move_to(guide.mask(width), device)
        if len(self._masks) > self.size:
            self._masks.popitem(last=False)
        return mask

    def apply(self, logits: torch.Tensor, guides: list[Guide], rows: list[int]) -> torch.Tensor:
        """A copy of ``logits`` [R, V] with -inf where row ``rows[k]``'s guide allows nothing."""
        width, device = logits.shape[1], logits.device
        allowed = torch.stack([self.mask(g, width, device) for g in guides])  # [G, V]
        if len(rows) == logits.shape[0] and rows == list(range(len(rows))):  # (every row guided)
            return torch.where(allowed, logits, float("-inf"))
        index = to_device(rows, device)
        masked = torch.where(allowed, logits.index_select(0, index), float("-inf"))
        return logits.index_copy(0, index, masked)

    @staticmethod
    def keep_ends(unbanned: torch.Tensor, banned: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``banned`` (logits [R, V] after min_tokens' bans) with guided row ``rows[k]`` as it
        was before them where they leave it nothing: a constraint matched in full allows only
        the end id, which min_tokens bans; the constraint wins, and the request stops."""
        index = to_device(rows, banned.device)
        before, after = unbanned.index_select(0, index), banned.index_select(0, index)
        dead = torch.isneginf(after).all(dim=-1, keepdim=True)  # [G, 1]
        return banned.index_copy(0, index, torch.where(dead, before, after))
