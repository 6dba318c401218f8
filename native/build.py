#!/usr/bin/env python
"""Builds rltserve's native extension (fused SiLU-and-Mul) into the directory rltserve loads from.

    python native/build.py               # CPU kernel, plus the CUDA kernel when it can
    python native/build.py --cuda off    # CPU kernel only
    python native/build.py --out DIR     # build into DIR (then RLTSERVE_NATIVE_LIB=DIR/<lib>.so)
    python native/build.py --check       # exit 0 when an up-to-date build exists, else 1

JIT-compiles csrc/ with torch.utils.cpp_extension (ninja and a C++17 compiler; nvcc and a CUDA
torch for the CUDA kernel) into rltserve.native.default_build_dir(), a directory keyed by torch
version, Python and machine, and writes a stamp (source digest, torch, CUDA) next to the
library. Rebuilds only when the sources, torch or the CUDA choice changed (or with --force);
the loader refuses a library whose stamp does not match the sources (stale build).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # a source checkout works without installing rltserve

import torch  # noqa: E402

from rltserve import native  # noqa: E402

CSRC = HERE / "csrc"
CPU_SOURCES = ("ops.cpp", "cpu_kernel.cpp")
CUDA_SOURCES = ("cuda_kernel.cu",)
# No -march: SIMD code is in target-attributed functions chosen at run time. No fast math and
# no contraction: results must be bit-identical to torch's silu and mul.
CFLAGS = ["-O3", "-fopenmp", "-fno-fast-math", "-ffp-contract=off", "-Wno-psabi"]
LDFLAGS = ["-fopenmp"]  # resolves to the libgomp torch already loaded (same soname)
CUDA_CFLAGS = ["-O3"]


def cuda_possible() -> tuple[bool, str]:
    """Whether the CUDA kernel can be built here, and why not."""
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None:
        return False, "no CUDA toolkit (nvcc / CUDA_HOME) found"
    # torch builds for the visible GPUs' architectures, or those TORCH_CUDA_ARCH_LIST names:
    # with neither (a CUDA torch and a toolkit on a machine without a GPU) it has none to
    # build for and fails inside torch (an IndexError).
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        return False, "no GPU visible and no TORCH_CUDA_ARCH_LIST naming one to build for"
    return True, f"CUDA {torch.version.cuda}, toolkit at {CUDA_HOME}"


def compiler_problem() -> str | None:
    """Why nothing can be built here, or None."""
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH)"
    if not is_ninja_available():
        return "ninja not found (pip install ninja, or the system package)"
    return None


def expected_stamp(with_cuda: bool) -> dict:
    return {
        "source_digest": native.source_digest(CSRC),
        "torch": torch.__version__,
        "cuda": with_cuda,
    }


def is_up_to_date(lib: Path, with_cuda: bool) -> bool:
    stamp = native.stamp_path(lib)
    if not (lib.is_file() and stamp.is_file()):
        return False
    try:
        built = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    want = expected_stamp(with_cuda)
    return all(built.get(k) == v for k, v in want.items())


def build(
    out: Path | None = None, cuda: str = "auto", force: bool = False, verbose: bool = False
) -> Path:
    """Builds (when needed) and returns the library path. Raises RuntimeError when impossible."""
    out_dir = out or native.default_build_dir()
    lib = out_dir / f"{native.LIB_NAME}.so"
    possible, why = cuda_possible()
    if cuda == "on" and not possible:
        raise RuntimeError(f"--cuda on, but {why}")
    with_cuda = possible if cuda == "auto" else cuda == "on"
    if not force and is_up_to_date(lib, with_cuda):
        return lib
    problem = compiler_problem()
    if problem:
        raise RuntimeError(problem)
    from torch.utils.cpp_extension import load

    out_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(CSRC / s) for s in CPU_SOURCES]
    cflags = list(CFLAGS)
    if with_cuda:
        sources += [str(CSRC / s) for s in CUDA_SOURCES]
        cflags.append("-DRLTSERVE_WITH_CUDA")
    load(
        name=native.LIB_NAME,
        sources=sources,
        extra_cflags=cflags,
        extra_cuda_cflags=CUDA_CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(out_dir),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=verbose,
    )
    native.stamp_path(lib).write_text(json.dumps(expected_stamp(with_cuda), indent=2) + "\n")
    return lib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=None, help="build directory (default: the cache)")
    p.add_argument("--cuda", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    p.add_argument("--check", action="store_true", help="only report whether a build is current")
    p.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = p.parse_args(argv)
    if args.check:
        lib = (args.out or native.default_build_dir()) / f"{native.LIB_NAME}.so"
        ok = is_up_to_date(lib, cuda_possible()[0] if args.cuda == "auto" else args.cuda == "on")
        print(json.dumps({"library": str(lib), "up_to_date": ok}))
        return 0 if ok else 1
    start = time.perf_counter()
    try:
        lib = build(args.out, args.cuda, args.force, args.verbose)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        os.environ[native.ENV_LIB] = str(lib)
    report = {"library": str(lib), "seconds": round(time.perf_counter() - start, 1)}
    report["backend_info"] = native.reload()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
