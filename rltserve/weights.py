"""What ``LLM.update_weights`` accepts, turned into files the stage can read.

A checkpoint directory (or one ``.safetensors`` file) is sent as its path; a Hugging Face repo
id, as ``LLM`` takes one, as its snapshot in the local cache (``preflight.resolve_model``). An
iterable of ``(name, tensor)`` pairs in checkpoint names (a trainer's ``state_dict().items()``)
is written to a temporary safetensors file first: the stage runs in another process, and a
file is the one form both sides already read strictly (``core/weight_update.py`` validates it
there). An empty iterable is no update: no paths.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

WeightsArg = str | os.PathLike | Mapping[str, Any] | Iterable[tuple[str, Any]]


@contextmanager
def update_paths(
    weights: WeightsArg, cache_dir: str | os.PathLike | None = None, last_wins: bool = False
) -> Iterator[list[str]]:
    """The paths to send for ``weights`` (none for an empty iterable); a temporary file lives
    until the block ends. ``cache_dir``: the Hugging Face cache a repo id is found in (None:
    the default one). ``last_wins``: a name given twice among the pairs takes its last tensor,
    as vLLM's ``load_weights`` copies pairs in order (else a ValueError)."""
    if isinstance(weights, (str, os.PathLike)):
        from rltserve.preflight import resolve_model

        path = Path(weights)
        if not path.exists():
            path = Path(resolve_model(str(weights), cache_dir=cache_dir, name="weights"))
        if not path.exists():
            raise ValueError(f"weights: {str(path)!r} does not exist")
        yield [str(path.resolve())]
        return
    # Any mapping of names to tensors (a state_dict, or a read-only or lazy view of one), as the
    # load_weights path takes it: iterating one would give the names alone.
    if isinstance(weights, Mapping):
        weights = weights.items()
    tensors = _collect(weights, last_wins)
    if not tensors:
        yield []
        return
    from safetensors.torch import save_file

    folder = tempfile.mkdtemp(prefix="rltserve-weights-", dir=_scratch_dir(tensors))
    try:
        file = os.path.join(folder, "update.safetensors")
        save_file(tensors, file)
        yield [file]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _scratch_dir(tensors: dict) -> str | None:
    """Shared memory when it has room (the file never touches a disk), else the default."""
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        return None
    need = sum(t.nbytes for t in tensors.values())
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        return None
    return shm if free > 2 * need else None


def _collect(weights: Iterable[tuple[str, Any]], last_wins: bool) -> dict[str, Any]:
    import torch

    try:
        pairs = list(weights)
    except TypeError:
        raise ValueError(
            "weights: must be a checkpoint directory or an iterable of (name, tensor) pairs"
        ) from None
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # storages already used: tied tensors and views share one
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"weights[{i}]: must be a (name, tensor) pair")
        name, value = pair
        if not isinstance(name, str):
            raise ValueError(f"weights[{i}]: name {name!r} must be a string")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"weights[{i}] ({name}): must be a torch.Tensor")
        if name in tensors and not last_wins:
            raise ValueError(f"weights: tensor {name!r} is given twice")
        if value.is_meta or value.layout is not torch.strided:
            kind = "a meta tensor (no data)" if value.is_meta else f"{value.layout} (not dense)"
            raise ValueError(f"weights[{i}] ({name}): {kind}; pass dense tensors with values")
        t = value.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:  # safetensors refuses shared storage
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    return tensors


def update_files(path: str | Path) -> list[Path]:
    """The safetensors files of an update given as a path: a checkpoint directory (its weight
    files, sharded or not) or one ``.safetensors`` file."""
    from rltserve.checkpoint_files import weight_file_problem  # (it imports this module)

    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
    elif p.is_file() or p.is_symlink():
        files = [p]
    else:
        raise ValueError(f"weights: {str(p)!r} is neither a checkpoint directory nor a file")
    if not files:
        raise ValueError(f"weights: {str(p)!r} holds no .safetensors files")
    for file in files:
        if (problem := weight_file_problem(file)) is not None:
            raise ValueError(f"weights: {problem}")
    odd = [f.name for f in files if not f.is_file()]  # (a FIFO would block the engine's read)
    if odd:
        raise ValueError(f"weights: {str(p)!r}: not regular files: {', '.join(odd[:5])}")
    return files


def safetensors_header(file: str | Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> {dtype, shape, data_offsets}, and
    ``__metadata__``) and the byte where its data starts, which the offsets count from
    (torch-free: the server reads names without loading any tensor)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length
