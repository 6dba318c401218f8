"""StepAttention: each short path gives the metadata ``attention_over`` gives the same items
(a decode batch, a decode batch beside prompt chunks), in one transfer; other steps take the
general path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rltserve.core.attention as attention
from rltserve.core.attention import (
    GroupedAttention,
    PagedAttention,
    allocate_kv_cache,
    attention_over,
)
from rltserve.core.block_tables import BlockTables
from rltserve.core.metadata import Spans
from rltserve.core.step_attention import StepAttention

BS = 4
FIELDS = ("starts", "lens", "positions", "slot_mapping", "pad_index", "gather_blocks")


def _setup(carried_starts: list[int], chunks: list[tuple[int, int]], seed: int = 0):
    """A StepAttention, the carried rows' spans and BlockTables rows, and the planned chunks'
    spans and keys, every table a random run of blocks long enough for its positions."""
    rng = np.random.default_rng(seed)
    kv = allocate_kv_cache(1, 512, BS, 2, 8, torch.float32, "cpu")
    tables = BlockTables()
    built = StepAttention(kv, tables, BS, torch.device("cpu"))

    def table(end: int) -> list[int]:
        return rng.permutation(512)[: -(-end // BS) + int(rng.integers(0, 2))].tolist()

    carried_tables = [table(s + 1) for s in carried_starts]
    keys = [(f"c{k}", 1) for k in range(len(carried_starts))]
    rows = np.array(tables.rows(keys, carried_tables), dtype=np.int64)
    starts = np.array(carried_starts, dtype=np.int64)
    head = Spans(
        starts, np.ones(len(starts), dtype=np.int64), np.array(list(map(len, carried_tables)))
    )
    spans = [(s, n, table(s + n)) for s, n in chunks]
    chunk_keys = [(f"p{k}", 1) for k in range(len(chunks))]
    every = [(s, 1, t) for s, t in zip(carried_starts, carried_tables)] + spans
    return built, (head, rows), spans, chunk_keys, every


def _general(built: StepAttention, every: list, pad_budget: int = 0):
    """``attention_over`` of the step's items with their tables gathered up front."""
    width = max(len(t) for _, _, t in every)
    padded = np.array([t + [t[0]] * (width - len(t)) for _, _, t in every], dtype=np.int64)
    columns = list(zip(*every))
    spans = Spans(
        np.array(columns[0]), np.array(columns[1]), np.array(list(map(len, columns[2]))), padded
    )
    return attention_over(built.kv, spans, BS, pad_budget=pad_budget)


def _assert_same(got: GroupedAttention, want: GroupedAttention) -> None:
    assert isinstance(got, GroupedAttention) and isinstance(want, GroupedAttention)
    assert torch.equal(got.slot_mapping, want.slot_mapping)
    assert torch.equal(got.positions, want.positions)
    assert got.group_rows() == want.group_rows() and got.in_order == want.in_order
    for (_, attn), (_, want_attn) in zip(got.groups, want.groups):
        for name in FIELDS:
            assert torch.equal(getattr(attn.md, name), getattr(want_attn.md, name)), name


@pytest.mark.parametrize("chunks", [[(0, 8)], [(5, 6), (11, 9)]], ids=["one", "two"])
def test_a_decode_batch_beside_prompt_chunks_is_two_groups_in_order(monkeypatch, chunks):
    calls = []
    real = attention.move_to
    monkeypatch.setattr(attention, "move_to", lambda t, d: calls.append(1) or real(t, d))
    monkeypatch.setattr(
        "rltserve.core.step_attention.attention_over",
        lambda *a: pytest.fail("the general path was taken"),
    )
    built, carried, spans, keys, every = _setup([17, 3, 30, 31, 12, 29], chunks)
    got = built.build(spans, keys, carried)
    assert len(calls) == 1  # one transfer for both groups and the rows' slots and positions
    monkeypatch.undo()
    want = _general(built, every)
    assert want.in_order and want.group_rows() == [
        list(range(6)),
        list(range(6, 6 + sum(n for _, n in chunks))),
    ]
    _assert_same(got, want)
    # The carried rows' positions serve the next step too (another plane's table rows).
    again = built.build(spans, keys, carried)
    _assert_same(again, want)


def test_other_mixed_steps_take_the_general_path(monkeypatch):
    taken = []
    real = attention_over
    monkeypatch.setattr(
        "rltserve.core.step_attention.attention_over", lambda *a: taken.append(1) or real(*a)
    )
    # Carried rows whose contexts are two attention groups beside a chunk.
    built, carried, spans, keys, every = _setup([3, 200], [(0, 8)], seed=1)
    _assert_same(built.build(spans, keys, carried), _general(built, every))
    # A planned one-row item beside the chunk (a token whose input was recorded).
    built, carried, spans, keys, every = _setup([17, 3], [(0, 8), (9, 1)], seed=2)
    _assert_same(built.build(spans, keys, carried), _general(built, every))
    assert len(taken) == 2


def test_within_a_pad_budget_a_mixed_step_is_one_padded_batch():
    """Within a pad budget a decode batch beside prompt chunks attends as one padded batch, the
    metadata ``attention_over`` gives the items within the budget; past the budget, the two
    groups in order."""
    built, carried, spans, keys, every = _setup([17, 3, 30, 31, 12, 29], [(5, 6), (11, 9)])
    # 8 items padded to 9 rows over 8 blocks of 4 (the furthest context: 32 positions).
    pairs = 8 * 9 * 8 * BS
    built.pad_budget = pairs
    got = built.build(spans, keys, carried)
    want = _general(built, every, pad_budget=pairs)
    assert isinstance(got, PagedAttention) and isinstance(want, PagedAttention)
    for name in FIELDS:
        assert torch.equal(getattr(got.md, name), getattr(want.md, name)), name
    built.pad_budget = pairs - 1
    assert isinstance(built.build(spans, keys, carried), GroupedAttention)
