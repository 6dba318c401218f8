"""Bounded concurrency and queueing in front of the engine.

At most ``max_concurrent`` sequences are in the engine at once (a request with n choices holds n
slots); up to ``max_queued`` requests wait for slots in (priority, arrival) order, the engine's
``--scheduling-policy priority`` order (FIFO under fcfs, where every priority is 0). A FIFO
queue here would undo priority scheduling whenever it holds anyone: a better-priority request
would wait behind every worse one queued before it, never reaching the engine that would let it
overtake them. A request beyond ``max_queued`` is refused at once with ``Overloaded`` (the
server answers 503 + Retry-After, so a load balancer can try elsewhere), unless it is better
than the worst queued one, which is refused in its place. A waiter that is cancelled (client
gone) leaves the queue without a trace. A closed gate (the server drains) refuses its waiters and
later requests at once, rather than hold them for slots they would get only to be refused.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass


class Overloaded(Exception):
    """No slot free and the queue is full."""


@dataclass(eq=False)  # compared by identity: each waiter is one request
class _Waiter:
    weight: int
    future: asyncio.Future[None]
    key: tuple[int, int]  # (priority, arrival): lower is let in first


class AdmissionGate:
    def __init__(self, max_concurrent: int, max_queued: int) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.in_use = 0
        self._waiters: list[_Waiter] = []  # in ``key`` order
        self._arrivals = itertools.count()
        self._closed: str | None = None  # why the gate refuses every request now

    def close(self, reason: str) -> None:
        """Refuses the waiters and every later request (``Overloaded(reason)``); slots already
        held stay until released."""
        self._closed = reason
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.future.done():
                waiter.future.set_exception(Overloaded(reason))

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slots(self, weight: int = 1, priority: int = 0) -> AsyncIterator[None]:
        """Holds ``weight`` slots for the body; raises Overloaded or ValueError (weight too big).
        Waiters are let in by ``priority`` (lower first), then arrival."""
        await self._acquire(weight, priority)
        try:
            yield
        finally:
            self._release(weight)

    async def _acquire(self, weight: int, priority: int) -> None:
        if weight > self.max_concurrent:
            raise ValueError(
                f"n={weight}: exceeds the server's max_concurrent={self.max_concurrent}"
            )
        if self._closed is not None:
            raise Overloaded(self._closed)
        if not self._waiters and self.in_use + weight <= self.max_concurrent:
            self.in_use += weight
            return
        if len(self._waiters) >= self.max_queued:
            worst = self._waiters[-1] if self._waiters else None
            if worst is None or worst.key[0] <= priority:
                raise Overloaded("the server is at capacity and its queue is full")
            # A full queue of worse requests (a batch flood) must not turn a better one away:
            # the worst queued gets the 503 it would have got arriving now.
            self._waiters.pop()
            if not worst.future.done():
                worst.future.set_exception(
                    Overloaded("the server is at capacity; a better priority took its place")
                )
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(weight, future, (priority, next(self._arrivals)))
        bisect.insort(self._waiters, waiter, key=_key)
        # Ahead of a head too big for the free slots (n > 1), it may fit now: it does not wait
        # for a release.
        self._wake()
        try:
            await waiter.future
        except asyncio.CancelledError:
            granted = waiter.future.done() and not waiter.future.cancelled()
            if granted and waiter.future.exception() is None:
                self._release(weight)  # granted in the same instant as the cancel
            else:
                # Still queued, unless a release in the turn it was cancelled dropped it.
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                self._wake()
            raise

    def _release(self, weight: int) -> None:
        self.in_use -= weight
        self._wake()

    def _wake(self) -> None:
        # In order: the head waiter blocks later, smaller ones so a big request cannot starve.
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():  # cancelled, its task not yet run: it takes no slot
                self._waiters.pop(0)
                continue
            if self.in_use + waiter.weight > self.max_concurrent:
                return
            self._waiters.pop(0)
            self.in_use += waiter.weight
            waiter.future.set_result(None)


def _key(waiter: _Waiter) -> tuple[int, int]:
    return waiter.key
