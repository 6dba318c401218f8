"""Strict safetensors loader: checkpoint directory -> ready ``LoopedModel``.

Invariants:
- ``config.json`` picks the family by ``model_type`` and is fully validated before any weight is
  read.
- The checkpoint's tensor names and shapes must equal the family's ``tensor_shapes`` exactly
  (``rotary_emb.inv_freq`` buffers are dropped first). Every missing, unexpected and mis-shaped
  tensor is listed in ONE ``CheckpointError`` so a bad conversion is diagnosed in one run.
- Weights are read one tensor at a time through ``safe_open`` (memory-mapped), cast to the
  requested dtype on the target device, and assigned into a module built on the ``meta`` device
  without initialisation (``layers.Embedding``), so no weight is ever allocated twice. On the CPU
  a parameter whose stored dtype is the target one is read with ``preadv`` straight into its own
  buffer (``weight_file``; fused q/k/v and gate/up are concatenated there), else cast from the
  mapping. No parameter stays a view of the mapped file: a checkpoint rewritten in place (a
  trainer syncing weights into the served directory) would otherwise change the served model
  half-way or kill it with SIGBUS, where only ``update_weights`` may change it.
- Loading a large checkpoint (``PROGRESS_MIN_BYTES`` or ``PROGRESS_MIN_FILES`` shards) shows a
  progress bar on stderr when stderr is a terminal; ``progress=False`` turns it off.
- Tied copies (Huginn's ``lm_head.weight``) must equal their source and are then dropped: the
  model holds one parameter. Tied copies and buffers (Huginn's ``freqs_cis``) may be absent, as
  Hugging Face and vLLM loaders allow: the model reads neither.
- The model's stop ids (``spec.eos_token_ids``) add ``generation_config.json``'s
  ``eos_token_id`` (an id or a list) to the family's, as vLLM stops on them; a malformed or
  absent file adds none.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from rltserve.checkpoint_files import INDEX_FILE, SINGLE_FILE, check_weight_files, link_problem
from rltserve.models.base import LoopedModel, LoopedSpec
from rltserve.models.hfconfig import generation_eos_ids
from rltserve.models.registry import Family, get_family
from rltserve.models.weight_file import Extent, extents, read_concat
from rltserve.progress import is_terminal

DROPPED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
PROGRESS_MIN_BYTES = 1 << 30
PROGRESS_MIN_FILES = 4
_MAX_LISTED = 20  # names listed per category in a CheckpointError
_TIE_ROWS = 4096  # rows compared at a time when checking a tied copy


class CheckpointError(ValueError):
    """The checkpoint directory, its config.json or its weights are unusable."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype!r}: must be float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPES)} or a torch.dtype")
    return DTYPES[dtype]


def _check_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {str(p)!r} is not a directory")
    return p


def read_config(path: str | Path) -> dict[str, Any]:
    """The raw ``config.json`` of a checkpoint directory, with its ``model_type`` checked."""
    p = _check_dir(path) / "config.json"
    if (problem := link_problem(p)) is not None:
        raise CheckpointError(problem)
    if not p.is_file():
        raise CheckpointError(f"{str(p.parent)!r} has no config.json")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{p}: invalid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    try:
        get_family(raw.get("model_type"))
    except ValueError as exc:
        raise CheckpointError(f"{p}: {exc}") from exc
    return raw


def _weight_files(root: Path) -> list[Path]:
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: invalid index ({exc!r})") from exc
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {missing}")
        return [root / f for f in files]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{str(root)!r} has no .safetensors weight files")
    return found


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"\n  {title} ({len(items)}):" + "".join(f"\n    {s}" for s in shown) + more


def _check_layout(
    root: Path,
    found: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    optional: set[str],
) -> None:
    missing = sorted(set(expected) - set(found) - optional)
    unexpected = sorted(set(found) - set(expected))
    misshaped = sorted(
        f"{n}: checkpoint {list(found[n])}, expected {list(expected[n])}"
        for n in set(found) & set(expected)
        if found[n] != expected[n]
    )
    if missing or unexpected or misshaped:
        msg = f"{root}: checkpoint does not match the config"
        if missing:
            msg += _listing("missing tensors", missing)
        if unexpected:
            msg += _listing("unexpected tensors", unexpected)
        if misshaped:
            msg += _listing("wrong shapes", misshaped)
        raise CheckpointError(msg)


def check_tied(handles: dict[str, Any], copy: str, source: str) -> None:
    """Compare a tied copy with its source a slab of rows at a time (bounded extra memory)."""
    a, b = handles[copy].get_slice(copy), handles[source].get_slice(source)
    rows = a.get_shape()[0]
    for start in range(0, rows, _TIE_ROWS):
        x = a[start : start + _TIE_ROWS].float()
        y = b[start : start + _TIE_ROWS].float()
        if not torch.allclose(x, y, rtol=1e-5, atol=1e-6):
            raise CheckpointError(
                f"{copy} differs from {source} (rows {start}..); the model ties them"
            )


def _progress_bar(total_bytes: int, files: int, progress: bool | None) -> Any:
    """A tqdm bar over the checkpoint's bytes, or None (see module docstring)."""
    if progress is None:
        large = total_bytes >= PROGRESS_MIN_BYTES or files >= PROGRESS_MIN_FILES
        progress = large and is_terminal(sys.stderr)
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="loading weights",
        file=sys.stderr,
        leave=False,
    )


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    progress: bool | None = None,
) -> LoopedModel:
    """Load a looped model from a Hugging Face-style checkpoint directory (eval mode, no grad).

    ``progress``: None shows a bar on a terminal for large checkpoints, True always, False never.
    """
    target_dtype = resolve_dtype(dtype)
    target_device = torch.device(device)
    root = _check_dir(path)
    check_weight_files(root)  # (unreadable, partly downloaded, LFS-pointer, .bin, quantized)
    raw = read_config(root)
    family: Family = get_family(raw["model_type"])
    try:
        cfg = family.parse_config(raw)
    except ValueError as exc:
        raise CheckpointError(f"{root / 'config.json'}: {exc}") from exc
    expected = family.tensor_shapes(cfg)
    with ExitStack() as stack:
        handles: dict[str, Any] = {}  # tensor name -> open safe_open handle
        found: dict[str, tuple[int, ...]] = {}
        nbytes: dict[str, int] = {}
        stored: dict[str, str] = {}  # tensor name -> safetensors dtype
        places: dict[str, Extent] = {}
        bad_dtypes: list[str] = []
        files = _weight_files(root)
        for file in files:
            try:
                f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                names = list(f.keys())
                slices = {n: f.get_slice(n) for n in names}
                shapes = {n: tuple(sl.get_shape()) for n, sl in slices.items()}
                dtypes = {n: sl.get_dtype() for n, sl in slices.items()}
                places.update(extents(file))
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{file}: corrupt or unreadable safetensors ({exc})") from exc
            for name in names:
                if name.endswith(DROPPED_SUFFIXES):
                    continue
                if name in handles:
                    raise CheckpointError(f"{file}: tensor {name!r} is also in another file")
                handles[name], found[name] = f, shapes[name]
                stored[name] = dtypes[name]
                size = ST_ITEMSIZE.get(dtypes[name], 1)
                nbytes[name] = size * int(torch.Size(shapes[name]).numel())
                if dtypes[name] not in FLOAT_DTYPES:
                    bad_dtypes.append(f"{name}: {dtypes[name]}")
        _check_layout(root, found, expected, set(family.tied) | set(family.buffers))
        if bad_dtypes:
            raise CheckpointError(f"{root}: non-float tensors" + _listing("tensors", bad_dtypes))
        for copy, source in family.tied.items():
            if copy in handles:
                check_tied(handles, copy, source)
        with torch.device("meta"):
            model = family.model_cls(cfg)
        state: dict[str, torch.Tensor] = {}
        sources_of = family.param_sources(cfg)
        needed = sum(nbytes[s] for sources in sources_of.values() for s in sources)
        bar = _progress_bar(needed, len(files), progress)
        try:
            direct_ok = target_device.type == "cpu" and hasattr(os, "preadv")
            want = ST_NAMES[target_dtype]
            for param, sources in sources_of.items():
                if direct_ok and all(stored[s] == want for s in sources):
                    try:
                        state[param] = read_concat([places[s] for s in sources], target_dtype)
                    except OSError as exc:
                        raise CheckpointError(f"{root}: reading {param}: {exc}") from exc
                else:
                    parts = [
                        # copy=True: never a view of the mapping (see the module docstring)
                        handles[s]
                        .get_tensor(s)
                        .to(device=target_device, dtype=target_dtype, copy=True)
                        for s in sources
                    ]
                    state[param] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
                    del parts
                if bar is not None:
                    bar.update(sum(nbytes[s] for s in sources))
        finally:
            if bar is not None:
                bar.close()
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.spec = _with_generation_eos(model.spec, root)
    return model.eval()


def _with_generation_eos(spec: LoopedSpec, root: Path) -> LoopedSpec:
    ids = [v for v in generation_eos_ids(root) if v < spec.vocab_size]
    extra = tuple(dict.fromkeys(v for v in ids if v not in spec.eos_token_ids))
    if not extra:
        return spec
    eos = (*spec.eos_token_ids, *extra)
    return dataclasses.replace(spec, eos_token_ids=eos, stop_reason_ids=extra)
