"""CUDA graphs for the core loop of decode-only steps, bucketed by (rows, context block columns).

A step is *decode-only* when every span ``(start, num_tokens, block_table)`` has one token (at
position ``start``). Such a step of N rows whose longest context needs c block columns runs in
the smallest bucket (B, C) with B >= N and C >= c: its inputs are copied into the bucket's static
buffers, padded to B rows, and the loop captured for that bucket is replayed. Any other step runs
``model.loop`` eagerly, exactly as the runner does without graphs.

Padding rows have state (and e) zero at position 0 with the span ``(0, 1, [scratch_block])``:
they write K/V only into the scratch block, a block the KV pool never hands out, and attend to
the one key they have just written, so they never produce NaN and never touch a real block.
Real rows do the eager math; their masks only gain masked-out key columns. (Results may differ
from an unpadded eager batch in the last bits where kernels block by row or key count.)

Backends:
- ``"cuda"``: a bucket is captured by ``capture_all`` (the runner calls it at start-up) or on
  its first use (two warm-up loops on the capture stream, then the capture); all graphs of one
  object share one memory pool and one capture stream. Replays are enqueued on the caller's
  current stream. A bucket whose warm-up fails (say, out of memory) stays eager; a failed
  capture leaves every bucket eager from then on, since CUDA's capture state may be unusable.
- ``"emulate"``: the same buffers, padding and metadata, but ``model.loop`` runs eagerly on the
  static buffers instead of a replay. It needs no GPU; the CPU tests check the padding logic
  with it.

The graphs hold the addresses of ``kv``, the model weights and the static buffers: ``kv`` must
stay the same tensor for the lifetime of the object (in-place writes are fine), and weights may
only be changed in place.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rltserve.core.attention import AttentionMetadata, PagedAttention, paged_attention
from rltserve.core.metadata import ItemSpec
from rltserve.core.staging import to_device
from rltserve.models.base import LoopedModel

logger = logging.getLogger(__name__)

BACKENDS = ("cuda", "emulate")
# AttentionMetadata tensors copied into a bucket's static metadata on every run.
_MD_TENSORS = ("positions", "slot_mapping", "pad_index", "gather_blocks", "mask")


def row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... below ``max_rows``, then ``max_rows`` itself."""
    sizes, p = [1, 2, 4, 8], 16
    while p < max_rows:
        sizes += [p, p + p // 2]
        p *= 2
    return [s for s in sizes if s < max_rows] + [max_rows]


def col_buckets(max_cols: int) -> list[int]:
    """Powers of two below ``max_cols``, then ``max_cols`` itself."""
    sizes, c = [], 1
    while c < max_cols:
        sizes.append(c)
        c *= 2
    return sizes + [max_cols]


@dataclass
class _Bucket:
    """Static buffers of one (B, C) bucket: besides kv and the weights, the only memory its
    captured graph reads (state, e, md) or writes (out)."""

    state: torch.Tensor  # [B, S] model dtype
    e: torch.Tensor | None  # [B, E] model dtype, or None for models whose loop ignores e
    md: AttentionMetadata  # B items of one row over C columns; md.positions are the loop's
    attn: PagedAttention  # over kv and md
    graph: torch.cuda.CUDAGraph | None = None  # cuda backend, once captured
    out: torch.Tensor | None = None  # [B, S]: the captured loop's output (graph pool memory)
    eager_only: bool = False  # not captured (a failure): the bucket's steps run eagerly


class DecodeGraphs:
    """Runs one core loop per call: replayed from a per-bucket CUDA graph for decode-only steps
    that fit (``bucket`` is not None), eager otherwise.

    ``kv`` is the core KV tensor the engine's ``PagedAttention`` uses and ``scratch_block`` a
    block id of it that no request ever gets (allocate the pool with one extra block). Buckets
    are (rows B, block columns C) with B in ``row_buckets(max_rows)`` and C in
    ``col_buckets(max_cols)``. ``stream`` is the capture stream (cuda backend only; default: one
    private side stream). Counters: ``num_captured`` buckets built, ``num_replays`` bucketed runs
    (replays, or emulated replays), ``num_eager`` runs outside the buckets or in buckets left
    eager (once a capture fails, no further bucket is built or captured).
    """

    def __init__(
        self,
        model: LoopedModel,
        kv: torch.Tensor,
        *,
        block_size: int,
        scratch_block: int,
        max_rows: int,
        max_cols: int,
        backend: str = "cuda",
        stream: torch.cuda.Stream | None = None,
        pad_budget: int = 0,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
        if backend == "cuda" and kv.device.type != "cuda":
            raise ValueError(f"backend='cuda' needs kv on a CUDA device, got device={kv.device}")
        if block_size < 1 or max_rows < 1 or max_cols < 1:
            raise ValueError(
                f"need block_size, max_rows, max_cols >= 1: {block_size=}, {max_rows=}, {max_cols=}"
            )
        num_blocks = kv.shape[2] // block_size
        if not 0 <= scratch_block < num_blocks:
            raise ValueError(f"scratch_block={scratch_block} is not a block of kv ({num_blocks})")
        self.model = model
        self.kv = kv  # [L, 2, num_slots, Hkv, hd]
        self.block_size = block_size
        self.pad_budget = pad_budget  # of the steps that run eagerly (``group_indices``)
        self.scratch_block = scratch_block
        self.max_rows, self.max_cols = max_rows, max_cols
        self.backend = backend
        self.device = kv.device
        self.dtype = next(model.parameters()).dtype
        self.row_sizes = row_buckets(max_rows)
        self.col_sizes = col_buckets(max_cols)
        self._stream = stream
        self._pool = None  # graph memory pool handle, created with the first capture
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self.num_captured = 0
        self.num_replays = 0
        self.num_eager = 0
        self.capture_failed = False  # a capture failed: no other bucket is built or captured
        self._capturing = False  # inside a capture (a failure there sets capture_failed)

    def bucket(self, spans: Sequence[ItemSpec]) -> tuple[int, int] | None:
        """The smallest (B, C) bucket that fits a decode-only step, or None if it is not one."""
        n = len(spans)
        if not 0 < n <= self.max_rows or any(num != 1 for _, num, _ in spans):
            return None
        cols = max(start for start, _, _ in spans) // self.block_size + 1  # ceil((start+1)/bs)
        if cols > self.max_cols:
            return None
        rows = self.row_sizes[bisect.bisect_left(self.row_sizes, n)]
        return rows, self.col_sizes[bisect.bisect_left(self.col_sizes, cols)]

    def run(
        self,
        state: torch.Tensor,
        e: torch.Tensor | None,
        spans: Sequence[ItemSpec],
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One loop over the rows of ``spans``: state [N, S], e [N, E] or None -> [N, S], a fresh
        tensor (never a view of a static buffer). Writes the rows' K/V into ``kv`` as eager.
        ``positions`` [N]: the rows' positions if the caller has them (steps outside the buckets
        need them; otherwise they are derived from the spans)."""
        num_rows = sum(num for _, num, _ in spans)
        if state.shape[0] != num_rows or (e is not None and e.shape[0] != num_rows):
            raise ValueError(f"spans have {num_rows} rows, state {tuple(state.shape)}")
        key = self.bucket(spans)
        b = None if key is None else self._buckets.get(key)
        with torch.inference_mode():
            if key is not None and b is None and not self.capture_failed:
                b = self._buckets[key] = self._new_bucket(*key, e is not None)
                self.num_captured += 1
            if b is not None and (b.e is None) != (e is None):
                raise ValueError(f"bucket {key} was built with e={b.e is not None}, not now")
            if b is not None and self.backend == "cuda" and b.graph is None and not b.eager_only:
                self._capture_or_give_up(b)
            if b is None or b.eager_only:
                self.num_eager += 1
                if positions is None:
                    flat = [p for start, n, _ in spans for p in range(start, start + n)]
                    positions = to_device(flat, self.device)
                attn = paged_attention(
                    self.kv, spans, self.block_size, self.device, pad_budget=self.pad_budget
                )
                return self.model.loop(state, e, positions, attn)
            self._fill(b, key, state, e, spans)
            self.num_replays += 1
            if self.backend == "emulate":
                return self._loop(b)[:num_rows].clone()
            with torch.cuda.device(self.device):
                b.graph.replay()
            # b.out is read only right after its own replay: graphs share one pool, so another
            # bucket's replay may reuse its memory for intermediates.
            return b.out[:num_rows].clone()

    def capture_all(self) -> None:
        """Builds (and on CUDA captures) every bucket now, largest first so that the shared
        pool is sized by the largest graph, instead of on first use mid-serving (a capture
        synchronises the device and empties the allocator's cache)."""
        with_e = self.model.spec.needs_noise  # the loop re-injects e (Huginn)
        with torch.inference_mode():
            for key in sorted(
                ((r, c) for r in self.row_sizes for c in self.col_sizes), reverse=True
            ):
                if self.capture_failed:
                    return
                if key in self._buckets:
                    continue
                b = self._buckets[key] = self._new_bucket(*key, with_e)
                self.num_captured += 1
                if self.backend == "cuda":
                    self._capture_or_give_up(b)

    def _capture_or_give_up(self, b: _Bucket) -> None:
        if self.capture_failed:
            b.eager_only = True
            return
        self._capturing = False
        try:
            with torch.cuda.device(self.device):
                self._capture(b)
        except Exception:  # e.g. out of memory: this bucket's steps run eagerly
            b.graph, b.out, b.eager_only = None, None, True
            # A failure once capture had begun may leave CUDA unable to capture again.
            self.capture_failed = self._capturing
            rows, cols = b.state.shape[0], b.md.num_cols
            if self.capture_failed:
                logger.warning(
                    "CUDA graph capture of bucket (%d rows, %d columns) failed; decode steps "
                    "run eagerly from now on",
                    rows,
                    cols,
                    exc_info=True,
                )
            else:
                logger.warning(
                    "CUDA graph warm-up of bucket (%d rows, %d columns) failed; that bucket "
                    "runs eagerly",
                    rows,
                    cols,
                    exc_info=True,
                )

    def _new_bucket(self, rows: int, cols: int, with_e: bool) -> _Bucket:
        size = self.model.spec.state_size
        state = torch.zeros(rows, size, dtype=self.dtype, device=self.device)
        e_buf = None
        if with_e:  # e has the state's width in every family that re-injects it
            e_buf = torch.zeros(rows, size, dtype=self.dtype, device=self.device)
        pads = [(0, 1, (self.scratch_block,))] * rows
        md = AttentionMetadata.build(pads, self.block_size, self.device, num_cols=cols)
        md = dataclasses.replace(md, max_ctx=cols * self.block_size)  # capacity, not this step's
        return _Bucket(state, e_buf, md, PagedAttention(self.kv, md))

    def _fill(
        self,
        b: _Bucket,
        key: tuple[int, int],
        state: torch.Tensor,
        e: torch.Tensor | None,
        spans: Sequence[ItemSpec],
    ) -> None:
        """Copy this step's rows into the bucket; rows past N become padding rows."""
        rows, cols = key
        n = len(spans)
        b.state[:n].copy_(state)
        b.state[n:].zero_()
        if b.e is not None:
            b.e[:n].copy_(e)
            b.e[n:].zero_()
        pads = [(0, 1, (self.scratch_block,))] * (rows - n)
        # build() sends its inputs without waiting for the device; the copies into the static
        # tensors stay on the device.
        md = AttentionMetadata.build([*spans, *pads], self.block_size, self.device, num_cols=cols)
        for name in _MD_TENSORS:
            getattr(b.md, name).copy_(getattr(md, name))

    def _loop(self, b: _Bucket) -> torch.Tensor:
        return self.model.loop(b.state, b.e, b.md.positions, b.attn)  # [B, S]

    def _capture(self, b: _Bucket) -> None:
        """Capture the bucket's loop. The static buffers hold whatever the last run left or the
        padding rows of a new bucket; the warm-up loops write K/V only where a replay of those
        inputs would, so running them is harmless."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # cuBLAS workspaces are per stream: warm up on it
            for _ in range(2):
                self._loop(b)
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # As torch.cuda.graph() prepares a capture, but the stream and the capture state are
        # restored even when capture_end raises (torch.cuda.graph() restores neither).
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        with torch.cuda.stream(stream):
            self._capturing = True
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = self._loop(b)
            finally:
                graph.capture_end()
        self._capturing = False
        b.graph, b.out = graph, out
