"""``EndedTokens`` (``ended.py``): the carried tokens that ended, for a plan to continue; a
decode batch's kept as the columns they ended with. Torch-free, with stand-in items."""

from __future__ import annotations

import numpy as np
import pytest

from rltserve.core.ended import EndedTokens


def _rows(rids: list[str], key0: int = 10, specs=None) -> tuple:
    """A step's ended rows: (request ids, items, request states, positions, keys, block)."""
    n = len(rids)
    rows = np.arange(n * 2).reshape(n, 2)
    block = (rows, rows + 100, specs)
    items = [f"item-{rid}-{key0}" for rid in rids]
    lives = [f"live-{rid}" for rid in rids]
    return rids, items, lives, list(range(5, 5 + n)), list(range(key0, key0 + n)), block


def _continued(rids: list[str], keys: list[int], new: int = 100) -> list[tuple]:
    return [(rid, key, new + k) for k, (rid, key) in enumerate(zip(rids, keys))]


def test_a_batch_continued_whole_and_in_order_comes_back_as_it_ended():
    ended = EndedTokens()
    specs = (("gate",) * 3, (False,) * 3, (1,) * 3, (4,) * 3, (0.5,) * 3)
    rids, items, lives, starts, keys, block = _rows(["a", "b", "c"], specs=specs)
    ended.add_rows(rids, items, lives, starts, keys, block)
    got = ended.take(_continued(rids, keys))
    new_keys, got_items, got_lives, got_starts, tables, columns = got
    assert new_keys == [100, 101, 102]
    assert got_items is items and got_lives is lives and got_starts is starts
    assert tables[0] is block[0] and tables[1] is block[1] and columns is specs
    assert len(ended) == 0
    with pytest.raises(RuntimeError, match="a: no ended carried token 10 to continue"):
        ended.take(_continued(rids, keys))


def test_part_of_a_batch_or_another_order_reads_their_rows():
    ended = EndedTokens()
    rids, items, lives, starts, keys, block = _rows(["a", "b", "c"])
    ended.add_rows(rids, items, lives, starts, keys, block)
    continued = _continued(["c", "a"], [keys[2], keys[0]])
    new_keys, got_items, got_lives, got_starts, tables, columns = ended.take(continued)
    assert new_keys == [100, 101] and got_items == [items[2], items[0]]
    assert got_lives == [lives[2], lives[0]] and list(got_starts) == [starts[2], starts[0]]
    assert tables[0].tolist() == block[0][[2, 0]].tolist()
    assert tables[1].tolist() == block[1][[2, 0]].tolist() and columns is None
    assert len(ended) == 1  # b waits
    ended.drop({"b"})
    assert len(ended) == 0


def test_a_newer_token_wins_and_a_missing_one_changes_nothing():
    """A token that ended after the batch (a plan item at its first loop) is its request's
    newest: continuing the batch's older token of that request is refused, and the refusal
    leaves every token there. A batch kept after an older entry replaces it."""
    ended = EndedTokens()
    ended.add("a", "older-a", "live-a", 3, 5)
    rids, items, lives, starts, keys, block = _rows(["a", "b"])
    ended.add_rows(rids, items, lives, starts, keys, block)  # (newer than key 5)
    ended.add("b", "item-b-newest", "live-b", 9, 50)
    with pytest.raises(RuntimeError, match="b: no ended carried token 11"):
        ended.take(_continued(rids, keys))
    assert len(ended) == 2
    new_keys, got_items, _, got_starts, tables, _ = ended.take([("b", 50, 7), ("a", 10, 8)])
    assert new_keys == [7, 8] and got_items == ["item-b-newest", items[0]]
    assert list(got_starts) == [9, starts[0]] and tables is None  # (not one block)
    assert len(ended) == 0


def test_a_request_twice_in_one_batch_keeps_its_newest():
    ended = EndedTokens()
    rids, items, lives, starts, keys, block = _rows(["a", "a", "b"])
    ended.add_rows(rids, items, lives, starts, keys, block)
    assert len(ended) == 2
    with pytest.raises(RuntimeError):  # (both of a's, exactly as they ended: the older too)
        ended.take(_continued(rids, keys))
    with pytest.raises(RuntimeError):  # (the older token of a)
        ended.take(_continued(["a", "b"], [keys[0], keys[2]]))
    *_, tables, _ = ended.take(_continued(["a", "b"], [keys[1], keys[2]]))
    assert tables[0].tolist() == block[0][[1, 2]].tolist()


def test_dropped_requests_and_clear_leave_nothing():
    ended = EndedTokens()
    ended.add_rows(*_rows(["a", "b"]))
    ended.drop({"a"})
    assert len(ended) == 1
    with pytest.raises(RuntimeError, match="a: no ended"):
        ended.take([("a", 10, 1)])
    ended.add_rows(*_rows(["c"], key0=20))
    ended.clear()
    assert len(ended) == 0


def test_a_request_with_a_token_in_the_batch_and_a_newer_one_counts_once():
    ended = EndedTokens()
    ended.add_rows(*_rows(["a", "b"]))
    ended.add("b", "item-b-newest", "live-b", 9, 50)  # (newer than the batch's token of b)
    assert len(ended) == 2
    ended.add("c", "item-c", "live-c", 4, 60)
    assert len(ended) == 3
