"""``CarriedRows``: the decode tokens the runner runs by itself (``plan.Carry``).

A carried token's first loop comes in a plan; the runner keeps a ``WorkItem`` of its own for it
and moves it one loop deeper before each later step (its block table, exit spec and
copy-on-exit targets for that depth come from the ``Carry``), until the step in which it ends
or its request is dropped. Carried rows run first in a step, in the order they were carried, so
a decode batch keeps its row order from step to step (``PendingRows`` then passes states on).

Invariant: a step's ``WorkItem``s are not changed while it runs; a carried one is moved to its
next depth only when the next step is built, and the earlier step reads no field that moves
(depth, tables, exit spec, copy targets) after its ``run``.
"""

from __future__ import annotations

from collections.abc import Collection

from rltserve.core.plan import CarriedResult, ItemResult, WorkItem


class CarriedRows:
    def __init__(self) -> None:
        self.items: list[WorkItem] = []  # the runner's own items, at the depth last run

    def drop(self, request_ids: Collection[str]) -> None:
        """Forgets the tokens of requests the runner no longer runs."""
        if self.items and request_ids:
            self.items = [w for w in self.items if w.request_id not in request_ids]

    def clear(self) -> None:
        self.items = []

    def advance(self) -> list[WorkItem]:
        """Moves every carried token to its next loop; returns them, in carry order."""
        for w in self.items:
            d = w.depth + 1
            w.depth = d
            c = w.carry
            w.block_table = c.tables[d - 1]
            if c.exit_at:
                w.exit = c.specs[d >= c.exit_at]
            if c.copy_blocks:
                w.exit_copy_blocks = c.copy_blocks[d:]
        return self.items

    def keep(self, items: list[WorkItem], num_carried: int, ending: Collection[int]) -> None:
        """After a step over ``items`` (its first ``num_carried`` the carried ones): the tokens
        that go on are the carried ones that did not end, then the plan's new carried
        tokens, as the runner's own copies."""
        kept = (
            self.items
            if not ending
            else [w for i, w in enumerate(items[:num_carried]) if i not in ending]
        )
        fresh = [
            _own(w)
            for i, w in enumerate(items[num_carried:], num_carried)
            if w.carry is not None and i not in ending
        ]
        self.items = kept + fresh if fresh else kept


def events(
    items: list[WorkItem],
    depths: list[int],
    results: list[ItemResult | None],
    rows: Collection[int],
    ending: Collection[int],
) -> list[CarriedResult]:
    """The carried rows' (``items``, first in the step) events, for the scheduler: ``rows``
    are those with a result (an exit, a delayed decision) or that ended (``ending``)."""
    out = []
    for i in sorted(rows):
        w = items[i]
        out.append(CarriedResult(w.carry.key, w.request_id, depths[i], i in ending, results[i]))
    return out


def _own(w: WorkItem) -> WorkItem:
    """A copy of a plan's carried item (plans are never changed once built)."""
    return WorkItem(
        w.request_id,
        w.start,
        w.num_tokens,
        w.depth,
        w.ends_at,
        w.stop_at_exit,
        w.block_table,
        None,
        w.boundary_table,
        w.exit,
        w.exit_copy_blocks,
        False,
        w.epoch,
        w.carry,
    )
