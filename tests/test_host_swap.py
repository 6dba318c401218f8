"""HostSwap: swapped K/V comes back bit-exact into other blocks; ranges are reused first fit,
merged when freed, and a new segment (twice the others, within the capacity) is made only when
none fits, one beyond the capacity dropped once empty; drop and clear free ranges; a copy that
fails holds nothing and loses no range; used bytes count what requests hold. On CUDA the
segments are pinned."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltserve.core import host_swap
from rltserve.core.host_swap import HostSwap

LAYERS, SLOTS, HEADS, HEAD_DIM = 3, 64, 2, 4
SLOT_NUMEL = LAYERS * 2 * HEADS * HEAD_DIM


def _kv(device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYERS, 2, SLOTS, HEADS, HEAD_DIM, generator=g)
    return kv.to(device)


def _idx(slots, device="cpu") -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64, device=device)


@pytest.fixture
def small_segments(monkeypatch):
    """Segments of at least 8 slots (instead of 16 MiB), so ranges run out in a test."""
    monkeypatch.setattr(host_swap, "MIN_SEGMENT_BYTES", 8 * SLOT_NUMEL * 4)


def test_put_take_is_bit_exact_into_other_slots():
    kv = _kv()
    swap = HostSwap(kv, torch.device("cpu"))
    before = kv[:, :, 4:10].clone()
    swap.put("a", _idx(range(4, 10)))
    assert swap.holds("a") and swap.num_requests == 1
    assert swap.used_bytes == 6 * SLOT_NUMEL * 4
    kv[:, :, 4:10] = 0.0  # the blocks go to another request
    swap.take("a", _idx(range(20, 26)))
    assert torch.equal(kv[:, :, 20:26], before)
    assert not swap.holds("a") and swap.used_bytes == 0


def test_take_with_wrong_slot_count_keeps_the_request():
    swap = HostSwap(_kv(), torch.device("cpu"))
    swap.put("a", _idx([1, 2, 3]))
    with pytest.raises(ValueError, match="2 slots for 3 swapped"):
        swap.take("a", _idx([5, 6]))
    assert swap.holds("a")
    with pytest.raises(ValueError, match="already swapped out"):
        swap.put("a", _idx([7]))


def test_ranges_reused_merged_and_segments_grow(small_segments):
    kv = _kv()
    swap = HostSwap(kv, torch.device("cpu"))
    swap.put("a", _idx(range(0, 3)))
    swap.put("b", _idx(range(3, 6)))
    assert len(swap.segments) == 1 and swap._held == {"a": (0, 0, 3), "b": (0, 3, 3)}
    swap.put("c", _idx(range(6, 9)))  # 2 slots left in the first segment: a new one, 2x
    assert len(swap.segments) == 2 and swap._held["c"] == (1, 0, 3)
    assert swap.segment_bytes == (8 + 16) * SLOT_NUMEL * 4
    swap.drop("a")
    swap.put("d", _idx([9, 10]))  # first fit: where "a" was
    assert swap._held["d"] == (0, 0, 2)
    swap.drop("b")
    swap.drop("d")
    assert swap._free[0] == [(0, 8)]  # freed ranges merge with their neighbours
    swap.put("e", _idx(range(10, 18)))  # the whole first segment again
    assert swap._held["e"] == (0, 0, 8) and len(swap.segments) == 2
    # Every request's bytes survive the others' comings and goings.
    want = {rid: kv[:, :, s : s + n].clone() for rid, s, n in (("c", 6, 3), ("e", 10, 8))}
    kv.zero_()
    swap.take("c", _idx(range(30, 33)))
    swap.take("e", _idx(range(40, 48)))
    assert torch.equal(kv[:, :, 30:33], want["c"]) and torch.equal(kv[:, :, 40:48], want["e"])
    assert swap._free == {0: [(0, 8)], 1: [(0, 16)]} and swap.used_bytes == 0


def test_drop_unknown_and_clear(small_segments):
    swap = HostSwap(_kv(), torch.device("cpu"))
    swap.drop("nobody")
    swap.put("a", _idx(range(5)))
    swap.put("b", _idx(range(5, 10)))
    swap.clear()
    assert swap.num_requests == 0 and swap.used_bytes == 0
    assert swap._free == {0: [(0, 8)], 1: [(0, 16)]}  # segments kept, all free


def test_segments_stay_within_the_capacity(small_segments):
    swap = HostSwap(_kv(), torch.device("cpu"), capacity_bytes=12 * SLOT_NUMEL * 4)
    swap.put("a", _idx(range(6)))
    swap.put("b", _idx(range(6, 9)))  # 2 slots left in the first 8: a second one, 4 (not 16)
    assert swap._held["b"] == (1, 0, 3) and swap.segment_bytes == 12 * SLOT_NUMEL * 4
    swap.drop("b")
    # Fragmented at the capacity: 2 + 4 free, 5 wanted. A segment of 5 beyond it, dropped
    # once empty; the ones within it stay.
    swap.put("c", _idx(range(10, 15)))
    assert swap._held["c"] == (2, 0, 5) and swap.segment_bytes == 17 * SLOT_NUMEL * 4
    swap.take("c", _idx(range(20, 25)))
    assert sorted(swap.segments) == [0, 1] and swap.segment_bytes == 12 * SLOT_NUMEL * 4


def test_a_failed_copy_holds_nothing_and_keeps_its_range(small_segments):
    kv = _kv()
    swap = HostSwap(kv, torch.device("cpu"))
    with pytest.raises(IndexError):
        swap.put("a", _idx([3, SLOTS + 5]))  # a slot past the KV
    assert not swap.holds("a") and swap.used_bytes == 0 and swap._free == {0: [(0, 8)]}
    swap.put("b", _idx([1, 2]))
    with pytest.raises(IndexError):
        swap.take("b", _idx([4, SLOTS + 1]))
    # The request fails with its step: its range is free again.
    assert not swap.holds("b") and swap._free == {0: [(0, 8)]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_non_blocking_round_trip_on_cuda():
    kv = _kv("cuda")
    swap = HostSwap(kv, torch.device("cuda"))
    before = kv[:, :, 0:12].clone()
    swap.put("a", _idx(range(12), "cuda"))
    assert swap.segments[0].is_pinned()
    kv[:, :, 0:12] = 0.0  # queued after the copy out on the same stream
    swap.take("a", _idx(range(40, 52), "cuda"))
    swap.put("b", _idx(range(40, 52), "cuda"))  # reuses the range the take freed
    swap.take("b", _idx(range(20, 32), "cuda"))
    torch.cuda.synchronize()
    assert torch.equal(kv[:, :, 20:32], before)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "take", "drop"]), st.integers(0, 5), st.integers(1, 4)),
        max_size=40,
    ),
    capacity=st.sampled_from([0, 12, 20]),
)
def test_random_swaps_round_trip_and_keep_ranges_whole(ops, capacity):
    """Any sequence of puts, takes and drops: every take restores exactly what its put saw, and
    in every segment the free and held ranges tile it without overlap (merged free ranges)."""
    # (Not the fixture: hypothesis reuses one function-scoped fixture for every example.)
    min_bytes = host_swap.MIN_SEGMENT_BYTES
    host_swap.MIN_SEGMENT_BYTES = 8 * SLOT_NUMEL * 4
    try:
        kv = _kv()
        swap = HostSwap(kv, torch.device("cpu"), capacity_bytes=capacity * SLOT_NUMEL * 4)
        saved: dict[str, torch.Tensor] = {}
        for op, k, n in ops:
            rid = f"r{k}"
            if op == "put" and rid not in saved:
                slots = list(range(k * 10, k * 10 + n))
                saved[rid] = kv[:, :, slots].clone()
                swap.put(rid, _idx(slots))
                kv[:, :, slots] = float(k)  # the blocks go to others
            elif op == "take" and rid in saved:
                n = saved[rid].shape[2]
                slots = list(range(SLOTS - n, SLOTS))
                swap.take(rid, _idx(slots))
                assert torch.equal(kv[:, :, slots], saved.pop(rid))
            elif op == "drop":
                swap.drop(rid)
                saved.pop(rid, None)
            assert swap.used_bytes == sum(t.shape[2] for t in saved.values()) * SLOT_NUMEL * 4
            for seg, tensor in swap.segments.items():
                size = tensor.numel() // SLOT_NUMEL
                free = swap._free[seg]
                held = [(s, n) for g, s, n in swap._held.values() if g == seg]
                spans = sorted(free + held)
                assert sum(n for _, n in spans) == size
                assert all(a + m == b for (a, m), (b, _) in zip(spans, spans[1:]))
                assert all(a + m < b for (a, m), (b, _) in zip(free, free[1:]))  # merged
        swap.clear()
        assert swap.num_requests == 0 and swap.used_bytes == 0
    finally:
        host_swap.MIN_SEGMENT_BYTES = min_bytes
