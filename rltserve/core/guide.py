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
vLLM's reasoning parsers do.

Where the regex is matched in full and nothing may follow, only the end id is allowed: the
request stops there ("stop"). A token the guide cannot take (never sampled under its mask; a
forced one) leaves it at that end too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from rltserve.core.staging import move_to, to_device
from rltserve.guide_index import END_ID, GuideIndex, compiled_index, reasoning_end
from rltserve.structured import StructuredOutputsParams

# Device masks a sampler keeps (least recently used go): [V] bools, 150 KB each at a 150k
# vocabulary.
MASKS_KEPT = 512


class Guide:
    """A request's state in its compiled constraint (``state``: None once it ended); advanced
    by each token the request samples."""

    def __init__(self, compiled: GuideIndex, reasoning_end: int | None = None) -> None:
        self.compiled = compiled
        self.state: int | None = compiled.index.get_initial_state()  # None: at the end
        # The id that ends the thinking span before the constraint applies; None once it has
        # (or where there was none).
        self.reasoning_end = reasoning_end

    @classmethod
    def of(cls, structured: StructuredOutputsParams) -> Guide:
        """The guide of a compiled constraint at its start."""
        return cls(compiled_index(structured), reasoning_end(structured))

    @property
    def active(self) -> bool:
        """Whether the constraint applies to the next token (not while the output thinks)."""
        return self.reasoning_end is None

    def replay(self, tokens: Iterable[int]) -> Guide:
        for token in tokens:
            self.advance(token)
        return self

    def advance(self, token: int) -> None:
        if self.reasoning_end is not None:
            if token == self.reasoning_end:
                self.reasoning_end = None
            return
        state = self.state
        if state is None:
            return
        compiled = self.compiled
        if token == compiled.eos and compiled.ends(state):
            self.state = None
            return
        self.state = compiled.index.get_next_state(state, token)

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


class GuideMasks:
    """Device masks of guide states, by (constraint, state), the ``size`` last used kept: the
    samples of one request and the requests of one constraint share them (each request's
    index arrives as its own copy from a worker's pipe, so they are keyed by pattern, not by
    object). Owned by one ``Sampler``: one device, one vocabulary, one thread."""

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
        ids = [t for t in guide.allowed() if t < width]
        mask = torch.zeros(width, dtype=torch.bool)
        mask[ids] = True
        mask = self._masks[key] = move_to(mask, device)
        if len(self._masks) > self.size:
            self._masks.popitem(last=False)
        return mask

    def apply(self, logits: torch.Tensor, guides: list[Guide], rows: list[int]) -> torch.Tensor:
        """A copy of ``logits`` [R, V] with -inf where row ``rows[k]``'s guide allows nothing."""
        width, device = logits.shape[1], logits.device
        allowed = torch.stack([self.mask(g, width, device) for g in guides])  # [G, V]
        index = to_device(rows, device)
        masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
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
