"""Where each tensor's bytes sit in a safetensors file, and reads of them straight into memory.

``loader`` copies every parameter out of the checkpoint (none may stay a view of a file that
can be rewritten) and builds fused ones (q/k/v, gate/up) by concatenating checkpoint tensors.
Copying out of a memory mapping faults the pages in one at a time (about 0.6 GB/s on the
reference VM, against 2.7 GB/s for ``read()``), so a parameter whose stored dtype is already the
target one is instead read with ``preadv`` directly into its final buffer: one copy, at read
bandwidth. Call ``extents`` only on files ``safe_open`` has already validated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rltserve.weights import safetensors_header

_CHUNK = 1 << 30  # bytes per preadv call (Linux caps one read near 2 GiB)


@dataclass(frozen=True)
class Extent:
    """A tensor's place in its file: absolute byte range [start, end)."""

    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int
    end: int


def extents(file: Path) -> dict[str, Extent]:
    """Name -> extent for every tensor of a (validated) safetensors file."""
    header, base = safetensors_header(file)
    return {
        name: Extent(
            file,
            e["dtype"],
            tuple(e["shape"]),
            base + e["data_offsets"][0],
            base + e["data_offsets"][1],
        )
        for name, e in header.items()
        if name != "__metadata__"
    }


def read_concat(parts: list[Extent], dtype: torch.dtype) -> torch.Tensor:
    """``torch.cat`` along dim 0 of ``parts`` (stored as ``dtype``), read from the files into the
    result's memory without an intermediate copy. Raises OSError on a short file."""
    rows = sum(p.shape[0] for p in parts)
    out = torch.empty((rows, *parts[0].shape[1:]), dtype=dtype)
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    expected = sum(p.end - p.start for p in parts)
    if expected != len(view):
        raise ValueError(f"parts hold {expected} bytes, the result {len(view)}")
    fds: dict[Path, int] = {}
    try:
        pos = 0
        for p in parts:
            if p.file not in fds:
                fds[p.file] = os.open(p.file, os.O_RDONLY)
            offset, stop = p.start, p.end
            while offset < stop:
                n = min(stop - offset, _CHUNK)
                got = os.preadv(fds[p.file], [view[pos : pos + n]], offset)
                if got <= 0:
                    raise OSError(f"{p.file}: file ends at byte {offset}, tensor data to {stop}")
                offset += got
                pos += got
    finally:
        for fd in fds.values():
            os.close(fd)
    return out
