"""Prefix cache (DESIGN §8): full prompt blocks, shared on every plane by reference count.

Torch-free; the KV manager owns it and the scheduler only ever sees hashes and block ids.

A cached *entry* is one logical prompt block: the block ids holding its positions on every plane
of a request (core planes, then the boundary plane), all with the same KV because prompt tokens
always run every loop. It is named by a chained hash: block i's hash covers block i-1's hash and
block i's token ids, and block 0's covers a *salt* naming everything else the KV depends on
(model, weights version, dtype, block size, loops, Huginn's initial state; not the KV policy:
cached positions ran every loop, which writes the same KV under full and last_exited). The
digest is BLAKE2b-128, so two different prefixes never share an entry in practice.

Reference counting: the cache holds one reference on every block of an entry. An entry whose
blocks no request holds (count 1) is *evictable*: it stays hashed in least-recently-released
order until the pool needs blocks, then ``evict`` drops the cache's reference. With ``retain``
off (prompt sharing between the samples of one request, caching disabled), an entry is dropped
as soon as no request holds it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol


class RefCounts(Protocol):
    def ref_count(self, block: int) -> int: ...
    def incref(self, ids: list[int]) -> None: ...
    def free(self, ids: list[int]) -> None: ...


def block_hashes(
    salt: bytes, token_ids: list[int], block_size: int, parent: bytes | None = None
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none);
    ``parent``: the hash of the block before them, when they continue a chain."""
    out: list[bytes] = []
    if parent is None:
        parent = blake2b(salt, digest_size=16).digest()
    for i in range(len(token_ids) // block_size):
        chunk = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


def make_salt(*parts: object) -> bytes:
    """A salt from plain values (their ``repr``, which is stable for str/int/bool/None)."""
    return repr(parts).encode()


@dataclass(frozen=True)
class CachedBlock:
    key: bytes
    blocks: tuple[int, ...]  # one block id per plane, in ``KVManager.planes_of`` order


class PrefixCache:
    def __init__(self, pool: RefCounts, retain: bool = True) -> None:
        self.pool = pool
        self.retain = retain
        self._entries: dict[bytes, CachedBlock] = {}
        self._evictable: OrderedDict[bytes, CachedBlock] = OrderedDict()  # oldest release first
        self._num_evictable_blocks = 0
        self._num_blocks = 0  # sum of len(e.blocks) over _entries, kept as they change
        # At each request's first admission (re-admissions of a preempted one are not
        # counted: they would inflate the hit rate with the request's own blocks):
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which reused: found cached (or shared within a group)
        self.transfer_hits = 0  # PD decode stage: found cached but computed by the prefill stage
        # PD decode stage: prompt tokens the prefill stage moved here that were not hit (the
        # pool had no room, the file did not match, the request ended before admission).
        self.transfer_unused = 0
        self.evictions = 0  # entries evicted to make room

    # -- state ----------------------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_blocks(self) -> int:
        """Blocks the cache holds a reference on (in use by requests or evictable)."""
        return self._num_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable_blocks

    def held_blocks(self) -> list[int]:
        """Every block the cache holds a reference on (one item per reference)."""
        return [b for e in self._entries.values() for b in e.blocks]

    def evictable_in(self, entries: list[CachedBlock]) -> int:
        """Blocks of ``entries`` that are evictable now (a hit on them takes them out)."""
        return sum(len(e.blocks) for e in entries if e.key in self._evictable)

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, hashes: list[bytes], limit: int) -> list[CachedBlock]:
        """The cached entries of the longest prefix of ``hashes[:limit]``."""
        hits = []
        for key in hashes[:limit]:
            entry = self._entries.get(key)
            if entry is None:
                break
            hits.append(entry)
        return hits

    def record_query(
        self, num_tokens: int, num_hit: int, num_transferred: int = 0, num_unused: int = 0
    ) -> None:
        self.queries += num_tokens
        self.hits += num_hit
        self.transfer_hits += num_transferred
        self.transfer_unused += num_unused

    def acquire(self, entries: list[CachedBlock]) -> None:
        """A request takes a reference on every block of ``entries`` (a hit)."""
        for entry in entries:
            if self._evictable.pop(entry.key, None) is not None:
                self._num_evictable_blocks -= len(entry.blocks)
            self.pool.incref(list(entry.blocks))

    def give_back(self, entries: list[CachedBlock]) -> None:
        """Undoes ``acquire(entries)``: the references go, entries no one holds become
        evictable again."""
        self.pool.free([b for e in entries for b in e.blocks])
        self.release([e.key for e in entries])

    # -- changes --------------------------------------------------------------------------------

    def register(self, key: bytes, blocks: list[int]) -> bool:
        """Caches ``blocks`` (held by a request) under ``key``; False when ``key`` is already
        cached (the request's blocks then stay private to it)."""
        if key in self._entries:
            return False
        self.pool.incref(blocks)
        self._entries[key] = CachedBlock(key, tuple(blocks))
        self._num_blocks += len(blocks)
        return True

    def release(self, keys: list[bytes]) -> None:
        """A request dropped its blocks of the entries ``keys`` (after the pool counted the
        drop): entries no request holds any more become evictable, or go (``retain`` off)."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or key in self._evictable:
                continue  # invalidated meanwhile, or already released by another holder
            if self.pool.ref_count(entry.blocks[0]) != 1:
                continue  # another request still holds it
            if self.retain:
                self._evictable[key] = entry
                self._num_evictable_blocks += len(entry.blocks)
            else:
                del self._entries[key]
                self._num_blocks -= len(entry.blocks)
                self.pool.free(list(entry.blocks))

    def evict(self, num_blocks: int) -> int:
        """Frees least recently released entries until ``num_blocks`` blocks went back to the
        pool (or none is left); returns the blocks freed."""
        freed = 0
        while freed < num_blocks and self._evictable:
            key, entry = self._evictable.popitem(last=False)
            del self._entries[key]
            self._num_blocks -= len(entry.blocks)
            self._num_evictable_blocks -= len(entry.blocks)
            self.pool.free(list(entry.blocks))
            self.evictions += 1
            freed += len(entry.blocks)
        return freed

    def clear(self) -> None:
        """Forgets every entry (a weight update): evictable ones go back to the pool, and blocks
        requests still hold become private to them."""
        for entry in self._entries.values():
            self.pool.free(list(entry.blocks))
        self._entries.clear()
        self._evictable.clear()
        self._num_evictable_blocks = self._num_blocks = 0
