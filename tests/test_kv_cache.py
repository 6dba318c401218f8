import pytest

from rltserve.core.kv_cache import (
    BOUNDARY,
    BlockPool,
    KVManager,
    KVPolicy,
    NoFreeBlocks,
    slot,
)

# -- policies ---------------------------------------------------------------------------------


def test_parse_policies():
    assert KVPolicy.parse("full") == KVPolicy("full")
    assert KVPolicy.parse("last_exited") == KVPolicy("last_exited")
    assert KVPolicy.parse("shared") == KVPolicy("shared")
    assert KVPolicy.parse("ring:4") == KVPolicy("ring", 4)
    assert str(KVPolicy.parse("ring:4")) == "ring:4"
    assert str(KVPolicy()) == "last_exited"


@pytest.mark.parametrize(
    "bad", ["", "Full", "ring", "ring:", "ring:0", "ring:-1", "ring:x", "dense"]
)
def test_parse_rejects_and_names_value(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("[", r"\[")):
        KVPolicy.parse(bad)


def test_policy_validation():
    with pytest.raises(ValueError, match="kind"):
        KVPolicy("paged")
    with pytest.raises(ValueError, match="ring_size"):
        KVPolicy("ring", 0)
    with pytest.raises(ValueError, match="ring_size=2.0: must be an int"):
        KVPolicy("ring", 2.0)
    with pytest.raises(ValueError, match="ring_size"):
        KVPolicy("full", 2)


def test_num_planes_and_plane_mapping():
    full, last, shared, ring = (
        KVPolicy.parse(s) for s in ("full", "last_exited", "shared", "ring:3")
    )
    assert [p.num_planes(4) for p in (full, last, shared, ring)] == [4, 4, 1, 3]
    assert ring.num_planes(2) == 2
    assert [full.plane(d) for d in range(1, 5)] == [0, 1, 2, 3]
    assert [last.plane(d) for d in range(1, 5)] == [0, 1, 2, 3]
    assert [shared.plane(d) for d in range(1, 5)] == [0, 0, 0, 0]
    assert [ring.plane(d) for d in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    assert [p.copies_on_exit for p in (full, last, shared, ring)] == [False, True, False, True]
    assert not KVPolicy.parse("ring:1").copies_on_exit  # every exit writes its one plane
    assert [p.per_depth for p in (full, last, shared, ring)] == [True, True, False, False]
    with pytest.raises(ValueError):
        full.plane(0)
    with pytest.raises(ValueError):
        full.num_planes(0)


# -- block pool -------------------------------------------------------------------------------


def test_pool_allocate_lowest_first_and_refcounts():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) == [2, 3]
    pool.free([0])
    assert pool.allocate(2) == [0, 4]
    assert (pool.num_used, pool.num_free, pool.num_total) == (5, 1, 6)
    pool.incref([2, 3])
    assert pool.ref_count(2) == 2
    pool.free([2, 3])  # still referenced once
    assert pool.num_free == 1
    pool.free([2, 3])
    assert pool.num_free == 3
    assert pool.allocate(3) == [2, 3, 5]


def test_pool_errors():
    pool = BlockPool(3)
    with pytest.raises(NoFreeBlocks) as err:
        pool.allocate(4)
    assert (err.value.requested, err.value.available) == (4, 3)
    assert pool.num_free == 3  # nothing allocated
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[0]])
    b = pool.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free(b + b)  # same id twice, count 1: rejected without changes
    assert pool.ref_count(b[0]) == 1
    with pytest.raises(ValueError, match="free"):
        pool.incref([2])  # a free block cannot be shared


# -- manager ----------------------------------------------------------------------------------


def test_allocate_tables_every_plane():
    kv = KVManager(num_blocks=64, block_size=4, policy=KVPolicy.parse("full"), has_boundary=False)
    assert kv.blocks_needed(9, 4) == 3 * 4
    kv.allocate("a", 9, 4)
    tables = [kv.block_table("a", p) for p in range(4)]
    assert all(len(t) == 3 for t in tables)
    assert len({b for t in tables for b in t}) == 12  # disjoint
    assert [kv.table_for_depth("a", d) for d in range(1, 5)] == tables
    assert kv.num_requests == 1 and kv.num_free_blocks == 52
    assert kv.usage == pytest.approx(12 / 64)
    with pytest.raises(ValueError, match="depth"):
        kv.table_for_depth("a", 5)
    with pytest.raises(KeyError):
        kv.block_table("a", BOUNDARY)
    with pytest.raises(KeyError):
        kv.boundary_table("a")
    kv.check_no_leaks()
    kv.free("a")
    assert kv.num_requests == 0 and kv.num_free_blocks == 64 and kv.usage == 0.0
    kv.check_no_leaks()


def test_shared_and_ring_planes():
    shared = KVManager(32, 4, KVPolicy.parse("shared"), has_boundary=False)
    shared.allocate("a", 8, 4)
    assert shared.blocks_needed(8, 4) == 2
    assert all(shared.table_for_depth("a", d) == shared.block_table("a", 0) for d in range(1, 5))
    ring = KVManager(32, 4, KVPolicy.parse("ring:2"), has_boundary=False)
    ring.allocate("a", 8, 5)
    assert ring.num_free_blocks == 32 - 4
    assert ring.table_for_depth("a", 3) == ring.block_table("a", 0)
    assert ring.table_for_depth("a", 4) == ring.block_table("a", 1)


def test_boundary_plane():
    kv = KVManager(32, 4, KVPolicy.parse("ring:2"), has_boundary=True)
    assert kv.blocks_needed(5, 8) == 2 * 3
    kv.allocate("a", 5, 8)
    boundary = kv.boundary_table("a")
    assert boundary == kv.block_table("a", BOUNDARY) and len(boundary) == 2
    cores = {b for p in (0, 1) for b in kv.block_table("a", p)}
    assert not cores & set(boundary)
    kv.free("a")
    kv.check_no_leaks()
    assert kv.num_free_blocks == 32


def test_capacity_errors_are_atomic():
    kv = KVManager(10, 4, KVPolicy.parse("last_exited"), has_boundary=False)
    assert kv.can_allocate(8, 4)  # 2 * 4 = 8 blocks
    assert not kv.can_allocate(9, 4)  # 3 * 4 = 12 blocks
    with pytest.raises(NoFreeBlocks):
        kv.allocate("big", 9, 4)
    assert kv.num_requests == 0 and kv.num_free_blocks == 10
    kv.allocate("a", 8, 4)
    assert not kv.can_allocate(1, 4)
    with pytest.raises(ValueError, match="already"):
        kv.allocate("a", 1, 1)
    with pytest.raises(ValueError):
        kv.allocate("b", -1, 1)
    with pytest.raises(KeyError):
        kv.free("nope")
    kv.free("a")
    with pytest.raises(KeyError):
        kv.free("a")
    kv.check_no_leaks()


def test_many_requests_interleaved_free_no_leaks():
    kv = KVManager(100, 3, KVPolicy.parse("last_exited"), has_boundary=True)
    live = []
    for i in range(12):
        rid = f"r{i}"
        if kv.can_allocate(i + 1, 1 + i % 4):
            kv.allocate(rid, i + 1, 1 + i % 4)
            live.append(rid)
        if i % 3 == 2:
            kv.free(live.pop(0))
        kv.check_no_leaks()
    for rid in live:
        kv.free(rid)
    kv.check_no_leaks()
    assert kv.num_free_blocks == 100


def test_check_no_leaks_detects_mismatch():
    kv = KVManager(8, 2, KVPolicy.parse("full"), has_boundary=False)
    kv.allocate("a", 2, 2)
    kv.pool.incref(kv.block_table("a", 0))  # a reference no table accounts for
    with pytest.raises(AssertionError):
        kv.check_no_leaks()


def test_exit_copy_blocks():
    kv = KVManager(64, 4, KVPolicy.parse("last_exited"), has_boundary=True)
    kv.allocate("a", 10, 4)
    # position 5 is in block index 1 of each plane
    want = [kv.block_table("a", p)[1] for p in (2, 3)]
    assert kv.exit_copy_blocks("a", 5, depth=2, num_loops=4) == want
    assert kv.exit_copy_blocks("a", 9, depth=1, num_loops=4) == [
        kv.block_table("a", p)[2] for p in (1, 2, 3)
    ]
    assert kv.exit_copy_blocks("a", 0, depth=4, num_loops=4) == []
    with pytest.raises(ValueError):
        kv.exit_copy_blocks("a", 10, depth=1, num_loops=4)
    for name in ("shared", "ring:1"):
        other = KVManager(64, 4, KVPolicy.parse(name), has_boundary=False)
        other.allocate("a", 10, 4)
        assert other.exit_copy_blocks("a", 5, depth=1, num_loops=4) == []
    # A full engine's planes are last_exited's: a last_exited request's copies find them.
    full = KVManager(64, 4, KVPolicy.parse("full"), has_boundary=False)
    full.allocate("a", 10, 4)
    assert full.exit_copy_blocks("a", 5, depth=2, num_loops=4) == [
        full.block_table("a", p)[1] for p in (2, 3)
    ]
    # ring:3: only the planes an exit before loop 3 never wrote (depths up to 3), never the
    # planes deeper loops share with the ones it wrote.
    ring = KVManager(64, 4, KVPolicy.parse("ring:3"), has_boundary=False)
    ring.allocate("a", 10, 4)
    assert ring.exit_copy_blocks("a", 5, depth=1, num_loops=4) == [
        ring.block_table("a", p)[1] for p in (1, 2)
    ]
    assert ring.exit_copy_blocks("a", 5, depth=3, num_loops=4) == []
    assert KVPolicy.parse("ring:3").copy_depths(4) == 3
    assert KVPolicy.parse("ring:3").copy_depths(2) == 2
    assert KVPolicy.parse("last_exited").copy_depths(4) == 4


def test_slot():
    table = [7, 2, 5]
    assert [slot(table, p, 4) for p in (0, 3, 4, 9)] == [28, 31, 8, 21]
    with pytest.raises(IndexError):
        slot(table, 12, 4)


def test_module_is_torch_free():
    import subprocess
    import sys

    code = "import sys, rltserve.core.kv_cache; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
