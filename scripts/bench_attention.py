#!/usr/bin/env python
"""Benchmark: paged attention of one decode step, GQA without and with a per-head K/V copy;
mixed steps (decode rows and a prompt chunk) grouped vs one padded batch; and the host cost of
building a step's attention inputs.

    python scripts/bench_attention.py                 # JSON on stdout
    python scripts/bench_attention.py --out a.json    # also write it to a file
    python scripts/bench_attention.py --host-only     # only the host costs (fast)

For each shape (items, query heads, kv heads, context, head dim) one ``PagedAttention`` call
(write K/V, gather the context blocks, attend) is timed against the same call with the gathered
K/V expanded to one copy per query head (the straightforward GQA implementation). The two
run alternately; medians of the per-call times and their ratio.
Mixed steps: ``paged_attention`` (decode rows and the chunk attend apart) against one
``PagedAttention`` over all items (every decode row padded to the chunk's rows), same inputs.
Host costs: ``AttentionMetadata.build`` for decode steps and ``to_device`` of int lists on the
CPU, medians of 300 calls (the script imports the rltserve beside it, so a copy placed in
another checkout measures that checkout).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rltserve.core.attention import (  # noqa: E402
    AttentionMetadata,
    PagedAttention,
    allocate_kv_cache,
    paged_attention,
)
from rltserve.core.staging import to_device  # noqa: E402

# (items, q heads, kv heads, context, head dim): ouro-tiny, Nanbeige-like, Ouro-like (MHA).
SHAPES = ((128, 4, 2, 80, 16), (32, 48, 8, 512, 128), (32, 16, 16, 512, 128))
BLOCK = 16


def copied_kv(attn: PagedAttention, layer: int, q, k, v) -> torch.Tensor:
    """The same step with K/V expanded to every query head before attention."""
    md, kv = attn.md, attn.kv
    n, hq, hd = q.shape
    hkv = k.shape[1]
    kv[layer, 0].index_copy_(0, md.slot_mapping, k)
    kv[layer, 1].index_copy_(0, md.slot_mapping, v)
    ctx = md.mask.shape[-1]
    blocks = (-1, md.block_size, hkv, hd)
    out = []
    for cache in (kv[layer, 0], kv[layer, 1]):
        g = cache.view(blocks).index_select(0, md.gather_blocks).view(n, ctx, hkv, hd)
        g = g.transpose(1, 2)[:, :, None].expand(n, hkv, hq // hkv, ctx, hd)
        out.append(g.reshape(n, hq, ctx, hd))
    qv = q.view(n, 1, hq, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(qv, *out, attn_mask=md.mask, scale=1 / math.sqrt(hd))
    return o.transpose(1, 2).reshape(n, hq, hd)


def _alternate(fns: list, repeats: int) -> list[float]:
    """Median milliseconds of each of two calls, run alternately (A B, B A, ...) so that load
    from other processes hits both alike."""
    times: list[list[float]] = [[], []]
    for r in range(repeats):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def bench_shape(shape: tuple[int, ...], repeats: int) -> dict:
    items, hq, hkv, ctx, hd = shape
    cols = -(-ctx // BLOCK)
    kv = allocate_kv_cache(1, items * cols, BLOCK, hkv, hd, torch.float32, "cpu")
    kv.normal_()
    spans = [(ctx - 1, 1, list(range(i * cols, (i + 1) * cols))) for i in range(items)]
    attn = PagedAttention(kv, AttentionMetadata.build(spans, BLOCK))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(items, hq, hd, generator=gen)
    k = torch.randn(items, hkv, hd, generator=gen)
    v = torch.randn(items, hkv, hd, generator=gen)
    fns = [lambda: attn(0, q, k, v), lambda: copied_kv(attn, 0, q, k, v)]
    diff = (fns[0]() - fns[1]()).abs().max().item()
    engine, copied = _alternate(fns, repeats)
    return {
        "items": items,
        "q_heads": hq,
        "kv_heads": hkv,
        "context": ctx,
        "head_dim": hd,
        "engine_ms": round(engine, 3),
        "copied_kv_ms": round(copied, 3),
        "speedup": round(copied / engine, 2),
        "max_abs_diff": diff,
    }


# (decode rows, their context, prompt chunk rows, one more decode row's context) at 8 heads x
# 64 (ouro-small-like, MHA); 0 leaves the chunk or the long row out.
MIXED = ((128, 100, 256, 0), (32, 500, 512, 0), (128, 100, 32, 0), (127, 100, 0, 4000))


def bench_mixed(shape: tuple[int, int, int, int], repeats: int) -> dict:
    decodes, ctx, chunk, long_ctx = shape
    heads, head_dim = 8, 64
    cols = -(-(max(ctx + 8, chunk, long_ctx + 1)) // BLOCK)
    items = decodes + (chunk > 0) + (long_ctx > 0)
    kv = allocate_kv_cache(1, items * cols, BLOCK, heads, head_dim, torch.float32, "cpu")
    kv.normal_()
    rng = random.Random(0)

    def table(i: int) -> list[int]:
        return list(range(i * cols, (i + 1) * cols))

    spans = [(ctx - 1 + rng.randrange(8), 1, table(i)) for i in range(decodes)]
    if chunk:
        spans.append((0, chunk, table(len(spans))))
    if long_ctx:
        spans.append((long_ctx - 1, 1, table(len(spans))))
    rows = sum(n for _, n, _ in spans)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(rows, heads, head_dim, generator=gen) for _ in range(3))

    def grouped():
        return paged_attention(kv, spans, BLOCK)(0, q, k, v)

    def padded():
        return PagedAttention(kv, AttentionMetadata.build(spans, BLOCK))(0, q, k, v)

    diff = (grouped() - padded()).abs().max().item()
    fast, slow = _alternate([grouped, padded], repeats)
    return {
        "decode_rows": decodes,
        "decode_context": ctx,
        "chunk_rows": chunk,
        "long_row_context": long_ctx,
        "grouped_ms": round(fast, 3),
        "one_padded_batch_ms": round(slow, 3),
        "speedup": round(slow / fast, 2),
        "max_abs_diff": diff,
    }


def _median_us(fn, repeats: int = 300) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def host_costs() -> dict:
    rng = random.Random(0)
    out = {}
    for items, cols in ((200, 4), (128, 64)):  # decode rows x block-table columns
        spans = [
            (rng.randrange((cols - 1) * BLOCK), 1, list(range(i * cols, (i + 1) * cols)))
            for i in range(items)
        ]
        out[f"metadata_build_{items}x{cols}_us"] = _median_us(
            lambda s=spans: AttentionMetadata.build(s, BLOCK)
        )
    cpu = torch.device("cpu")
    for n in (128, 1024):
        values = list(range(n))
        out[f"to_device_{n}_ints_us"] = _median_us(lambda v=values: to_device(v, cpu))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--host-only", action="store_true", help="skip the attention calls")
    args = parser.parse_args()
    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    with torch.inference_mode():
        if not args.host_only:
            report["rows"] = [bench_shape(s, args.repeats) for s in SHAPES]
            report["mixed"] = [bench_mixed(m, max(args.repeats // 2, 4)) for m in MIXED]
        report["host"] = host_costs()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
