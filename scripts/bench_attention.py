#!/usr/bin/env python
"""Benchmark: paged attention of one decode step, GQA without and with a per-head K/V copy.

    python scripts/bench_attention.py                 # JSON on stdout
    python scripts/bench_attention.py --out a.json    # also write it to a file

For each shape (items, query heads, kv heads, context, head dim) one ``PagedAttention`` call
(write K/V, gather the context blocks, attend) is timed against the same call with the gathered
K/V expanded to one copy per query head (the straightforward GQA implementation, which the
engine used before). The two run alternately; medians of the per-call times and their ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rltserve.core.attention import AttentionMetadata, PagedAttention, allocate_kv_cache  # noqa: E402

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
    times: list[list[float]] = [[], []]
    for r in range(repeats):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
    engine, copied = (statistics.median(t) * 1e3 for t in times)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with torch.inference_mode():
        rows = [bench_shape(s, args.repeats) for s in SHAPES]
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
