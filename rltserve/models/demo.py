"""The built-in demo checkpoint: generated once into a cache directory and reused afterwards.

``demo_model_path()`` returns ``<root>/demo-<preset>-v<version>`` where ``<root>`` is
``$RLTSERVE_CACHE`` or ``~/.cache/rltserve``. The preset is ``ouro-demo`` (hidden 128, 4 layers,
vocab 4096, 4 loops, ~1.8M parameters, fp32, ~7 MB): big enough for word-like text, an exit gate
that spreads exit depths and real chat templates, small enough to build in well under a second
and to serve quickly on a CPU.

Invariant: the directory exists only when complete. It is built in a private temporary sibling
and renamed into place (atomic on POSIX); concurrent first uses race on the rename, and the loser
discards its copy and uses the winner's. Bump ``DEMO_VERSION`` whenever the preset, the weight
scheme or the tokenizer corpus changes, so stale caches are not reused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEMO_PRESET = "ouro-demo"
DEMO_SEED = 0
DEMO_VERSION = 1
CACHE_ENV = "RLTSERVE_CACHE"
COMPLETE = ".complete"  # written last inside the temporary directory


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rltserve"


def _complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def model_or_demo(model: str | None) -> str:
    """``model``, or the demo checkpoint's path (built on first use) when it is None: what
    ``LLM`` and the benchmarks run without a model."""
    return str(demo_model_path()) if model is None else model


def demo_model_path(root: str | Path | None = None) -> Path:
    """Path of the demo checkpoint, building it on first use (see module docstring)."""
    base = Path(root) if root is not None else cache_root()
    final = base / f"demo-{DEMO_PRESET}-v{DEMO_VERSION}"
    if _complete(final):
        return final
    base.mkdir(parents=True, exist_ok=True)
    from rltserve.models.presets import make_model  # imports torch: only when building
    from rltserve.progress import in_notebook, progress_enabled

    if progress_enabled() or in_notebook():  # (a person waits: say why, once)
        print(f"building the demo model (once, some seconds) in {final}", file=sys.stderr)

    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=base))
    try:
        make_model(DEMO_PRESET, tmp, seed=DEMO_SEED)
        (tmp / COMPLETE).write_text(f"{DEMO_PRESET} seed={DEMO_SEED} v{DEMO_VERSION}\n")
        if final.exists() and not _complete(final):
            # A leftover without the marker (not ours to trust): move it aside atomically.
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale.", dir=base))
            with contextlib.suppress(OSError):  # another process moved or replaced it
                os.rename(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
