"""BlockTables: the runner's persistent, incrementally updated copy of block tables."""

from __future__ import annotations

import numpy as np

from rltserve.core.block_tables import BlockTables


def test_rows_are_padded_with_the_first_block_and_follow_table_changes():
    bt = BlockTables(rows=2, cols=2)
    a, b = [7, 3], [5]
    out = bt.gather([("a", 1), ("b", 1)], [a, b])
    assert out.tolist() == [[7, 3], [5, 5]]
    # A table that grew past the array's width (a new list, as the KV manager makes), and one
    # changed in place: both rows are rewritten.
    a2 = a + [9, 11, 13]
    b[0] = 6
    out = bt.gather([("b", 1), ("a", 1)], [b, a2])
    assert out.tolist() == [[6, 6, 6, 6, 6], [7, 3, 9, 11, 13]]
    assert bt.array.shape[1] >= 5


def test_rows_grow_release_and_are_reused():
    bt = BlockTables(rows=1, cols=4)
    keys = [(f"r{i}", d) for i in range(3) for d in (1, 2)]
    tables = [[10 * i + d] for i in range(3) for d in (1, 2)]
    out = bt.gather(keys, tables)
    assert out[:, 0].tolist() == [1, 2, 11, 12, 21, 22]
    assert bt.num_rows_used == 6
    bt.release("r1")
    assert bt.num_rows_used == 4
    out = bt.gather([("r3", 1), ("r0", 2)], [[31, 32], [2]])
    assert out.tolist() == [[31, 32], [2, 2]]
    assert bt.num_rows_used == 5
    bt.release("missing")  # nothing to free
    assert bt.num_rows_used == 5


def test_a_changed_snapshot_never_serves_stale_blocks():
    """Rows are trusted only after the table compares equal to the snapshot written."""
    bt = BlockTables()
    rng = np.random.default_rng(0)
    tables = {("r", d): [int(x) for x in rng.integers(0, 100, 3)] for d in range(4)}
    for _ in range(50):
        key = ("r", int(rng.integers(0, 4)))
        table = tables[key]
        if rng.random() < 0.5:
            table = tables[key] = table + [int(rng.integers(0, 100))]
        else:
            table[int(rng.integers(0, len(table)))] = int(rng.integers(0, 100))
        keys = list(tables)
        out = bt.gather(keys, [tables[k] for k in keys])
        for row, k in zip(out.tolist(), keys):
            t = tables[k]
            assert row[: len(t)] == t and set(row[len(t) :]) <= {t[0]}
