"""Prompt sharing for the scheduler (DESIGN §8): prefix-cache hits at admission, caching of
finished prompt blocks (and of generated ones that were computed as prompt blocks are), and the
samples of one prompt (a *group*) reusing its prefill.

Torch-free, like the scheduler it serves. Why it is exact: under a per-depth KV policy
(``full``, ``last_exited``) prompt tokens run every loop, so a prompt block's KV on every plane
depends only on the tokens up to it and on what the request's salt names (``Request.cache_salt``).

- Hit: at admission a request takes the longest cached prefix of its full prompt blocks, never
  the block of its last prompt token (that token's final state gives the first output), and
  starts computing after it. A swap-resumed request gets its KV from swap space instead.
- Caching: a prompt block is cached once every prompt position up to its end has run its last
  loop *and that result was applied* (so a failed step never caches garbage, and any later
  step that reads the block runs after the steps that wrote it).
- Generated tokens: when a request ends (stop, length or abort: the front end ends an answer
  at a stop string with one), the full blocks after its prompt whose every position looped
  the request's whole depth (its output there exited at ``num_loops``: a fixed full depth, the
  chat default) and whose KV is final are cached too, chained after the prompt's: their KV on
  every plane is what a prompt holding those tokens computes, so the next turn of a
  conversation, whose prompt repeats this one and its answer, hits them. A position that
  exited earlier has KV a prompt never has (copies, or loops still to run under ``full``);
  the blocks from its own on are not cached.
- In flight: a request whose first uncached prompt block is being computed by a running
  request waits until that block is cached instead of computing it again, so a burst of
  requests sharing a prompt prefix computes the prefix once. When the computing request stops
  running (it ends, fails, is aborted or preempted) its claims go: the first waiting request
  computes the rest after the blocks cached so far, and the others wait for it.
- Groups: the first request added with a group key leads; the others (followers, e.g. the
  samples of HTTP ``n``) wait while the leader computes its prompt, then share its full prompt
  blocks through the cache and get a copy of its partly filled last prompt block (the runner's
  block copy, ``StepPlan.block_copies``), so each computes only the last prompt token. A
  follower whose leader is gone or was preempted just computes what it does not hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rltserve.core.prefix_cache import CachedBlock, block_hashes
from rltserve.core.request import Request, RequestStatus, Resume

if TYPE_CHECKING:
    from rltserve.core.scheduler import Scheduler


@dataclass(frozen=True)
class Hit:
    """What admission reuses: cached ``entries`` and, for a follower, the leader to copy the
    partly filled last prompt block from; computing starts at position ``start``."""

    entries: list[CachedBlock] = field(default_factory=list)
    start: int = 0
    source: str | None = None


NO_HIT = Hit()


class PromptSharing:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self._leaders: dict[str, str] = {}  # group key -> request id of its leader
        self._copies: list[tuple[int, int]] = []  # for the plan being built
        # Prompt blocks not cached yet -> the request computing them. Invariant: that request
        # is running (``release`` drops its entries when it ends or is preempted), so a
        # request waiting for a block always waits for one that is being computed.
        self._computing: dict[bytes, str] = {}

    def take_copies(self) -> list[tuple[int, int]]:
        out, self._copies = self._copies, []
        return out

    # ---------------------------------------------------------------- lifetime

    def on_add(self, request: Request) -> None:
        if request.group is not None:
            self._leaders.setdefault(request.group, request.request_id)

    def forget(self, request: Request) -> None:
        if request.transfer is not None:  # ended before admission read its moved prompt KV
            request.transfer = None
            bs = self.s.kv.block_size
            self.s.kv.cache.transfer_unused += reusable_blocks(request, bs) * bs
        if request.group is not None and self._leaders.get(request.group) == request.request_id:
            del self._leaders[request.group]

    def release(self, request: Request) -> None:
        """The request stops running (it ended, failed, was aborted or preempted): the prompt
        blocks it was computing are nobody's, so the first request waiting for one is admitted
        to compute it (after the blocks already cached) and the others wait for that one. Its
        entries are among its prompt blocks not cached yet (``on_prompt_done`` drops the
        others)."""
        if request.block_hashes is None:
            return
        rid, computing = request.request_id, self._computing
        for key in request.block_hashes[request.blocks_cached :]:
            if computing.get(key) == rid:
                del computing[key]

    def _leader(self, request: Request) -> Request | None:
        if request.group is None or not request.reuses_prompt:
            return None
        rid = self._leaders.get(request.group)
        return None if rid is None or rid == request.request_id else self.s.requests.get(rid)

    def waits_for_leader(self, request: Request) -> bool:
        """A follower whose running leader has not finished its prompt."""
        leader = self._leader(request)
        return (
            leader is not None
            and leader.status is RequestStatus.RUNNING
            and leader.prompt_final < leader.num_prompt_tokens
        )

    def waits(self, request: Request) -> bool:
        """A follower is not admitted while its running leader has not finished its prompt,
        nor any request while a running one computes its first uncached prompt block."""
        if self.waits_for_leader(request):
            return True
        if not _hits(request):
            return False
        limit = reusable_blocks(request, self.s.kv.block_size)
        cached = len(self.s.kv.cache.lookup(request.block_hashes, limit))
        if cached == limit:
            return False
        # (Its computer is running, so it is not this waiting request.)
        return request.block_hashes[cached] in self._computing

    # ---------------------------------------------------------------- admission

    def lookup(self, request: Request) -> Hit:
        """The reusable prefix of a request being admitted (not acquired yet)."""
        if not _hits(request):
            return NO_HIT
        p, bs = request.num_prompt_tokens, self.s.kv.block_size
        limit = reusable_blocks(request, bs)
        entries = self.s.kv.cache.lookup(request.block_hashes, limit)
        leader = self._leader(request)
        if (
            len(entries) == limit
            and (p - 1) % bs
            and leader is not None
            and leader.admitted
            and leader.prompt_final >= p
            and leader.cache_salt == request.cache_salt
            and leader.prompt_token_ids == request.prompt_token_ids
        ):
            return Hit(entries, p - 1, leader.request_id)
        return Hit(entries, len(entries) * bs) if entries else NO_HIT

    def admitted(self, request: Request, hit: Hit) -> None:
        """After the request's blocks were allocated with ``hit.entries`` in front."""
        bs = self.s.kv.block_size
        p = request.num_prompt_tokens
        request.final_pending = {}
        if request.resume is Resume.SWAP:  # its KV comes back from swap space
            request.prompt_final = min(request.swapped_tokens, p)
            request.blocks_cached = request.prompt_final // bs
            return
        request.prompt_final = hit.start
        request.blocks_cached = len(hit.entries)
        if request.block_hashes is not None:
            for key in request.block_hashes[len(hit.entries) :]:
                self._computing.setdefault(key, request.request_id)
        if request.num_cached_tokens is None:  # its first admission
            self._first_hit(request, hit.start)
        if hit.source is not None:
            rid = request.request_id
            self._copies += self.s.kv.copy_targets(hit.source, rid, len(hit.entries))

    def _first_hit(self, request: Request, start: int) -> None:
        """At a request's first admission, which starts computing at ``start``: the prompt
        tokens it reuses, and the prefix cache's counters (a preempted request's re-admissions
        count nowhere). With KV imported from a prefill stage (PD), the hit's blocks were
        computed there but for those the prefill stage itself reused: only tokens computed on
        neither stage count as reused, the rest as transferred."""
        reused = start
        if request.prefill_cached_tokens is not None:
            reused = min(start, request.prefill_cached_tokens)
        request.num_cached_tokens = reused
        if request.block_hashes is not None:
            unused = max(0, request.transfer_tokens - start)  # (evicted, or no room to read)
            cache = self.s.kv.cache
            cache.record_query(request.num_prompt_tokens, reused, start - reused, unused)

    def admission_blocks(self, request: Request, hit: Hit) -> int:
        """Blocks of the pool's free count that ``hit`` itself uses up: shared blocks are not
        allocated, but evictable ones stop being available."""
        planes = len(self.s.kv.planes_of(request.num_loops))
        return self.s.kv.cache.evictable_in(hit.entries) - len(hit.entries) * planes

    # ---------------------------------------------------------------- results

    def on_prompt_done(self, request: Request, start: int, end: int) -> None:
        """A prompt item's last loop was applied: positions [start, end) are final. Caches the
        full prompt blocks below the first position not final yet (items may complete out of
        order within a step)."""
        request.final_pending[start] = end
        while request.prompt_final in request.final_pending:
            request.prompt_final = request.final_pending.pop(request.prompt_final)
        if request.block_hashes is None:
            return
        p, bs = request.num_prompt_tokens, self.s.kv.block_size
        upto = min(request.prompt_final, p) // bs
        first = request.blocks_cached
        if upto > first:
            keys = request.block_hashes[first:upto]
            self.s.kv.cache_blocks(request.request_id, first, keys)
            computing = self._computing
            for key in keys:
                if computing.get(key) == request.request_id:
                    del computing[key]
        request.blocks_cached = max(request.blocks_cached, upto)

    def on_finished(self, request: Request, final: int) -> None:
        """A request ended with its outputs (stop, length or abort), its KV still held: caches
        the full blocks of its generated tokens that a prompt would have computed the same way
        (see the module doc), after its prompt's, below ``final`` (positions past it may still
        be computing: a recompute's replay, or a forced token's)."""
        if request.block_hashes is None or request.first_coda_at or not self.s.kv.cache.retain:
            return
        p, loops = request.num_prompt_tokens, request.num_loops
        depths = request.exit_depths
        # Positions p-1 .. p+k-2 produced outputs 0 .. k-1; the last output was never an input.
        written = min(p + len(request.output_token_ids) - 1, final)
        end = p - 1
        while end < written and depths[end - p + 1] >= loops:
            end += 1
        bs = self.s.kv.block_size
        first, upto = request.blocks_cached, end // bs
        if upto <= first or first < p // bs:  # (nothing new, or the prompt's chain is broken)
            return
        tokens = request.prompt_token_ids + request.output_token_ids[: upto * bs - p]
        parent = request.block_hashes[first - 1] if first else None  # (the prompt's chain)
        keys = block_hashes(request.cache_salt, tokens[first * bs :], bs, parent)
        self.s.kv.cache_blocks(request.request_id, first, keys)
        request.blocks_cached = upto


def final_positions(request: Request) -> int:
    """Positions ``[0, n)`` whose KV is final, for ``on_finished``: those below every item
    whose work is not done (an item is done once its output is recorded: every loop of its rows
    ran) and below the first position no item covered yet. An abort may come while a recompute
    replays the answer, or a forced token's position runs, below the last output."""
    outputs = len(request.output_token_ids)
    starts = [
        item.start
        for item in request.items
        if not (item.has_output and item.output_index < outputs)
    ]
    return min([request.num_scheduled, *starts])


def reusable_blocks(request: Request, block_size: int) -> int:
    """The prompt blocks a hit may cover: the full blocks before the last prompt token (which
    is always computed)."""
    return (request.num_prompt_tokens - 1) // block_size


def _hits(request: Request) -> bool:
    """Whether admission looks up cached prompt blocks for it (a swap-resumed request gets
    its KV back from swap space)."""
    return (
        request.block_hashes is not None
        and request.resume is not Resume.SWAP
        and request.reuses_prompt
    )
