"""DecodeGraphs: bucketing, padding and static metadata (emulate backend, on the CPU), and the
real CUDA graphs against the same emulation (gpu marker)."""

from __future__ import annotations

import pytest
import torch
from builders import build_nanbeige_tiny

from rltserve.core.attention import AttentionMetadata, PagedAttention, paged_attention
from rltserve.core.cuda_graphs import DecodeGraphs, col_buckets, row_buckets
from rltserve.models import load_model

BS = 4
MAX_ROWS = 12  # row buckets 1, 2, 4, 8, 12
MAX_COLS = 6  # column buckets 1, 2, 4, 6
NUM_BLOCKS = MAX_ROWS * MAX_COLS + 1
SCRATCH = NUM_BLOCKS - 1  # never in a block table
# Exactly a bucket, just above one, the max_rows bucket, then smaller N in used buckets (stale
# padding rows from the larger N must not leak into the result).
STEP_ROWS = [1, 2, 3, 4, 5, 8, 9, 12, 10, 3, 6]


@pytest.fixture(scope="module")
def nanbeige_tiny(tmp_path_factory):
    return build_nanbeige_tiny(tmp_path_factory.mktemp("nanbeige") / "ckpt")


@pytest.fixture(params=["ouro", "huginn", "nanbeige"])
def family(request):
    return request.param


def checkpoint(request, family):
    name = {"ouro": "ouro_rv1", "huginn": "huginn_rv1", "nanbeige": "nanbeige_tiny"}[family]
    return request.getfixturevalue(name)


def random_kv(model, device, gen):
    spec = model.spec
    shape = (spec.num_core_layers, 2, NUM_BLOCKS * BS, spec.num_kv_heads, spec.head_dim)
    dtype = next(model.parameters()).dtype
    return torch.randn(shape, generator=gen).to(device, dtype)  # prior contents everywhere


def decode_spans(n, gen, max_start=MAX_COLS * BS - 1):
    """n one-token spans at random positions over distinct random blocks (never SCRATCH)."""
    perm = torch.randperm(NUM_BLOCKS - 1, generator=gen).tolist()
    spans, used = [], 0
    for start in torch.randint(0, max_start + 1, (n,), generator=gen).tolist():
        cols = start // BS + 1 + int(torch.randint(0, 2, (1,), generator=gen))  # maybe longer
        spans.append((start, 1, perm[used : used + cols]))
        used += cols
    return spans


def step_inputs(model, spans, device, gen):
    n, size = len(spans), model.spec.state_size
    dtype = next(model.parameters()).dtype
    state = torch.randn(n, size, generator=gen).to(device, dtype)  # [N, S]
    e = torch.randn(n, size, generator=gen).to(device, dtype) if model.spec.needs_noise else None
    return state, e


def eager_loop(model, kv, state, e, spans):
    """The loop as the runner runs it without graphs."""
    md = AttentionMetadata.build(spans, BS, kv.device)
    with torch.inference_mode():
        return model.loop(state, e, md.positions, paged_attention(kv, spans, BS, kv.device))


def real_slots(kv):
    return kv[:, :, : SCRATCH * BS]  # every slot but the scratch block's


def make_graphs(model, kv, backend="emulate"):
    return DecodeGraphs(
        model,
        kv,
        block_size=BS,
        scratch_block=SCRATCH,
        max_rows=MAX_ROWS,
        max_cols=MAX_COLS,
        backend=backend,
    )


def padded_eager_loop(model, kv, state, e, spans, bucket):
    """What the emulation should compute: eager over the bucket's padded batch by hand."""
    rows, cols = bucket
    pad = rows - len(spans)
    md = AttentionMetadata.build(spans + [(0, 1, [SCRATCH])] * pad, BS, kv.device, num_cols=cols)
    state = torch.cat([state, state.new_zeros(pad, state.shape[1])])
    e = None if e is None else torch.cat([e, e.new_zeros(pad, e.shape[1])])
    with torch.inference_mode():
        return model.loop(state, e, md.positions, PagedAttention(kv, md))[: len(spans)]


def test_emulate_matches_eager(request, family):
    model = load_model(checkpoint(request, family), dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(1)
    kv_eager = random_kv(model, "cpu", gen)
    kv_padded, kv_graph = kv_eager.clone(), kv_eager.clone()
    graphs = make_graphs(model, kv_graph)
    keys = set()
    for n in STEP_ROWS:
        spans = decode_spans(n, gen)
        state, e = step_inputs(model, spans, "cpu", gen)
        key = graphs.bucket(spans)
        assert key is not None
        keys.add(key)
        out = graphs.run(state, e, spans)
        assert out._base is None and out.shape == state.shape

        # The static buffers and metadata reproduce the padded batch exactly (scratch included).
        padded = padded_eager_loop(model, kv_padded, state, e, spans, key)
        assert torch.equal(out, padded), (family, n)
        assert torch.equal(kv_graph, kv_padded), (family, n)

        # Against the unpadded batch only rounding differs: on the CPU, MKL's GEMM and the SDPA
        # kernel block their loops by the number of rows and key columns, so the padded batch
        # sums in another order (last-bit differences, ~1e-7 here).
        ref = eager_loop(model, kv_eager, state, e, spans)
        # Prior KV is random, so a write to any other real slot would fail too.
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(real_slots(kv_graph), real_slots(kv_eager), rtol=1e-5, atol=1e-5)
    assert graphs.num_replays == len(STEP_ROWS) and graphs.num_eager == 0
    assert graphs.num_captured == len(keys)


def test_bucket_choice_and_eligibility(ouro_rv1):
    model = load_model(ouro_rv1, dtype="float32", device="cpu")
    kv = random_kv(model, "cpu", torch.Generator().manual_seed(0))
    graphs = make_graphs(model, kv)
    one = (0, 1, [0])
    assert graphs.row_sizes == [1, 2, 4, 8, 12] and graphs.col_sizes == [1, 2, 4, 6]
    for n, rows in [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 12), (12, 12)]:
        assert graphs.bucket([one] * n) == (rows, 1)
    table = list(range(MAX_COLS))
    for start, cols in [(0, 1), (3, 1), (4, 2), (8, 4), (15, 4), (16, 6), (23, 6)]:
        assert graphs.bucket([one, (start, 1, table)]) == (2, cols), start
    assert graphs.bucket([]) is None
    assert graphs.bucket([one, (5, 2, table)]) is None  # a prefill chunk
    assert graphs.bucket([one] * (MAX_ROWS + 1)) is None  # too many rows
    assert graphs.bucket([(MAX_COLS * BS, 1, table + [7])]) is None  # context beyond max_cols


def test_bucket_sizes():
    assert row_buckets(1) == [1]
    assert row_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert row_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert row_buckets(300)[-3:] == [192, 256, 300]
    assert col_buckets(1) == [1]
    assert col_buckets(8) == [1, 2, 4, 8]
    assert col_buckets(6) == [1, 2, 4, 6]


def test_counters_and_eager_fallback(ouro_rv1):
    model = load_model(ouro_rv1, dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(2)
    kv = random_kv(model, "cpu", gen)
    kv_eager = kv.clone()
    graphs = make_graphs(model, kv)
    for n in (3, 4, 3, 7):  # buckets (4, C) three times, (8, C) once; C = 1 at start 0
        spans = [(0, 1, [i]) for i in range(n)]
        graphs.run(*step_inputs(model, spans, "cpu", gen), spans)
    assert (graphs.num_captured, graphs.num_replays, graphs.num_eager) == (2, 4, 0)

    kv_eager.copy_(kv)
    spans = [(0, 3, [0]), (5, 1, [1, 2])]  # a prefill chunk: not eligible, runs eagerly
    state, _ = step_inputs(model, [None] * 4, "cpu", gen)
    out = graphs.run(state, None, spans)
    assert torch.equal(out, eager_loop(model, kv_eager, state, None, spans))
    assert torch.equal(kv, kv_eager)
    assert (graphs.num_captured, graphs.num_replays, graphs.num_eager) == (2, 4, 1)
    with pytest.raises(ValueError, match="rows"):
        graphs.run(state[:2], None, spans)


def test_construction_errors(ouro_rv1):
    model = load_model(ouro_rv1, dtype="float32", device="cpu")
    kv = random_kv(model, "cpu", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="cpu"):
        make_graphs(model, kv, backend="cuda")
    with pytest.raises(ValueError, match="'tpu'"):
        make_graphs(model, kv, backend="tpu")
    with pytest.raises(ValueError, match="scratch_block"):
        DecodeGraphs(
            model,
            kv,
            block_size=BS,
            scratch_block=NUM_BLOCKS,
            max_rows=4,
            max_cols=4,
            backend="emulate",
        )


def test_metadata_num_cols_padding():
    items = [(5, 1, [3, 7]), (0, 2, [9]), (1, 1, [4, 6, 8])]
    default = AttentionMetadata.build(items, BS)
    same = AttentionMetadata.build(items, BS, num_cols=2)
    for name in ("positions", "slot_mapping", "pad_index", "gather_blocks", "mask"):
        assert torch.equal(getattr(same, name), getattr(default, name)), name
    assert (same.num_rows, same.num_items, same.max_q, same.max_ctx) == (4, 3, 2, 6)

    wide = AttentionMetadata.build(items, BS, num_cols=4)
    assert wide.gather_blocks.tolist() == [3, 7, 3, 3, 9, 9, 9, 9, 4, 6, 8, 4]
    assert wide.mask.shape == (3, 1, 2, 4 * BS)
    assert torch.equal(wide.mask[..., : 2 * BS], default.mask)
    assert not wide.mask[..., 2 * BS :].any()
    for name in ("positions", "slot_mapping", "pad_index"):
        assert torch.equal(getattr(wide, name), getattr(default, name)), name
    assert (wide.num_rows, wide.num_items, wide.max_q, wide.max_ctx) == (4, 3, 2, 6)

    with pytest.raises(ValueError, match="num_cols=1"):
        AttentionMetadata.build(items, BS, num_cols=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_match_emulation_and_eager(request, family, dtype):
    device = torch.device("cuda")
    model = load_model(checkpoint(request, family), dtype=dtype, device=device)
    # Unpadded eager may pick other GEMM/attention kernels on the GPU: rounding only.
    tol = {"float32": 1e-4, "bfloat16": 5e-2}[dtype]
    gen = torch.Generator().manual_seed(3)
    kv_eager = random_kv(model, device, gen)
    kv_emul, kv_graph = kv_eager.clone(), kv_eager.clone()
    emul = make_graphs(model, kv_emul, backend="emulate")
    graphs = make_graphs(model, kv_graph, backend="cuda")
    for n in STEP_ROWS:
        spans = decode_spans(n, gen)
        state, e = step_inputs(model, spans, device, gen)
        out = graphs.run(state, e, spans)
        # The replay runs the emulation's kernels on the same shapes: bit-identical.
        assert torch.equal(out, emul.run(state, e, spans)), (family, n)
        assert torch.equal(real_slots(kv_graph), real_slots(kv_emul)), (family, n)
        ref = eager_loop(model, kv_eager, state, e, spans)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        torch.testing.assert_close(real_slots(kv_graph), real_slots(kv_eager), rtol=tol, atol=tol)
    assert graphs.num_captured == emul.num_captured
    assert all(b.graph is not None for b in graphs._buckets.values())
    assert graphs.num_replays == len(STEP_ROWS) and graphs.num_eager == 0

    spans = [(0, 1, [0])]  # bucket (1, 1): captured at most once, then only replayed
    captured = []
    for _ in range(3):
        state, e = step_inputs(model, spans, device, gen)
        out = graphs.run(state, e, spans)
        assert torch.equal(out, emul.run(state, e, spans))
        captured.append(graphs.num_captured)
    assert captured[0] == captured[1] == captured[2]
    assert graphs.num_replays == len(STEP_ROWS) + 3

    spans = [(0, 3, [0]), (5, 1, [1, 2])]  # prefill: eager fallback
    assert graphs.bucket(spans) is None
    kv_eager.copy_(kv_graph)
    state, e = step_inputs(model, [None] * 4, device, gen)
    out = graphs.run(state, e, spans)
    assert torch.equal(out, eager_loop(model, kv_eager, state, e, spans))
    assert graphs.num_eager == 1


def test_capture_all_builds_every_bucket(ouro_rv1):
    model = load_model(ouro_rv1, dtype="float32", device="cpu")
    kv = random_kv(model, "cpu", torch.Generator().manual_seed(0))
    graphs = DecodeGraphs(
        model, kv, block_size=BS, scratch_block=SCRATCH, max_rows=8, max_cols=4, backend="emulate"
    )
    graphs.capture_all()
    assert graphs.num_captured == len(graphs.row_sizes) * len(graphs.col_sizes)
    graphs.capture_all()  # idempotent
    assert graphs.num_captured == len(graphs.row_sizes) * len(graphs.col_sizes)


def test_failed_capture_leaves_the_bucket_eager(ouro_rv1, monkeypatch):
    model = load_model(ouro_rv1, dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(1)
    kv = random_kv(model, "cpu", gen)
    graphs = DecodeGraphs(
        model, kv, block_size=BS, scratch_block=SCRATCH, max_rows=8, max_cols=4, backend="emulate"
    )
    graphs.backend = "cuda"  # take the capture path, with a capture that fails

    calls = []

    def fail(bucket):  # fails once the capture has begun
        calls.append(1)
        graphs._capturing = True
        raise RuntimeError("capture failed")

    monkeypatch.setattr(graphs, "_capture", fail)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    spans = decode_spans(3, gen, max_start=4 * BS - 1)
    state, e = step_inputs(model, spans, "cpu", gen)
    want = eager_loop(model, kv.clone(), state, e, spans)
    for _ in range(2):  # the second run does not retry the capture
        got = graphs.run(state, e, spans)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert graphs.num_eager == 2 and graphs.num_replays == 0
    assert graphs.capture_failed and calls == [1]

    # After a failure no other bucket is captured: they all run eagerly.
    spans = decode_spans(6, gen, max_start=BS - 1)
    assert graphs.bucket(spans) == (8, 1)  # another bucket than the first run's
    state, e = step_inputs(model, spans, "cpu", gen)
    want = eager_loop(model, kv.clone(), state, e, spans)
    torch.testing.assert_close(graphs.run(state, e, spans), want, rtol=0, atol=0)
    assert graphs.num_eager == 3 and calls == [1]


def test_failed_warmup_leaves_only_that_bucket_eager(ouro_rv1, monkeypatch):
    """A failure before the capture begins (say, out of memory in a warm-up loop) does not
    stop other buckets from being captured."""
    model = load_model(ouro_rv1, dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(2)
    kv = random_kv(model, "cpu", gen)
    graphs = DecodeGraphs(
        model, kv, block_size=BS, scratch_block=SCRATCH, max_rows=8, max_cols=4, backend="emulate"
    )
    graphs.backend = "cuda"
    attempts = []

    def warmup_fails(bucket):
        attempts.append(bucket.state.shape[0])
        raise torch.cuda.OutOfMemoryError("out of memory")

    monkeypatch.setattr(graphs, "_capture", warmup_fails)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    for n in (3, 6):
        spans = decode_spans(n, gen, max_start=BS - 1)
        state, e = step_inputs(model, spans, "cpu", gen)
        want = eager_loop(model, kv.clone(), state, e, spans)
        torch.testing.assert_close(graphs.run(state, e, spans), want, rtol=0, atol=0)
    assert attempts == [4, 8] and not graphs.capture_failed
    assert graphs.num_eager == 2 and graphs.num_captured == 2


@pytest.mark.gpu
def test_cuda_capture_failure_restores_the_stream(ouro_rv1, monkeypatch):
    """A real capture that raises after capture_begin: the caller's stream is current again,
    the capture state is closed (eager work still runs), and no further capture is tried."""
    device = torch.device("cuda")
    model = load_model(ouro_rv1, dtype="float32", device=device)
    gen = torch.Generator().manual_seed(5)
    kv = random_kv(model, device, gen)
    graphs = make_graphs(model, kv.clone(), backend="cuda")
    loop = graphs._loop

    def loop_fails_in_capture(bucket):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("planted failure inside the capture")
        return loop(bucket)

    monkeypatch.setattr(graphs, "_loop", loop_fails_in_capture)
    caller = torch.cuda.Stream(device)
    with torch.cuda.stream(caller):
        spans = decode_spans(3, gen)
        state, e = step_inputs(model, spans, device, gen)
        out = graphs.run(state, e, spans)
        assert torch.cuda.current_stream(device) == caller
    assert not torch.cuda.is_current_stream_capturing()
    assert graphs.capture_failed and graphs.num_eager == 1
    torch.testing.assert_close(out, eager_loop(model, kv, state, e, spans), rtol=1e-4, atol=1e-4)
    spans = decode_spans(9, gen)  # another bucket: eager, nothing built or captured
    state, e = step_inputs(model, spans, device, gen)
    graphs.run(state, e, spans)
    assert graphs.num_captured == 1 and graphs.num_eager == 2
