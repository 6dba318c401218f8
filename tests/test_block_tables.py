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
    # appended to in place: both rows are rewritten.
    a2 = a + [9, 11, 13]
    b.append(6)
    out = bt.gather([("b", 1), ("a", 1)], [b, a2])
    assert out.tolist() == [[5, 6, 5, 5, 5], [7, 3, 9, 11, 13]]
    # A new list whose block changed, at the same length: rewritten too.
    out = bt.gather([("b", 1)], [[8, 6]])
    assert out.tolist() == [[8, 6]]
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


def test_a_changed_table_never_serves_stale_blocks():
    """Rows are trusted only for the list they were written from, at the length written: the
    KV manager's new lists (grown, or a block replaced) and appends in place are rewritten."""
    bt = BlockTables()
    rng = np.random.default_rng(0)
    tables = {("r", d): [int(x) for x in rng.integers(0, 100, 3)] for d in range(4)}
    for _ in range(50):
        key = ("r", int(rng.integers(0, 4)))
        table = tables[key]
        change = rng.random()
        if change < 0.4:
            table = tables[key] = table + [int(rng.integers(0, 100))]
        elif change < 0.7:
            table = tables[key] = table[:]
            table[int(rng.integers(0, len(table)))] = int(rng.integers(0, 100))
        else:
            table.append(int(rng.integers(0, 100)))
        keys = list(tables)
        out = bt.gather(keys, [tables[k] for k in keys])
        for row, k in zip(out.tolist(), keys):
            t = tables[k]
            assert row[: len(t)] == t and set(row[len(t) :]) <= {t[0]}


def test_an_unchanged_table_is_not_rewritten():
    bt = BlockTables()
    tables = [[1, 2, 3], [4]]
    keys = [("a", 1), ("b", 1)]
    bt.gather(keys, tables)
    writes = []
    real = bt._write
    bt._write = lambda row, table: writes.append(list(table)) or real(row, table)
    assert bt.gather(keys, tables).tolist() == [[1, 2, 3], [4, 4, 4]]
    assert writes == []
    tables[1] = [4, 5]  # the KV manager's way: a new list; grown, so only its tail is written
    assert bt.gather(keys, tables).tolist() == [[1, 2, 3], [4, 5, 4]]
    assert writes == []
    tables[1] = [9, 5]  # a block replaced: the whole row
    assert bt.gather(keys, tables).tolist() == [[1, 2, 3], [9, 5, 9]]
    assert writes == [[9, 5]]
    tables[1] = [8, 5, 7]  # longer, but not the last list grown (an earlier block differs)
    assert bt.gather(keys, tables).tolist() == [[1, 2, 3], [8, 5, 7]]
    assert writes == [[9, 5], [8, 5, 7]]


def test_tables_grown_or_changed_in_one_call_end_up_right():
    """Many rows grown by one or two blocks in one call (a crossing decode batch); one key
    grown then changed, and a row grown beside a table that widens the array, in one call."""
    bt = BlockTables(rows=4, cols=4)
    tables = {("r", d): [10 * d, 10 * d + 1] for d in range(4)}
    keys = list(tables)
    bt.gather(keys, [tables[k] for k in keys])
    tables = {k: t + [t[0] + 5] * (1 + k[1] % 2) for k, t in tables.items()}  # 1 or 2 blocks
    out = bt.gather(keys, [tables[k] for k in keys])
    for row, k in zip(out.tolist(), keys):
        t = tables[k]
        assert row[: len(t)] == t and set(row[len(t) :]) <= {t[0]}
    # The same key grown, then given a changed table, in one call: the later table wins.
    a = tables[("r", 0)]
    grown, changed = a + [77], [99] + a[1:] + [78]
    (row, again) = bt.rows([("r", 0), ("r", 0)], [grown, changed])
    assert row == again and bt.array[row, : len(changed)].tolist() == changed
    # A grown row, then a table wider than the array (which replaces it) in one call.
    b = tables[("r", 1)]
    wide = list(range(40, 50))
    out = bt.gather([("r", 1), ("w", 1)], [b + [55], wide])
    assert out.tolist() == [b + [55] + [b[0]] * (10 - len(b) - 1), wide]


def test_a_batch_grown_by_one_block_each_is_written_at_once_unless_one_changed():
    """Every table a new list with one block appended (a decode batch entering new blocks):
    only the new blocks are written, in one go. Were any table changed before its new block,
    or its old list appended to in place since, every row is still right."""
    bt = BlockTables(rows=8, cols=8)
    keys = [(f"r{i}", d) for i in range(3) for d in (1, 2)]
    tables = [[10 * i + d, 10 * i + d + 1] for i in range(3) for d in (1, 2)]
    bt.gather(keys, tables)
    synced, writes = [], []
    sync, write = bt._sync, bt._write
    bt._sync = lambda key, table, entry: synced.append(key) or sync(key, table, entry)
    bt._write = lambda row, table: writes.append(list(table)) or write(row, table)
    grown = [t + [t[0] + 50] for t in tables]
    rows = bt.rows(keys, grown)
    assert bt.array[rows, :3].tolist() == grown
    assert synced == [] and writes == []  # (the batch: no table on its own)
    assert bt.rows(keys, grown) == rows
    again = [t + [t[0] + 60] for t in grown]
    again[3] = [90] + again[3][1:]  # changed before its new block
    assert bt.gather(keys, again).tolist() == again
    assert synced == keys and writes == [again[3]]  # (each on its own, one rewritten)
    again[5].append(7)  # appended in place since it was written
    last = [t + [t[0] + 70] for t in again]
    for row, t in zip(bt.gather(keys, last).tolist(), last):
        assert row[: len(t)] == t and set(row[len(t) :]) <= {t[0]}


def test_a_batch_grown_by_one_block_past_the_arrays_width_widens_it():
    """Every table a new list one block longer than the array is wide (a decode batch entering
    a block past every earlier table's length): the array widens and every row is right."""
    bt = BlockTables(rows=2, cols=2)
    tables = [[1, 2], [3, 4]]
    keys = [("a", 1), ("b", 1)]
    bt.gather(keys, tables)
    grown = [t + [t[0] + 10] for t in tables]
    assert bt.gather(keys, grown).tolist() == grown
    assert bt.array.shape[1] >= 3


def test_keys_sharing_one_list_and_released_lists_stay_right():
    """Depths sharing a plane hand the same list under two keys; rows are found by the list
    itself, so growth of the shared table, release and reuse of freed lists' ids all keep the
    rows right."""
    bt = BlockTables(rows=2, cols=2)
    shared = [3, 4]
    keys = [("a", 1), ("a", 2), ("b", 1)]
    assert bt.gather(keys, [shared, shared, [7]]).tolist() == [[3, 4], [3, 4], [7, 7]]
    grown = shared + [5]
    assert bt.gather(keys, [grown, grown, [7]]).tolist() == [[3, 4, 5], [3, 4, 5], [7, 7, 7]]
    bt.release("a")
    assert bt.gather([("b", 1)], [[7]]).tolist() == [[7]]
    for i in range(20):  # new lists, possibly at freed lists' addresses
        table = [i, i + 1]
        assert bt.gather([(f"c{i}", 1), ("b", 1)], [table, [7]]).tolist() == [table, [7, 7]]
        bt.release(f"c{i}")
    assert bt.num_rows_used == 1


def test_lists_a_grown_batch_replaced_never_name_rows_again():
    """The lists a batch grown by one block replaces are forgotten: new lists of other
    requests, possibly at their freed addresses, get their own rows."""
    bt = BlockTables(rows=4, cols=4)
    keys = [("a", 1), ("b", 1)]
    tables = [[1, 2], [3, 4]]
    bt.gather(keys, tables)
    for i in range(20):
        tables = [t + [t[0] + i] for t in tables]  # the old lists go once the rows take these
        bt.gather(keys, tables)
        fresh = [[100 + i] * len(tables[0]), [200 + i] * len(tables[0])]
        assert bt.gather([("c", 1), ("d", 1)], fresh).tolist() == fresh
        bt.release("c")
        bt.release("d")


def test_an_earlier_version_of_a_table_reads_the_grown_row():
    """A request's tables only grow: a key given an earlier (shorter) version of its row's
    table, as an item started before a carried token's registration is, keeps the row; the
    blocks it needs are there and the later item's are not lost."""
    bt = BlockTables(rows=2, cols=2)
    old = [3, 4]
    new = old + [5]
    (row,) = bt.rows([("a", 2)], [new])  # registered ahead by the newer item
    assert bt.rows([("a", 2)], [old]) == [row]
    assert bt.array[row, :3].tolist() == [3, 4, 5]
    assert bt.gather([("a", 2)], [old]).tolist() == [[3, 4]]
    other = [3, 9]  # not a prefix: a changed table is still rewritten
    assert bt.gather([("a", 2)], [other]).tolist() == [[3, 9]]


def test_host_metadata_modules_are_torch_free():
    import subprocess
    import sys

    modules = "rltserve.core.block_tables, rltserve.core.metadata, rltserve.core.carried, "
    modules += "rltserve.core.ended"
    code = f"import sys, {modules}; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
