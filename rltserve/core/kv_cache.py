"""Paged KV bookkeeping: a reference-counted block pool and per-(request, plane) block tables.

Torch-free on purpose: the scheduler owns this state and only ever deals in block ids. The runner
turns a block table into slots (``slot = table[pos // block_size] * block_size + pos %
block_size``) and owns the KV tensors themselves.

Planes (DESIGN.md §4): loop ``d`` of a request reads and writes core plane ``policy.plane(d)``.
Models with prelude/coda attention (Huginn) also get one ``BOUNDARY`` plane per request.
Invariant: every plane of a request covers the same positions ``[0, covered)``; tables only
grow (``grow``, all planes at once, all or nothing) until ``free`` returns them all. Early exit
never frees planes. Whether a request reserves its whole context at admission or grows step by
step is the scheduler's choice.

A grown table is a new list, never the old one extended: a plan already handed to the runner
keeps the table it was built with.

Prefix caching (``prefix_cache.py``): a request's leading table entries may be cached blocks
shared by reference count with other requests and the cache (every plane's copy of one prompt
block under one chained hash). Nothing ever writes a shared block: only full prompt blocks below
the last prompt token are shared, and prompt KV is final once computed. Evictable cached blocks
count as free: ``allocate``/``grow`` evict them (least recently released first) when the free
list is short, so eviction always comes before preemption.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from rltserve.core.prefix_cache import CachedBlock, PrefixCache

# Re-exported: the policy is parsed by the config, below the core; its home is rltserve.kv_policy.
from rltserve.kv_policy import POLICY_KINDS, KVPolicy  # noqa: F401

BOUNDARY = -1  # plane index of the prelude/coda ("boundary") plane


class NoFreeBlocks(RuntimeError):
    """Not enough free blocks for an allocation; nothing was allocated."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"need {requested} KV blocks, {available} free")
        self.requested = requested
        self.available = available


class BlockPool:
    """Fixed set of block ids with reference counts.

    Invariant: a block is in the free list iff its count is 0. ``allocate`` hands out the lowest
    free ids first, so allocation order is deterministic.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks))  # a heap (sorted, hence already a valid heap)

    @property
    def num_total(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs) - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with count 1; raises ``NoFreeBlocks`` (allocating none) if short."""
        if n < 0:
            raise ValueError(f"n={n}: must be >= 0")
        if n > len(self._free):
            raise NoFreeBlocks(n, len(self._free))
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        """Add a reference to blocks that are already in use (sharing)."""
        for b in ids:
            if self._refs[b] == 0:
                raise ValueError(f"block {b} is free; incref needs a block in use")
        for b in ids:
            self._refs[b] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference per id; a block returns to the free list at count 0.

        Raises ``ValueError`` on a free block (double free) before changing anything, also
        when the same id appears more often than its count allows.
        """
        drops: dict[int, int] = {}
        for b in ids:
            drops[b] = drops.get(b, 0) + 1
        for b, n in drops.items():
            if self._refs[b] < n:
                raise ValueError(f"double free of block {b}")
        for b, n in drops.items():
            self._refs[b] -= n
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)


@dataclass
class _RequestKV:
    num_tokens: int  # positions every plane covers
    num_loops: int
    tables: dict[int, list[int]] = field(default_factory=dict)  # plane (or BOUNDARY) -> blocks
    cached: list[bytes] = field(default_factory=list)  # keys of cache entries it holds blocks of
    depth_tables: list[list[int]] | None = None  # ``KVManager.depth_tables``, until tables change


def slot(table: list[int], position: int, block_size: int) -> int:
    """Flat KV slot of ``position`` under ``table`` (the runner does this vectorized)."""
    return table[position // block_size] * block_size + position % block_size


class KVManager:
    """Block tables of every admitted request, one per (request, plane).

    ``allocate`` registers a request with every plane covering ``num_tokens`` positions (0 is
    allowed: on-demand allocation grows it later), ``grow`` extends every plane, ``free``
    releases everything.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: KVPolicy,
        has_boundary: bool,
        retain_cached: bool = True,
    ):
        """``retain_cached``: keep cached prompt blocks no request holds until the pool needs
        them (prefix caching on); off, they are freed at once (sharing within a group only)."""
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.block_size = block_size
        self.policy = policy
        self.has_boundary = has_boundary
        self.pool = BlockPool(num_blocks)
        self.cache = PrefixCache(self.pool, retain=retain_cached)
        self._requests: dict[str, _RequestKV] = {}
        self._plane_of_depth: list[int] = [-1]  # policy.plane(d) at index d >= 1

    # -- capacity -------------------------------------------------------------------------------

    def planes_of(self, num_loops: int) -> list[int]:
        """Plane indices a request holds: core planes 0..P-1, then ``BOUNDARY`` if any."""
        planes = list(range(self.policy.num_planes(num_loops)))
        return planes + [BOUNDARY] if self.has_boundary else planes

    def blocks_needed(self, num_tokens: int, num_loops: int) -> int:
        per_plane = -(-num_tokens // self.block_size)
        return per_plane * len(self.planes_of(num_loops))

    def can_allocate(self, num_tokens: int, num_loops: int) -> bool:
        return self.blocks_needed(num_tokens, num_loops) <= self.num_free_blocks

    def blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        """Blocks ``grow(request_id, num_tokens)`` would take (0 when already covered)."""
        entry = self._requests[request_id]
        have = -(-entry.num_tokens // self.block_size)
        want = -(-num_tokens // self.block_size)
        return max(0, want - have) * len(entry.tables)

    def extend(self, request_id: str, num_tokens: int) -> int:
        """``grow(request_id, num_tokens)`` when it takes no block (returns 0); else the blocks
        it would take, with nothing changed. (A decode token needs a block every block_size
        tokens: one call answers and covers the others.)"""
        entry = self._requests[request_id]
        need = -(-num_tokens // self.block_size) - -(-entry.num_tokens // self.block_size)
        if need > 0:
            return need * len(entry.tables)
        if num_tokens > entry.num_tokens:
            entry.num_tokens = num_tokens
        return 0

    def covered(self, request_id: str) -> int:
        """Positions ``[0, covered)`` that every plane of the request has blocks for."""
        return self._requests[request_id].num_tokens

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free ones and evictable cached ones."""
        return self.pool.num_free + self.cache.num_evictable_blocks

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use (evictable cached blocks count as free)."""
        used = self.pool.num_used - self.cache.num_evictable_blocks
        return used / self.pool.num_total

    def _take(self, n: int) -> list[int]:
        """``n`` fresh blocks, evicting cached ones when the free list is short; all or
        nothing (``NoFreeBlocks``)."""
        pool = self.pool
        if n > pool.num_free:  # (the free list alone usually has them)
            if n > self.num_free_blocks:
                raise NoFreeBlocks(n, self.num_free_blocks)
            self.cache.evict(n - pool.num_free)
        return pool.allocate(n)

    # -- lifetime -------------------------------------------------------------------------------

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        num_loops: int,
        prefix: list[CachedBlock] | None = None,
    ) -> None:
        """Reserve every plane's table for positions ``[0, num_tokens)``; the first
        ``len(prefix)`` blocks of each plane are the cached ``prefix`` entries (shared).

        All or nothing: raises ``NoFreeBlocks`` with nothing allocated when the pool is short, and
        ``ValueError`` if the request already holds KV.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens}: must be >= 0")
        planes = self.planes_of(num_loops)
        per_plane = -(-num_tokens // self.block_size)
        prefix = prefix or []
        shared = len(prefix)
        if shared > per_plane or any(len(e.blocks) != len(planes) for e in prefix):
            raise ValueError(f"prefix of {shared} blocks does not fit {per_plane} per plane")
        self.cache.acquire(prefix)  # first: the eviction below must not take them
        fresh = per_plane - shared
        try:
            ids = self._take(fresh * len(planes))
        except NoFreeBlocks:
            self.cache.give_back(prefix)
            raise
        entry = _RequestKV(num_tokens, num_loops, cached=[e.key for e in prefix])
        for i, plane in enumerate(planes):
            head = [e.blocks[i] for e in prefix]
            entry.tables[plane] = head + ids[i * fresh : (i + 1) * fresh]
        self._requests[request_id] = entry

    def cache_blocks(self, request_id: str, first: int, keys: list[bytes]) -> None:
        """Caches blocks ``first``, ``first + 1``, ... of every plane of the request under
        ``keys`` (a prompt chunk's full blocks: its tables looked up once). The caller
        guarantees their KV is final on every plane and that nothing writes it again."""
        entry = self._requests[request_id]
        tables = [entry.tables[plane] for plane in self.planes_of(entry.num_loops)]
        register, cached = self.cache.register, entry.cached
        for index, key in enumerate(keys, first):
            if register(key, [table[index] for table in tables]):
                cached.append(key)

    def adopt_cached(
        self,
        keys: list[bytes],
        num_loops: int,
        held: list[CachedBlock],
        write: Callable[[list[int]], None],
    ) -> int:
        """Caches prompt blocks whose KV comes from elsewhere (another stage's prompt:
        ``kv_transfer``): fresh blocks for as many leading ``keys`` as the pool has room for
        without evicting ``held`` (the cached entries in front of them). ``write(blocks)``
        fills them (entry by entry, each in ``planes_of`` order) before they are cached; if it
        raises they go back to the pool. Each entry is evictable at once; the run stops at a
        key cached already. Returns the entries cached."""
        planes = len(self.planes_of(num_loops))
        self.cache.acquire(held)  # the eviction below must not take them
        try:
            fit = min(len(keys), self.num_free_blocks // planes)
            ids = self._take(fit * planes)
        finally:
            self.cache.give_back(held)
        try:
            if ids:
                write(ids)
        except BaseException:
            self.pool.free(ids)
            raise
        for i in range(fit):
            blocks = ids[i * planes : (i + 1) * planes]
            if not self.cache.register(keys[i], blocks):
                self.pool.free(ids[i * planes :])
                return i
            self.pool.free(blocks)  # the cache's reference stays: evictable
            self.cache.release([keys[i]])
        return fit

    def copy_targets(self, source_id: str, request_id: str, index: int) -> list[tuple[int, int]]:
        """(source block, request block) of block ``index`` on every plane: the copy that
        gives a request another's partly filled prompt block."""
        src, dst = self._requests[source_id], self._requests[request_id]
        planes = self.planes_of(dst.num_loops)
        if self.planes_of(src.num_loops) != planes:
            raise ValueError(f"{source_id!r} and {request_id!r} have different planes")
        return [(src.tables[p][index], dst.tables[p][index]) for p in planes]

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Extends every plane to cover ``[0, num_tokens)``; a no-op when already covered.
        All or nothing: raises ``NoFreeBlocks`` with nothing allocated when the pool is short."""
        entry = self._requests[request_id]
        have = -(-entry.num_tokens // self.block_size)
        want = -(-num_tokens // self.block_size)
        if want > have:
            extra = want - have
            ids = self._take(extra * len(entry.tables))
            for i, plane in enumerate(entry.tables):
                entry.tables[plane] = entry.tables[plane] + ids[i * extra : (i + 1) * extra]
            entry.depth_tables = None
        entry.num_tokens = max(entry.num_tokens, num_tokens)

    def all_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """The blocks holding positions ``[0, num_tokens)`` on every plane, plane by plane in
        ``planes_of`` order: the layout swap space stores a request's KV in."""
        entry = self._requests[request_id]
        if num_tokens > entry.num_tokens:
            raise ValueError(f"num_tokens={num_tokens}: request covers {entry.num_tokens}")
        n = -(-num_tokens // self.block_size)
        return [b for plane in self.planes_of(entry.num_loops) for b in entry.tables[plane][:n]]

    def free(self, request_id: str) -> None:
        """Release all of a request's blocks. An unknown id raises ``KeyError``: the scheduler
        always knows whether it admitted a request, so a miss is a bookkeeping bug."""
        entry = self._requests.pop(request_id)
        self.pool.free([b for table in entry.tables.values() for b in table])
        self.cache.release(entry.cached)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # -- lookups --------------------------------------------------------------------------------

    def block_table(self, request_id: str, plane: int) -> list[int]:
        """The table of one plane (``BOUNDARY`` for the boundary plane). Do not mutate it."""
        tables = self._requests[request_id].tables
        if plane not in tables:
            raise KeyError(f"request {request_id!r} has no plane {plane}")
        return tables[plane]

    def table_for_depth(self, request_id: str, depth: int) -> list[int]:
        """The table loop ``depth`` (1..num_loops of the request) reads and writes."""
        entry = self._requests[request_id]
        if not 1 <= depth <= entry.num_loops:
            raise ValueError(f"depth={depth}: request {request_id!r} has {entry.num_loops} loops")
        return entry.tables[self._plane(depth)]

    def depth_tables(self, request_id: str) -> list[list[int]]:
        """The tables of the request's loops 1..num_loops (index d - 1), as ``table_for_depth``
        gives them (planes shared by several depths give the same list). The same list until
        the tables change (``grow``), so a reader may tell new tables by identity. Do not
        mutate it."""
        entry = self._requests[request_id]
        if entry.depth_tables is None:
            self._plane(entry.num_loops)
            tables = entry.tables
            entry.depth_tables = [tables[p] for p in self._plane_of_depth[1 : entry.num_loops + 1]]
        return entry.depth_tables

    def _plane(self, depth: int) -> int:
        """``policy.plane(depth)``, remembered: planning asks it for every row of every step."""
        planes = self._plane_of_depth
        while len(planes) <= depth:
            planes.append(self.policy.plane(len(planes)))
        return planes[depth]

    def boundary_table(self, request_id: str) -> list[int]:
        if not self.has_boundary:
            raise KeyError("this KV manager has no boundary plane")
        return self._requests[request_id].tables[BOUNDARY]

    def exit_copy_blocks(
        self, request_id: str, position: int, depth: int, num_loops: int
    ) -> list[int]:
        """Blocks holding ``position`` in the planes of depths ``depth+1 .. num_loops``, in depth
        order, for copy-on-exit (``ring:k``: up to depth k, ``KVPolicy.copy_depths``). Asked
        only for requests whose policy copies (the engine's, or a request's ``last_exited`` on
        a ``full`` engine: the same planes); ``[]`` where the engine's planes take no copies
        (``shared``, ``ring:1``)."""
        if not (self.policy.copies_on_exit or self.policy.per_depth):
            return []
        entry = self._requests[request_id]
        if not 0 <= position < entry.num_tokens:
            raise ValueError(f"position={position}: request {request_id!r} has {entry.num_tokens}")
        if num_loops > entry.num_loops:
            raise ValueError(f"num_loops={num_loops}: request has {entry.num_loops} loops")
        index = position // self.block_size
        tables, plane = entry.tables, self._plane
        top = self.policy.copy_depths(num_loops)
        return [tables[plane(d)][index] for d in range(depth + 1, top + 1)]

    # -- checks ---------------------------------------------------------------------------------

    def check_no_leaks(self) -> None:
        """Raise ``AssertionError`` unless every block's count equals the number of tables and
        cache entries that hold it (so with no requests, every block is free or cached and
        evictable)."""
        expected = [0] * self.pool.num_total
        held = self.cache.held_blocks()
        if len(held) != self.cache.num_blocks:
            raise AssertionError(f"cache counts {self.cache.num_blocks} blocks, holds {len(held)}")
        for b in held:
            expected[b] += 1
        for entry in self._requests.values():
            for table in entry.tables.values():
                for b in table:
                    expected[b] += 1
        actual = [self.pool.ref_count(b) for b in range(self.pool.num_total)]
        if expected != actual:
            bad = [b for b in range(len(actual)) if expected[b] != actual[b]]
            raise AssertionError(f"KV block counts disagree with the tables at blocks {bad[:16]}")
        if self.pool.num_free != actual.count(0):
            raise AssertionError("free list disagrees with the reference counts")
        if not self._requests and self.num_free_blocks != self.pool.num_total:
            raise AssertionError("with no requests, every block must be free or evictable")
