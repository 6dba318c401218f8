"""Fused SiLU-and-Mul for the model MLPs: the native extension when built, torch otherwise.

``silu_and_mul(x)`` is ``silu(x[..., :n]) * x[..., n:]`` for ``x: [..., 2n]`` and
``silu_mul(a, b)`` is ``silu(a) * b``. They call ``torch.ops.rltserve_native`` (built on request
with ``python native/build.py``, see native/README.md) for the (device, dtype) pairs in
``backend_info()["enabled"]`` and the torch expression otherwise.

Invariants:
- Importing this module never fails, builds nothing and loads nothing: the library is looked up
  on first use and any failure (not built, stale, wrong torch, ...) selects torch with a reason.
- Where it is enabled by default the native op returns exactly the torch fallback's numbers:
  on CPU the kernel mirrors torch's choice of expf element by element (bit-identical, tested),
  so fp32 is enabled natively only where the extension reports that mirror
  (``cpu_mirrors_torch``). ``RLTSERVE_NATIVE_FP32=1`` forces fp32 on, ``=0`` keeps it off.
- ``RLTSERVE_NATIVE=0`` disables the extension; ``RLTSERVE_NATIVE_LIB`` names the library file,
  ``RLTSERVE_NATIVE_DIR`` the build directory (default: ``$RLTSERVE_CACHE/native/<tag>``).
- Autograd is not supported natively: inputs that require grad (with grad mode on) go to torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ENV_ENABLE = "RLTSERVE_NATIVE"
ENV_LIB = "RLTSERVE_NATIVE_LIB"
ENV_DIR = "RLTSERVE_NATIVE_DIR"
ENV_FP32 = "RLTSERVE_NATIVE_FP32"
CACHE_ENV = "RLTSERVE_CACHE"
LIB_NAME = "rltserve_native"
# The C++/CUDA sources, present in a source checkout (the build stamp records their digest).
CSRC_DIR = Path(__file__).resolve().parent.parent / "native" / "csrc"

_OFF = {"0", "off", "false", "no"}
_ON = {"1", "on", "true", "yes"}
_REDUCED = (torch.bfloat16, torch.float16)


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The torch fallback (and the reference the native op must equal)."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def torch_silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The torch fallback of the two-input form."""
    return F.silu(a) * b


def build_tag() -> str:
    """Build directory name: a library only loads into the torch and Python it was built for."""
    return f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-" + (
        platform.machine() or "unknown"
    )


def default_build_dir() -> Path:
    """Where ``python native/build.py`` writes and this module looks by default."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    cache = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "rltserve")
    return Path(cache) / "native" / build_tag()


def library_path() -> Path:
    """The library file to load: ``$RLTSERVE_NATIVE_LIB`` or the default build directory's."""
    lib = os.environ.get(ENV_LIB)
    return Path(lib) if lib else default_build_dir() / f"{LIB_NAME}.so"


def stamp_path(lib: Path) -> Path:
    """The JSON the build writes beside the library (source digest, torch version, CUDA)."""
    return lib.with_suffix(".json")


def source_digest(csrc: Path = CSRC_DIR) -> str | None:
    """Digest of the extension's sources, or None when they are not present (installed wheel)."""
    files = sorted(p for p in csrc.glob("*") if p.suffix in {".cpp", ".cu", ".h"})
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class _State:
    loaded: bool
    library: str | None
    reason: str | None  # why torch is used, when it is
    cpu: dict[str, str]  # parsed cpu_kernel_info()
    cuda_kernel: bool
    enabled: frozenset[tuple[str, torch.dtype]]
    notes: tuple[str, ...]


_LOCK = threading.Lock()
_STATE: _State | None = None
# Hot-path copies of _STATE, read without the lock (assignments are atomic).
_ENABLED: frozenset[tuple[str, torch.dtype]] = frozenset()
_FUSED: Any = None
_PAIR: Any = None


def _torch_state(reason: str) -> _State:
    return _State(False, None, reason, {}, False, frozenset(), ())


def _registered_ops() -> Any:
    """``torch.ops.rltserve_native`` when its ops are registered in this process, else None."""
    try:
        ns = torch.ops.rltserve_native
        ns.silu_and_mul  # noqa: B018 - raises when the op is not registered
        return ns
    except (AttributeError, RuntimeError):
        return None


def _stale_reason(lib: Path) -> str | None:
    digest = source_digest()
    stamp = stamp_path(lib)
    if digest is None or not stamp.is_file():
        return None
    try:
        built = json.loads(stamp.read_text()).get("source_digest")
    except (OSError, ValueError):
        return None
    if built != digest:
        return f"stale build: native/csrc changed since {lib} was built (rerun native/build.py)"
    return None


def _parse_info(text: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in text.split(";") if "=" in item)
    return {k: v for k, v in pairs}


def _enabled(cpu: dict[str, str], cuda_kernel: bool) -> tuple[frozenset, tuple[str, ...]]:
    fp32 = os.environ.get(ENV_FP32, "").strip().lower()
    mirrors = cpu.get("mirrors_torch") == "1"
    notes: list[str] = []
    pairs = {("cpu", dt) for dt in _REDUCED}
    if fp32 in _ON or (fp32 not in _OFF and mirrors):
        pairs.add(("cpu", torch.float32))
    if fp32 in _OFF:
        notes.append(f"float32 kept on torch by {ENV_FP32}=0")
    elif not mirrors and fp32 not in _ON:
        notes.append(
            "cpu float32 kept on torch: the CPU kernel cannot mirror torch's expf here "
            f"({cpu.get('note', 'unknown reason')}); {ENV_FP32}=1 forces it (<= 2 ulp apart)"
        )
    if cuda_kernel:
        pairs.update(("cuda", dt) for dt in _REDUCED)
        if fp32 not in _OFF:
            pairs.add(("cuda", torch.float32))
    return frozenset(pairs), tuple(notes)


def _load() -> _State:
    if os.environ.get(ENV_ENABLE, "").strip().lower() in _OFF:
        return _torch_state(f"disabled by {ENV_ENABLE}={os.environ[ENV_ENABLE]}")
    library: str | None = "(registered before rltserve looked)"
    try:
        ops = _registered_ops()
        if ops is None:
            lib = library_path()
            if not lib.is_file():
                return _torch_state(f"not built: no {lib} (build: python native/build.py)")
            stale = _stale_reason(lib)
            if stale:
                return _torch_state(stale)
            torch.ops.load_library(str(lib))
            library = str(lib)
            ops = _registered_ops()
            if ops is None:
                return _torch_state(f"{lib} registered no rltserve_native ops")
        cpu = _parse_info(str(ops.cpu_kernel_info()))
        cuda_kernel = bool(ops.cuda_kernel_compiled())
    except Exception as exc:  # noqa: BLE001 - a broken build must never break the engine
        return _torch_state(f"load failed: {type(exc).__name__}: {exc}")
    enabled, notes = _enabled(cpu, cuda_kernel)
    return _State(True, library, None, cpu, cuda_kernel, enabled, notes)


def _resolve() -> _State:
    global _STATE, _ENABLED, _FUSED, _PAIR
    state = _STATE
    if state is not None:
        return state
    with _LOCK:
        if _STATE is None:
            state = _load()
            if state.loaded:
                _FUSED = torch.ops.rltserve_native.silu_and_mul.default
                _PAIR = torch.ops.rltserve_native.silu_mul.default
            _ENABLED = state.enabled
            _STATE = state
        return _STATE


def reload() -> dict[str, Any]:
    """Re-reads the environment and looks for the library again (after a build, in tests).

    A library already loaded into this process stays loaded (torch cannot unload ops)."""
    global _STATE, _ENABLED
    with _LOCK:
        _STATE, _ENABLED = None, frozenset()
    return backend_info()


def _use_native(t: torch.Tensor) -> bool:
    if _STATE is None:
        _resolve()
    return (t.device.type, t.dtype) in _ENABLED and not (
        t.requires_grad and torch.is_grad_enabled()
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for ``x: [..., 2n]`` -> ``[..., n]``."""
    if _use_native(x):
        return _FUSED(x)
    return torch_silu_and_mul(x)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b``; natively for tensors of one shape, dtype and device (else broadcasting
    torch)."""
    if (
        _use_native(a)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and not (b.requires_grad and torch.is_grad_enabled())
    ):
        return _PAIR(a, b)
    return torch_silu_mul(a, b)


def backend_info() -> dict[str, Any]:
    """Which SiLU-and-Mul backend is active and why: ``backend`` is ``native-cuda`` (the CUDA
    kernel is built and a GPU is visible), ``native-cpu`` or ``torch`` (then ``reason``)."""
    s = _resolve()
    if not s.loaded:
        backend = "torch"
    elif s.cuda_kernel and torch.cuda.is_available():
        backend = "native-cuda"
    else:
        backend = "native-cpu"
    return {
        "backend": backend,
        "reason": s.reason,
        "library": s.library,
        "enabled": sorted(f"{dev}:{str(dt).removeprefix('torch.')}" for dev, dt in s.enabled),
        "cpu_kernel": s.cpu.get("mode"),
        "cpu_mirrors_torch": s.cpu.get("mirrors_torch") == "1" if s.loaded else None,
        "torch_cpu_capability": s.cpu.get("torch_capability"),
        "cuda_kernel": s.cuda_kernel,
        "notes": list(s.notes),
    }
