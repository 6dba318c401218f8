import math

import numpy as np
import pytest
import torch

from rltserve.config import EngineConfig
from rltserve.core.attention import (
    AttentionMetadata,
    GroupedAttention,
    PagedAttention,
    allocate_kv_cache,
    copy_slots,
    paged_attention,
)
from rltserve.core.metadata import (
    HostMetadata,
    Spans,
    attention_groups,
    decode_metadata,
    decode_positions,
    gathered_slots,
    group_indices,
    padded_pairs,
)

BS = 4
NUM_BLOCKS = 32
HD = 8


def dense_reference(q, k_ctx, v_ctx, start):
    """Explicit softmax attention of rows at positions start.. over keys 0..pos (fp64).

    q: [n, Hq, hd]; k_ctx, v_ctx: [ctx, Hkv, hd] -> [n, Hq, hd]
    """
    q, k_ctx, v_ctx = q.double(), k_ctx.double(), v_ctx.double()
    rep = q.shape[1] // k_ctx.shape[1]
    k = k_ctx.repeat_interleave(rep, dim=1)  # [ctx, Hq, hd]
    v = v_ctx.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])  # [Hq, n, ctx]
    pos = torch.arange(start, start + q.shape[0])
    allowed = torch.arange(k.shape[0])[None, :] <= pos[:, None]  # [n, ctx]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.einsum("hqk,khd->qhd", probs, v)


def write_prior(kv, layer, table, k_ctx, v_ctx, upto):
    """Place K/V of positions [0, upto) of one item straight into the cache."""
    for p in range(upto):
        s = table[p // BS] * BS + p % BS
        kv[layer, 0, s] = k_ctx[p]
        kv[layer, 1, s] = v_ctx[p]


def make_items(gen, in_order: bool = False):
    # (start, num_tokens): decode rows (q_len 1) and prefill chunks with and without context;
    # ``in_order``: the decode rows first (two attention groups of consecutive rows).
    shapes = [(0, 5), (6, 1), (9, 3), (0, 1), (3, 1), (13, 6)]
    if in_order:
        shapes.sort(key=lambda shape: shape[1] > 1)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    items, used = [], 0
    for start, n in shapes:
        nblocks = -(-(start + n) // BS) + 1  # tables may be longer than the context
        items.append((start, n, perm[used : used + nblocks]))
        used += nblocks
    return items


@pytest.mark.parametrize("batch", ["one", "groups", "groups-in-order"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)])
def test_matches_dense_reference_fp32(heads, batch):
    """One padded batch, and (``paged_attention``) decode rows apart from prompt chunks: rows
    of both kinds interleaved, or each group's rows consecutive (views, outputs concatenated)."""
    hq, hkv = heads
    gen = torch.Generator().manual_seed(0)
    items = make_items(gen, in_order=batch == "groups-in-order")
    num_layers = 3
    kv = allocate_kv_cache(num_layers, NUM_BLOCKS, BS, hkv, HD, torch.float32, "cpu")
    md = AttentionMetadata.build(items, BS, "cpu")
    attn = PagedAttention(kv, md) if batch == "one" else paged_attention(kv, items, BS)
    assert isinstance(attn, GroupedAttention) == (batch != "one")
    if batch != "one":
        assert attn.in_order == (batch == "groups-in-order")
    assert md.num_rows == sum(n for _, n, _ in items)
    assert md.positions.tolist() == [p for s, n, _ in items for p in range(s, s + n)]

    for layer in range(num_layers):
        ctxs = []
        for start, n, table in items:
            k_ctx = torch.randn(start + n, hkv, HD, generator=gen)
            v_ctx = torch.randn(start + n, hkv, HD, generator=gen)
            write_prior(kv, layer, table, k_ctx, v_ctx, start)
            ctxs.append((k_ctx, v_ctx))
        q = torch.randn(md.num_rows, hq, HD, generator=gen)
        k = torch.cat([kc[s:] for (kc, _), (s, _, _) in zip(ctxs, items)])
        v = torch.cat([vc[s:] for (_, vc), (s, _, _) in zip(ctxs, items)])
        out = attn(layer, q, k, v)
        assert out.shape == (md.num_rows, hq, HD) and out.dtype == torch.float32
        row = 0
        for (start, n, _), (k_ctx, v_ctx) in zip(items, ctxs):
            want = dense_reference(q[row : row + n], k_ctx, v_ctx, start)
            torch.testing.assert_close(out[row : row + n].double(), want, atol=2e-6, rtol=1e-6)
            row += n
        # this layer's K/V landed at the item slots; earlier layers untouched
        assert torch.equal(kv[layer, 0, md.slot_mapping], k)
        assert torch.equal(kv[layer, 1, md.slot_mapping], v)


@pytest.mark.parametrize("heads", [(6, 2), (4, 1), (4, 4)])
def test_decode_only_step_matches_dense_reference(heads):
    """A decode-only step (one row per item) takes the GQA path that folds query heads into
    rows; q need not be contiguous."""
    hq, hkv = heads
    gen = torch.Generator().manual_seed(3)
    starts = [0, 5, 12, 3]
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    items = [(s, 1, perm[4 * i : 4 * i + 4]) for i, s in enumerate(starts)]
    kv = allocate_kv_cache(1, NUM_BLOCKS, BS, hkv, HD, torch.float32, "cpu")
    attn = PagedAttention(kv, AttentionMetadata.build(items, BS))
    ctxs = []
    for start, _, table in items:
        k_ctx = torch.randn(start + 1, hkv, HD, generator=gen)
        v_ctx = torch.randn(start + 1, hkv, HD, generator=gen)
        write_prior(kv, 0, table, k_ctx, v_ctx, start)
        ctxs.append((k_ctx, v_ctx))
    q = torch.randn(hq, len(items), HD, generator=gen).transpose(0, 1)  # [N, Hq, hd], strided
    k = torch.stack([kc[-1] for kc, _ in ctxs])
    v = torch.stack([vc[-1] for _, vc in ctxs])
    out = attn(0, q, k, v)
    assert out.shape == (len(items), hq, HD)
    for row, ((start, _, _), (k_ctx, v_ctx)) in enumerate(zip(items, ctxs)):
        want = dense_reference(q[row : row + 1], k_ctx, v_ctx, start)
        torch.testing.assert_close(out[row : row + 1].double(), want, atol=2e-6, rtol=1e-6)


def test_paged_attention_groups_only_mixed_steps():
    decode = [(3, 1, [0]), (5, 1, [1, 2])]
    chunks = [(0, 4, [3]), (4, 3, [4, 5])]
    kv = allocate_kv_cache(1, NUM_BLOCKS, BS, 2, HD, torch.float32, "cpu")
    assert isinstance(paged_attention(kv, decode, BS), PagedAttention)
    assert isinstance(paged_attention(kv, chunks, BS), PagedAttention)
    mixed = paged_attention(kv, [chunks[0], decode[0], chunks[1], decode[1]], BS)
    assert isinstance(mixed, GroupedAttention) and mixed.num_rows == 9
    # Rows keep the step's order: chunk 0 (rows 0-3), decode 0 (4), chunk 1 (5-7), decode 1 (8).
    (_, single), (_, multi) = mixed.groups
    assert not mixed.in_order and mixed.group_rows() == [[4, 8], [0, 1, 2, 3, 5, 6, 7]]
    assert (single.md.max_q, multi.md.max_q) == (1, 4)
    assert mixed.slot_mapping.tolist() == [12, 13, 14, 15, 3, 20, 21, 22, 9]
    with pytest.raises(ValueError, match="rows"):
        mixed(0, *(torch.zeros(8, 2, HD) for _ in range(3)))


def test_a_step_metadata_reaches_the_device_in_one_transfer(monkeypatch):
    """Every group's metadata and the rows' positions: one move_to per step, and the same
    tensors as each group's metadata built alone, from the tables' lists or from a padded
    table array (as the runner's BlockTables gives them)."""
    import numpy as np

    import rltserve.core.attention as attention

    calls = []
    real = attention.move_to
    monkeypatch.setattr(attention, "move_to", lambda t, d: calls.append(t.numel()) or real(t, d))
    items = [(0, 4, [3]), (3, 1, [0]), (40, 1, list(range(11))), (4, 3, [4, 5])]
    kv = allocate_kv_cache(1, NUM_BLOCKS, BS, 2, HD, torch.float32, "cpu")
    width = max(len(t) for _, _, t in items)
    tables = np.array([t + [t[0]] * (width - len(t)) for _, _, t in items], dtype=np.int64)
    for given in (None, tables):
        calls.clear()
        step = paged_attention(kv, items, BS, tables=given)
        assert len(calls) == 1
        assert step.positions.tolist() == [0, 1, 2, 3, 3, 40, 4, 5, 6]
        for rows, (_, attn) in zip(step.group_rows(), step.groups):
            alone = AttentionMetadata.build([items[k] for k in _items_of(rows, items)], BS)
            for name in ("positions", "slot_mapping", "pad_index", "gather_blocks", "mask"):
                assert torch.equal(getattr(attn.md, name), getattr(alone, name)), name


def _items_of(rows: list[int], items) -> list[int]:
    """The items whose rows are ``rows`` (step row order, items in order of first row)."""
    starts, first = [], 0
    for _, n, _ in items:
        starts.append(first)
        first += n
    seen = []
    for row in rows:
        k = max(i for i, s in enumerate(starts) if s <= row)
        if k not in seen:
            seen.append(k)
    return seen


def test_a_pad_budget_makes_items_within_it_one_group():
    # Decode rows at contexts of 8, 9 and 10 blocks of 4 (two groups) beside a chunk (a third).
    starts, lens = np.array([30, 33, 28, 36]), np.array([1, 1, 4, 1])
    assert len(group_indices(starts, lens, 4)) == 3  # (no budget: the CPU's groups)
    # As one batch: 4 items padded to 4 rows over 10 blocks: 640 query-key pairs per head,
    # gathering 160 slots where the groups gather 32 + 80 + 32.
    assert (gathered_slots(starts, lens, 4), padded_pairs(starts, lens, 4)) == (160, 640)
    assert len(group_indices(starts, lens, 4, pad_budget=639)) == 3
    assert [g.tolist() for g in group_indices(starts, lens, 4, pad_budget=640)] == [[0, 1, 2, 3]]
    # Contexts far apart: one batch would gather 416 slots where the groups gather 156 (more
    # than twice as many), whatever the budget.
    starts, lens = np.array([3, 40, 0, 100]), np.array([1, 1, 4, 1])
    assert len(group_indices(starts, lens, 4, pad_budget=1 << 30)) == 4


@pytest.mark.parametrize("bad", [-1, 2.5, "1", None])
def test_the_pad_budget_setting_is_an_int_of_at_least_zero(bad):
    assert EngineConfig.from_flat().execution.attention_pad_budget == 0  # never
    assert EngineConfig.from_flat(attention_pad_budget=7).execution.attention_pad_budget == 7
    with pytest.raises(ValueError, match=rf"attention_pad_budget={bad!r}: must be an int >= 0"):
        EngineConfig.from_flat(attention_pad_budget=bad)


def test_attention_groups_by_context_length():
    items = [(3, 1, ()), (40, 1, ()), (100, 1, ()), (0, 4, ()), (5, 1, ()), (44, 1, ())]
    # columns 1, 11, 26, -, 2, 12 -> buckets 8 (min), 16, 32; the chunk last
    assert attention_groups(items, 4) == [[0, 4], [1, 5], [2], [3]]
    assert attention_groups([(3, 1, ()), (5, 1, ())], 4) == [[0, 1]]
    assert attention_groups([(0, 4, ()), (4, 2, ())], 4) == [[0, 1]]
    # Decode rows of one bucket beside chunks: they, then the chunks.
    assert attention_groups([(0, 4, ()), (3, 1, ()), (9, 2, ()), (20, 1, ())], 4) == [
        [1, 3],
        [0, 2],
    ]


FAR = [(90, 1), (2, 1), (0, 6), (40, 1), (7, 1), (10, 3)]  # 4 groups
NEAR = [(40, 1), (34, 1), (30, 6), (44, 1), (37, 1), (38, 3)]  # 2 groups: decode rows, chunks


@pytest.mark.parametrize(
    "shapes, pad_budget, groups",
    [(FAR, 0, 4), (FAR, 1 << 20, 4), (NEAR, 0, 2), (NEAR, 1 << 20, 1)],
    ids=["far", "far-within-budget", "near", "near-within-budget"],
)
@pytest.mark.parametrize("hkv", [2, 4])
def test_grouped_long_and_short_contexts_match_dense_reference(hkv, shapes, pad_budget, groups):
    """Decode rows and chunks in one step, in mixed order: in groups, or within a pad budget
    as one padded batch (not when it would gather more than twice the context: far)."""
    hq, num_blocks = 4, 96
    gen = torch.Generator().manual_seed(5)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    items, used = [], 0
    for start, n in shapes:
        nblocks = -(-(start + n) // BS)
        items.append((start, n, perm[used : used + nblocks]))
        used += nblocks
    kv = allocate_kv_cache(1, num_blocks, BS, hkv, HD, torch.float32, "cpu")
    attn = paged_attention(kv, items, BS, pad_budget=pad_budget)
    if groups == 1:
        assert isinstance(attn, PagedAttention) and attn.md.max_q == 6
    else:
        assert isinstance(attn, GroupedAttention) and len(attn.groups) == groups
    ctxs = []
    for start, n, table in items:
        k_ctx = torch.randn(start + n, hkv, HD, generator=gen)
        v_ctx = torch.randn(start + n, hkv, HD, generator=gen)
        write_prior(attn.kv, 0, table, k_ctx, v_ctx, start)
        ctxs.append((k_ctx, v_ctx))
    q = torch.randn(sum(n for _, n in shapes), hq, HD, generator=gen)
    k = torch.cat([kc[s:] for (kc, _), (s, _, _) in zip(ctxs, items)])
    v = torch.cat([vc[s:] for (_, vc), (s, _, _) in zip(ctxs, items)])
    out = attn(0, q, k, v)
    row = 0
    for (start, n, _), (k_ctx, v_ctx) in zip(items, ctxs):
        want = dense_reference(q[row : row + n], k_ctx, v_ctx, start)
        torch.testing.assert_close(out[row : row + n].double(), want, atol=2e-6, rtol=1e-6)
        row += n


def test_prefill_then_decode_through_cache():
    """K/V written by earlier steps (chunked prefill, then decode) are what later steps read."""
    gen = torch.Generator().manual_seed(1)
    hq, hkv, total = 4, 2, 11
    table = [9, 3, 17]
    kv = allocate_kv_cache(1, NUM_BLOCKS, BS, hkv, HD, torch.float32, "cpu")
    q_all = torch.randn(total, hq, HD, generator=gen)
    k_all = torch.randn(total, hkv, HD, generator=gen)
    v_all = torch.randn(total, hkv, HD, generator=gen)
    outs = []
    for start, n in [(0, 3), (3, 5), (8, 1), (9, 1), (10, 1)]:
        attn = PagedAttention(kv, AttentionMetadata.build([(start, n, table)], BS))
        sl = slice(start, start + n)
        outs.append(attn(0, q_all[sl], k_all[sl], v_all[sl]))
    want = dense_reference(q_all, k_all, v_all, 0)
    torch.testing.assert_close(torch.cat(outs).double(), want, atol=2e-6, rtol=1e-6)


def test_bf16_sanity():
    gen = torch.Generator().manual_seed(2)
    items = make_items(gen)
    hq, hkv = 4, 2
    kv = allocate_kv_cache(1, NUM_BLOCKS, BS, hkv, HD, torch.bfloat16, "cpu")
    md = AttentionMetadata.build(items, BS)
    ctxs = []
    for start, n, table in items:
        k_ctx = torch.randn(start + n, hkv, HD, generator=gen).bfloat16()
        v_ctx = torch.randn(start + n, hkv, HD, generator=gen).bfloat16()
        write_prior(kv, 0, table, k_ctx, v_ctx, start)
        ctxs.append((k_ctx, v_ctx))
    q = torch.randn(md.num_rows, hq, HD, generator=gen).bfloat16()
    k = torch.cat([kc[s:] for (kc, _), (s, _, _) in zip(ctxs, items)])
    v = torch.cat([vc[s:] for (_, vc), (s, _, _) in zip(ctxs, items)])
    out = PagedAttention(kv, md)(0, q, k, v)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    row = 0
    for (start, n, _), (k_ctx, v_ctx) in zip(items, ctxs):
        want = dense_reference(q[row : row + n], k_ctx, v_ctx, start)
        torch.testing.assert_close(out[row : row + n].double(), want, atol=3e-2, rtol=3e-2)
        row += n


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("decode_only", [False, True])
def test_cuda_matches_dense_reference(dtype, heads, decode_only):
    """The CUDA SDPA kernels get the folded GQA rows, the expanded decode mask and the cached
    additive prefill mask (decode rows grouped apart from the chunks)."""
    hq, hkv = heads
    gen = torch.Generator().manual_seed(4)
    items = make_items(gen)
    if decode_only:
        items = [(start + n - 1, 1, table) for start, n, table in items]
    kv = allocate_kv_cache(2, NUM_BLOCKS, BS, hkv, HD, dtype, "cuda")
    attn = paged_attention(kv, items, BS, "cuda")  # grouped unless decode_only
    num_rows = sum(n for _, n, _ in items)
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    for layer in range(2):  # the second layer reuses the step's cached mask
        ctxs = []
        for start, n, table in items:
            k_ctx = torch.randn(start + n, hkv, HD, generator=gen).to(dtype)
            v_ctx = torch.randn(start + n, hkv, HD, generator=gen).to(dtype)
            write_prior(kv, layer, table, k_ctx.cuda(), v_ctx.cuda(), start)
            ctxs.append((k_ctx, v_ctx))
        q = torch.randn(num_rows, hq, HD, generator=gen).to(dtype)
        k = torch.cat([kc[s:] for (kc, _), (s, _, _) in zip(ctxs, items)])
        v = torch.cat([vc[s:] for (_, vc), (s, _, _) in zip(ctxs, items)])
        out = attn(layer, q.cuda(), k.cuda(), v.cuda()).cpu()
        assert out.dtype == dtype
        row = 0
        for (start, n, _), (k_ctx, v_ctx) in zip(items, ctxs):
            want = dense_reference(q[row : row + n], k_ctx, v_ctx, start)
            torch.testing.assert_close(out[row : row + n].double(), want, atol=tol, rtol=tol)
            row += n


def test_metadata_layout():
    md = AttentionMetadata.build([(2, 2, [5]), (0, 1, [1, 2])], block_size=4)
    assert (md.num_items, md.num_rows, md.max_q, md.max_ctx) == (2, 3, 2, 4)
    assert md.slot_mapping.tolist() == [22, 23, 4]
    assert md.pad_index.tolist() == [0, 1, 2]
    assert md.gather_blocks.tolist() == [5, 1]
    assert md.mask.shape == (2, 1, 2, 4)
    assert md.mask[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    # item 1's padded query row sees the item's whole context (no all-False rows)
    assert md.mask[1, 0].tolist() == [[True, False, False, False], [True, False, False, False]]


def test_metadata_errors():
    with pytest.raises(ValueError):
        AttentionMetadata.build([], 4)
    with pytest.raises(ValueError, match="block table"):
        AttentionMetadata.build([(3, 2, [0])], 4)
    with pytest.raises(ValueError):
        AttentionMetadata.build([(0, 0, [0])], 4)
    md = AttentionMetadata.build([(0, 2, [0])], 4)
    kv = allocate_kv_cache(1, 2, 4, 1, HD, torch.float32, "cpu")
    x = torch.zeros(3, 1, HD)
    with pytest.raises(ValueError, match="rows"):
        PagedAttention(kv, md)(0, x, x, x)


def test_one_item_metadata_is_what_the_items_path_gives():
    """``HostMetadata.of`` one item (a mixed step's chunk group) takes a path of its own: the
    arrays the many-items path gives that item beside others, and the same errors."""
    gen = np.random.default_rng(3)
    array = gen.integers(0, 1000, size=(6, 12))
    for start, n, blocks in [(0, 9, 3), (13, 7, 6), (5, 1, 2), (30, 2, 9)]:
        item = Spans(
            np.array([start]), np.array([n]), np.array([blocks]), rows=np.array([4]), source=array
        )
        got = HostMetadata.of(item, BS)
        # Beside a one-row item in another bucket (so both are computed by the general path).
        pair = Spans(
            np.array([start, 44]),
            np.array([n, 1]),
            np.array([blocks, 12]),
            rows=np.array([4, 1]),
            source=array,
        )
        both = HostMetadata.of(pair, BS)
        ctx = -(-(start + n) // BS)
        assert (got.num_rows, got.num_items, got.max_q, got.max_ctx) == (n, 1, n, start + n)
        assert got.num_cols == ctx
        assert (
            got.positions.tolist() == both.positions[:n].tolist() == list(range(start, start + n))
        )
        assert got.slot_mapping.tolist() == both.slot_mapping[:n].tolist()
        assert got.pad_index.tolist() == list(range(n))
        assert got.tables.tolist() == [array[4, :ctx].tolist()]
        assert all(p.dtype == np.int64 for p in got.parts())
        wide = HostMetadata.of(item, BS, num_cols=ctx + 2)
        assert wide.tables.tolist() == [array[4, : ctx + 2].tolist()]
    one = Spans(np.array([3]), np.array([2]), np.array([1]), rows=np.array([0]), source=array)
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold position 4"):
        HostMetadata.of(one, BS)
    with pytest.raises(ValueError, match=r"item \(start=-1, num_tokens=2\)"):
        HostMetadata.of(Spans(np.array([-1]), np.array([2]), np.array([3]), array[:1]), BS)
    with pytest.raises(ValueError, match="num_cols=1: a context of 5 positions needs 2 blocks"):
        HostMetadata.of(
            Spans(np.array([3]), np.array([2]), np.array([2]), array[:1]), BS, num_cols=1
        )


def test_copy_slots_all_layers():
    kv = torch.randn(3, 2, 16, 2, HD)
    before = kv.clone()
    src = torch.tensor([1, 5, 9])
    dst = torch.tensor([12, 13, 5])  # dst overlaps a src: sources are read first
    copy_slots(kv, src, dst)
    torch.testing.assert_close(kv[:, :, dst], before[:, :, src], rtol=0, atol=0)
    untouched = [s for s in range(16) if s not in (12, 13, 5)]
    assert torch.equal(kv[:, :, untouched], before[:, :, untouched])


def test_the_mask_is_built_where_it_is_first_used():
    """Building a step's metadata queues no mask work; the first attending layer builds it,
    once, and later layers reuse it."""
    md = AttentionMetadata.build([(5, 1, [2, 3]), (1, 1, [0])], block_size=4)
    assert "mask" not in vars(md)
    assert md.mask[:, 0, 0].tolist() == [[True] * 6 + [False] * 2, [True] * 2 + [False] * 6]
    assert md.mask is md.mask


def test_decode_metadata_equals_the_general_build():
    # One-row items whose tables are rows of a persistent array (BlockTables): the packed
    # fast path gives HostMetadata.of's arrays, in one buffer in parts() order.
    gen = np.random.default_rng(0)
    array = gen.integers(0, 1000, size=(12, 9))
    rows = np.array([7, 2, 11, 0, 5])
    starts = np.array([17, 3, 30, 31, 12])
    table_lens = np.array([5, 1, 8, 9, 4])
    positions = decode_positions(starts, BS)
    want = HostMetadata.of(Spans(starts, np.ones(5, dtype=np.int64), table_lens, array[rows]), BS)
    for _ in range(2):  # (the positions serve several steps: each gets a buffer of its own)
        host = decode_metadata(positions, table_lens, array, rows, BS)
        assert host is not None and host.num_cols == want.num_cols == 8
        assert (host.num_rows, host.num_items, host.max_q, host.max_ctx) == (5, 5, 1, 32)
        for got, expected in zip(
            np.split(host.packed, np.cumsum([a.size for a in want.parts()])[:-1]), want.parts()
        ):
            assert got.tolist() == expected.tolist()
        host.packed[:] = -1
    # Other tables at the same positions (a decode batch's next loop, on another plane).
    other = array[::-1].copy()
    host = decode_metadata(positions, table_lens, other, rows, BS)
    want = HostMetadata.of(Spans(starts, np.ones(5, dtype=np.int64), table_lens, other[rows]), BS)
    assert host.packed.tolist() == np.concatenate(want.parts()).tolist()
    # Contexts in two attention groups, or a table too short for its position: the general
    # path decides (and names the item in its error).
    assert decode_positions(np.array([3, 40]), BS) is None
    two = decode_positions(np.array([3, 8]), BS)
    assert decode_metadata(two, np.array([1, 2]), array, rows[:2], BS) is None
    assert decode_metadata(two, np.array([1, 3]), array, rows[:2], BS) is not None
    with pytest.raises(ValueError, match="start"):
        decode_positions(np.array([-1, 3]), BS)


def test_spans_of_block_table_rows_take_them_at_each_group_width():
    # Tables given as rows of a persistent array (BlockTables) are taken per attention group,
    # at that group's width: the same metadata as tables gathered up front.
    gen = np.random.default_rng(1)
    array = gen.integers(0, 1000, size=(10, 40))
    rows = np.array([3, 8, 1, 6])
    starts, lens = np.array([5, 70, 0, 9]), np.array([1, 1, 12, 1])
    table_lens = np.array([2, 18, 3, 3])
    by_rows = Spans(starts, lens, table_lens, rows=rows, source=array)
    gathered = Spans(starts, lens, table_lens, array[rows])
    for ks in (np.array([0, 3]), np.array([2]), np.array([1, 0])):
        got, want = HostMetadata.of(by_rows.take(ks), BS), HostMetadata.of(gathered.take(ks), BS)
        assert got.num_cols == want.num_cols
        assert [p.tolist() for p in got.parts()] == [p.tolist() for p in want.parts()]
