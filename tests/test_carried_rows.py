"""``CarriedRows`` (``core/carried.py``), the runner's carried decode tokens, by hand: rows
advance one loop a step, keep their order, drop ended and released tokens, continue an ended
token at its next position (in a new block with its new tables), and share the exit-spec
columns across depths. Engine-level schedules against the oracle: ``test_carried.py``."""

from __future__ import annotations

import pytest

from rltserve.core.block_tables import BlockTables
from rltserve.core.carried import CarriedRows
from rltserve.core.plan import Carry, ExitSpec, WorkItem


def spec_row(spec: ExitSpec) -> tuple:
    """An exit spec as the columns ``CarriedRows.specs`` compares by."""
    return (spec.mode, spec.exit_now, spec.min_loops, spec.max_loops, spec.threshold)


def _item(depth: int = 1, *, exit_at: int = 0, copy: bool = False) -> WorkItem:
    specs = (
        ExitSpec("fixed" if exit_at else "gate", False, 1, 4, 0.5),
        ExitSpec("fixed" if exit_at else "gate", True, 1, 4, 0.5),
    )
    tables = [[10 + d] for d in range(4)]  # one table per depth
    copy_blocks = [20, 21, 22, 23] if copy else []
    carry = Carry(7, tables, specs, exit_at, copy_blocks)
    return WorkItem(
        "a", 5, 1, depth, 4, True, tables[depth - 1], None, None, specs[0],
        copy_blocks[depth:], False, 0, carry,
    )  # fmt: skip


def test_carried_rows_move_one_loop_per_step():
    tables = BlockTables()
    rows = CarriedRows(tables)
    first = _item(exit_at=3, copy=True)
    rows.keep([first], 0, [], ["live"], ["held"])
    assert rows.items == [first] and rows.depths == [1]
    seen = []
    for _ in range(3):
        before = rows.depths
        (w,) = rows.advance()
        d = rows.depths[0]
        assert w is first and before == [d - 1]  # a step's lists are replaced, not changed
        seen.append((d, rows.table_at(0, d), rows.specs[0].exit_now))
        # The attention columns follow: the row of the table at the new depth.
        spans, table_rows = rows.spans()
        assert spans.starts.tolist() == [5] and spans.lens.tolist() == [1]
        assert spans.table_lens.tolist() == [1]
        assert tables.array[table_rows, :1].tolist() == [rows.table_at(0, d)]
        rows.keep([w], 1, [], rows.lives, rows.held)
    assert seen == [(2, [11], False), (3, [12], True), (4, [13], True)]  # fixed exit at 3
    # The plan's item is never changed.
    assert first.depth == 1 and first.block_table == [10] and first.exit_copy_blocks == [21, 22, 23]


def test_carried_rows_keep_order_and_drop_ended_and_released():
    tables = BlockTables()
    rows = CarriedRows(tables)
    a, b = _item(), _item()
    b.request_id = "b"
    rows.keep([a, b], 0, [], ["live a", "live b"], ["held a", "held b"])
    step = rows.advance()
    c = _item()
    c.request_id = "c"
    rows.keep(step + [c], 2, [0], rows.lives + ["live c"], rows.held + ["held c"])  # a ended
    assert [w.request_id for w in rows.items] == ["b", "c"]
    # The runner's values of each row follow it.
    assert rows.lives == ["live b", "live c"] and rows.held == ["held b", "held c"]
    spans, table_rows = rows.spans()  # b at depth 2, c at depth 1
    assert tables.array[table_rows, :1].tolist() == [[11], [10]]
    rows.drop({"c"})
    assert [w.request_id for w in rows.items] == ["b"] and rows.held == ["held b"]
    spans, table_rows = rows.spans()
    assert spans.starts.tolist() == [5] and tables.array[table_rows, :1].tolist() == [[11]]


def test_carried_rows_continue_an_ended_token_at_the_next_position():
    """``StepPlan.continued``: the request's ended token's next position starts at loop 1
    after the rows still running, under the same Carry but its key (the plan items are
    never changed); a continuation of a token the rows do not hold changes nothing."""
    tables = BlockTables()
    rows = CarriedRows(tables)
    a, b = _item(exit_at=3, copy=True), _item()
    b.request_id = "b"
    rows.keep([a, b], 0, [], ["live a", "live b"], ["held a", "held b"])
    step = rows.advance()
    rows.keep(step, 2, [0], rows.lives, rows.held)  # a ended (at loop 2)
    assert [w.request_id for w in rows.items] == ["b"]
    with pytest.raises(RuntimeError, match="no ended carried token 99"):
        rows.advance([("a", 99, 2)])
    assert rows.depths == [2] and [w.request_id for w in rows.items] == ["b"]
    step = rows.advance([("a", a.carry.key, 2)])
    # Its item is the one it continues (a template: its position and key are columns).
    assert step == [b, a] and rows.depths == [3, 1]
    assert rows.starts == [5, 6] and rows.keys == [7, 2] and rows.specs == [b.exit, a.exit]
    assert rows.lives == ["live b", "live a"] and rows.held == ["held b", None]
    spans, table_rows = rows.spans()  # the new position, on its depth-1 table
    assert spans.starts.tolist() == [5, 6]
    assert tables.array[table_rows, :1].tolist() == [[12], [10]]
    assert (a.start, a.carry.key) == (5, 7)  # the ended token's item is unchanged
    with pytest.raises(RuntimeError):  # continued once only
        rows.advance([("a", a.carry.key, 3)])
    rows.drop({"b"})
    rows.keep(rows.items, 1, [0], rows.lives, rows.held)  # the continued one ends too
    assert rows.advance([("a", 2, 3)]) == [a] and (rows.starts, rows.keys) == ([7], [3])
    rows.drop({"a"})  # a released request's ended token goes with it
    with pytest.raises(RuntimeError):
        rows.advance([("a", 3, 4)])


def test_a_continuation_into_a_new_block_takes_its_new_tables():
    """``StepPlan.moved``: a continued token entering a new KV block gets an item of its own
    (its predecessor's with the new tables, boundary table and copy-on-exit blocks), its
    tables' rows rewritten for the attention; the ended rows' arrays, which other tokens may
    still continue from, are left as they were; entries of tokens not continued are passed
    over."""
    tables = BlockTables()
    rows = CarriedRows(tables)
    a, b = _item(copy=True), _item(copy=True)
    b.request_id = "b"
    rows.keep([a, b], 0, [], ["live a", "live b"], ["held a", "held b"])
    for _ in range(3):
        rows.keep(rows.advance(), 2, [], rows.lives, rows.held)
    rows.advance()  # both at loop 4, their last
    ended_rows, ended_lens = rows._rows, rows._lens
    rows.keep(rows.items, 2, [0, 1], rows.lives, rows.held)  # both end together
    grown = [[10 + d, 30 + d] for d in range(4)]  # a's tables, a block appended to each
    moved = [(3, grown, [40, 41], [30, 31, 32, 33]), (99, grown, None, [])]
    step = rows.advance([("a", 7, 3), ("b", 7, 4)], moved)
    new_a = step[0]
    assert step[1] is b and new_a is not a  # b continues under its template, a gets its own
    assert new_a.carry.tables is grown and new_a.block_table is grown[0]
    assert new_a.boundary_table == [40, 41] and new_a.carry.copy_blocks == [30, 31, 32, 33]
    assert new_a.exit_copy_blocks == [31, 32, 33] and new_a.exit is a.exit
    assert (new_a.carry.key, new_a.ends_at, new_a.carry.specs) == (7, 4, a.carry.specs)
    assert rows.starts == [6, 6] and rows.keys == [3, 4] and rows.depths == [1, 1]
    assert rows.table_at(0, 2) == [11, 31] and rows.table_at(1, 2) == [11]
    spans, table_rows = rows.spans()  # loop 1: a reads its grown table, b its old one
    assert spans.table_lens.tolist() == [2, 1]
    assert tables.array[table_rows[0], :2].tolist() == [10, 30]
    assert rows._lens is not ended_lens and ended_lens.tolist() == [[1] * 4] * 2
    assert rows._rows is not ended_rows  # (the same rows: a's keys keep theirs)
    assert rows._rows.tolist() == ended_rows.tolist()
    assert (a.carry.tables[0], a.block_table) == ([10], [10])  # plan items are never changed


def test_a_refilled_batch_takes_its_predecessors_spec_columns():
    """A decode batch whose rows all end together and continue: the new rows' spec columns
    are the ended rows' (all of them, or those continued), not rebuilt; never when a fixed exit
    changed a row's spec."""

    def batch(fixed: bool) -> tuple[CarriedRows, list[WorkItem]]:
        rows = CarriedRows(BlockTables())
        items = [_item(exit_at=2 if fixed and k == 1 else 0) for k in range(3)]
        for k, w in enumerate(items):
            w.request_id = f"r{k}"
            w.carry.tables = [[10 * k + d] for d in range(4)]
            if not w.carry.exit_at:  # (distinct specs per row, as requests have their own)
                w.exit = ExitSpec("gate", False, 1 + k % 2, 4, 0.25 * (k + 1))
        rows.keep(items, 0, [], [f"live {k}" for k in range(3)], ["h0", "h1", "h2"])
        for _ in range(3):  # to the last loop
            step = rows.advance()
            if rows.depths[0] < 4:
                rows.keep(step, 3, [], rows.lives, rows.held)
        return rows, items

    def recomputed(rows: CarriedRows) -> tuple:
        return tuple(zip(*[spec_row(x) for x in rows.specs]))

    for fixed in (False, True):
        rows, items = batch(fixed)
        before = rows.spec_columns()
        keys = list(rows.keys)
        rows.keep(rows.items, 3, [0, 1, 2], rows.lives, rows.held)  # every row ends
        assert not rows.items
        rows.advance([(f"r{k}", keys[k], 10 + k) for k in range(3)])  # all continue, in order
        assert rows.specs == [w.exit for w in items] and rows.starts == [6, 6, 6]
        columns = rows.spec_columns()
        stashed = all(a is b for a, b in zip(columns[:5], before[:5]))
        assert stashed == (not fixed)  # (a fixed exit's row moved its spec: rebuilt)
        assert columns[:5] == recomputed(rows)
    rows, items = batch(False)
    keys = list(rows.keys)
    rows.keep(rows.items, 3, [0, 1, 2], rows.lives, rows.held)
    rows.advance([("r2", keys[2], 20), ("r0", keys[0], 21)])  # some continue, in another order
    assert rows.specs == [items[2].exit, items[0].exit]
    assert rows.spec_columns()[:5] == recomputed(rows)
    assert rows.spec_columns()[5:] == (frozenset({"gate"}), 4)


def test_carried_rows_start_a_plans_new_tokens_after_the_others():
    """``start``: a plan's new carried token whose input is on the runner joins the rows at
    loop 1 before its step runs (after the continued ones), its tables registered; its state
    comes from that step."""
    tables = BlockTables()
    rows = CarriedRows(tables)
    a = _item()
    rows.keep([a], 0, [], ["live a"], ["held a"])
    rows.advance()
    b = _item(exit_at=2)
    b.request_id = "b"
    b.carry.tables = [[40], [41], [42], [43]]
    assert rows.start([b], ["live b"]) == [a, b]
    assert rows.depths == [2, 1] and rows.starts == [5, 5] and rows.keys == [7, 7]
    assert rows.lives == ["live a", "live b"] and rows.held == ["held a", None]
    assert rows.specs == [a.exit, b.exit] and rows.ends == [4, 4]
    spans, table_rows = rows.spans()
    assert tables.array[table_rows, :1].tolist() == [[11], [40]]
    rows.advance()  # b's fixed exit (loop 2) moves its spec
    assert rows.depths == [3, 2] and rows.specs[1].exit_now
    assert b.depth == 1 and b.block_table == [10]  # the plan's item is never changed


def test_carried_rows_of_different_depth_counts_share_the_columns():
    """A token capped at fewer loops (fewer tables) beside full ones, and fixed exits whose
    rows move when earlier rows leave: the columns stay aligned with the items."""
    tables = BlockTables()
    rows = CarriedRows(tables)
    short = _item(exit_at=2)
    short.request_id = "s"
    short.carry.tables = [[30], [31]]  # ends after 2 loops
    full = _item(exit_at=3)
    full.request_id = "f"
    rows.keep([short, full], 0, [], [None, None], [None, None])
    rows.advance()  # both at depth 2
    spans, table_rows = rows.spans()
    assert tables.array[table_rows, :1].tolist() == [[31], [11]]
    assert [s.exit_now for s in rows.specs] == [True, False]
    rows.keep(rows.items, 2, [0], rows.lives, rows.held)  # the short one ended
    rows.advance()  # full at depth 3: its fixed exit loop
    assert rows.depths == [3] and rows.specs[0].exit_now
    spans, table_rows = rows.spans()
    assert tables.array[table_rows, :1].tolist() == [[12]]
