"""In-place weight updates: checkpoint-named tensors copied into a loaded model's parameters.

An update is a list of safetensors files (a checkpoint directory's, or one the ``LLM`` front end
wrote from a trainer's ``(name, tensor)`` pairs). Invariants:

- Strict and whole: every name must be a checkpoint tensor of the model's family and every shape
  must equal the checkpoint layout's; all problems are listed in ONE ``ValueError``, and every
  tensor is read and cast before the first parameter changes, so a rejected update leaves the
  old weights serving.
- A subset is fine (only the names given change). A fused parameter (q/k/v, gate/up) is rebuilt
  from its sources by copying each source into its rows. Tied copies (Huginn's
  ``lm_head.weight``) are ignored when their source comes with them, and rejected alone; RoPE
  buffers are checked for shape and ignored, as the loader does.
- Values are copied into the parameters' existing storage (cast to their dtype), so views of
  them (CUDA graphs, the runner's references) stay valid.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from rltserve.models.base import LoopedModel
from rltserve.models.loader import DROPPED_SUFFIXES, FLOAT_DTYPES, check_tied, read_config
from rltserve.models.registry import get_family

_MAX_LISTED = 10


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: rows [row, row + rows) of module parameter ``param``."""

    param: str
    row: int
    rows: int


def _targets(model_dir: str | Path) -> tuple[dict[str, tuple[int, ...]], dict[str, _Target], dict]:
    """(checkpoint shapes, checkpoint name -> target, family) of the model's checkpoint layout."""
    family = get_family(read_config(model_dir)["model_type"])
    cfg = family.parse_config(read_config(model_dir))
    shapes = family.tensor_shapes(cfg)
    targets: dict[str, _Target] = {}
    for param, sources in family.param_sources(cfg).items():
        row = 0
        for s in sources:
            rows = shapes[s][0] if shapes[s] else 1
            targets[s] = _Target(param, row, rows)
            row += rows
    return shapes, targets, {"tied": dict(family.tied), "buffers": tuple(family.buffers)}


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = f", ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"{title} ({len(items)}): " + ", ".join(shown) + more


def read_update(
    model: LoopedModel, model_dir: str | Path, files: list[str | Path]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validates the update in ``files`` against the model's layout and reads it: returns
    (parameter rows, new value in the parameter's dtype and device) pairs, ready to copy.
    Raises ValueError listing every problem; changes nothing."""
    if not files:
        raise ValueError("weights: the update holds no files")
    shapes, targets, extra = _targets(model_dir)
    params = dict(model.named_parameters())
    found: dict[str, tuple] = {}
    unknown, misshaped, bad_dtype = [], [], []
    with ExitStack() as stack:
        for file in files:
            try:
                f = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as exc:  # safetensors raises its own error types
                raise ValueError(f"weights: {file}: unreadable safetensors ({exc})") from exc
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name.endswith(DROPPED_SUFFIXES):
                    continue
                if name in found:
                    raise ValueError(f"weights: tensor {name!r} is given twice")
                sl = f.get_slice(name)
                found[name] = (f, tuple(sl.get_shape()), sl.get_dtype())
        if not found:  # (it would move weight_version on with nothing changed)
            raise ValueError("weights: the update holds no weight tensors")
        for name, (_, shape, dtype) in found.items():
            if name not in shapes:
                unknown.append(name)
            elif shape != shapes[name]:
                misshaped.append(f"{name} {list(shape)} (expected {list(shapes[name])})")
            elif dtype not in FLOAT_DTYPES:
                bad_dtype.append(f"{name}: {dtype}")
        lone_ties = [
            f"{c} (tied to {s}; update {s})"
            for c, s in extra["tied"].items()
            if c in found and s not in found
        ]
        problems = [
            _listing(title, items)
            for title, items in (
                ("unknown tensor names", sorted(unknown)),
                ("wrong shapes", sorted(misshaped)),
                ("tensors not in F64, F32, F16 or BF16", sorted(bad_dtype)),
                ("tied copies without their source", lone_ties),
            )
            if items
        ]
        if not problems:  # a tied copy given with its source must equal it, as loading requires
            handles = {name: f for name, (f, _, _) in found.items()}
            for copy, source in extra["tied"].items():
                if copy in found:
                    try:
                        check_tied(handles, copy, source)
                    except ValueError as exc:
                        problems.append(str(exc))
        if problems:
            raise ValueError("weights: update rejected, nothing applied; " + "; ".join(problems))
        copies = []
        for name, (f, _, _) in found.items():
            target = targets.get(name)
            if target is None:  # a tied copy with its source, or a buffer: not a parameter
                continue
            param = params[target.param]
            value = f.get_tensor(name).to(device=param.device, dtype=param.dtype)
            rows = param.data.narrow(0, target.row, target.rows) if param.dim() else param.data
            copies.append((rows, value.reshape(rows.shape)))
    return copies


def apply_update(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies validated values into the parameters' storage."""
    with torch.no_grad():
        for rows, value in copies:
            rows.copy_(value)
    if any(rows.is_cuda for rows, _ in copies):
        torch.cuda.synchronize()  # steps run on the runner's own stream


def update_weights(model: LoopedModel, model_dir: str | Path, files: list[str | Path]) -> int:
    """Validates, reads and applies an update; returns the number of tensors applied."""
    copies = read_update(model, model_dir, files)
    apply_update(copies)
    return len(copies)
