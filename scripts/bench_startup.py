#!/usr/bin/env python
"""Benchmark: start-up, from a fresh interpreter to ready, with warm file caches.

    python scripts/bench_startup.py                      # ouro-small (built once), JSON on stdout
    python scripts/bench_startup.py --model DIR          # another checkpoint
    python scripts/bench_startup.py --repeat 5 --out s.json
    python scripts/bench_startup.py --only load_model --model big/   # one measurement

Every measurement runs in its own fresh ``python`` process, ``--repeat`` times (after one
discarded warm-up run that fills the page cache); the report gives the median and the minimum
in seconds:

- ``import_torch``: ``import torch`` alone (the floor of anything that runs a model);
- ``import_llm``: ``from rltserve import LLM``;
- ``tokenizer``: ``load_tokenizer(model)`` after its import; ``tokenizer_transformers``:
  importing transformers and ``AutoTokenizer.from_pretrained`` on the same files, for comparison;
- ``load_model``: ``load_model(model)`` after the import (``load_model_gbps``: checkpoint bytes
  per second of it, against plain sequential reads of the same files: ``read_cached_gbps`` into
  a reused buffer, ``read_fresh_gbps`` into newly allocated memory);
- ``llm_ready`` / ``llm_ready_in_process``: ``LLM(model)`` until ready after the import, with
  the spawned stage process / on a thread;
- ``generate_cli``: wall time of ``rltserve generate Hello`` on the demo model (32 tokens).

The script imports the rltserve found on ``PYTHONPATH`` (or beside it), so pointing
``PYTHONPATH`` at another checkout measures that checkout with the same procedure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each snippet prints one JSON object of seconds on its last stdout line.
SNIPPETS = {
    "import_torch": """
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
out = {"import_torch": t1 - t0}
""",
    "import_llm": """
t0 = time.perf_counter(); from rltserve import LLM; t1 = time.perf_counter()
out = {"import_llm": t1 - t0}
""",
    "tokenizer": """
from rltserve.models.tokenizer import load_tokenizer
t0 = time.perf_counter(); tok = load_tokenizer(MODEL); t1 = time.perf_counter()
out = {"tokenizer": t1 - t0}
""",
    "tokenizer_transformers": """
t0 = time.perf_counter()
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(MODEL, trust_remote_code=False, local_files_only=True)
out = {"tokenizer_transformers": time.perf_counter() - t0}
""",
    "load_model": """
from rltserve.models import load_model
t0 = time.perf_counter(); model = load_model(MODEL, dtype=DTYPE); t1 = time.perf_counter()
out = {"load_model": t1 - t0}
""",
    "llm_ready": """
from rltserve import LLM
t0 = time.perf_counter(); llm = LLM(MODEL, dtype=DTYPE); t1 = time.perf_counter()
llm.close()
out = {"llm_ready": t1 - t0}
""",
    "llm_ready_in_process": """
from rltserve import LLM
t0 = time.perf_counter(); llm = LLM(MODEL, dtype=DTYPE, in_process=True)
t1 = time.perf_counter(); llm.close()
out = {"llm_ready_in_process": t1 - t0}
""",
}
ORDER = [*SNIPPETS, "generate_cli"]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs ``cmd`` from a neutral directory: ``python -c`` puts the working directory first on
    ``sys.path``, which would shadow the checkout named by ``PYTHONPATH``."""
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=tempfile.gettempdir(),
        check=False,
    )


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(ROOT))
    return env


def _snippet(name: str, model: str, dtype: str, timeout: float) -> float:
    code = (
        f"import json, time\nMODEL = {model!r}\nDTYPE = {dtype!r}\n"
        + SNIPPETS[name]
        + "\nprint(json.dumps(out))\n"
    )
    proc = _run([sys.executable, "-c", code], timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])[name])


def _generate_cli(timeout: float) -> float:
    cmd = [sys.executable, "-m", "rltserve.cli", "generate", "Hello"]
    t0 = time.perf_counter()
    proc = _run(cmd, timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"generate failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall


def _weight_bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def _read_seconds(model: Path, fresh: bool) -> float:
    """Sequential ``preadv`` of the weight files in 1 GiB chunks, into one reused 1 GiB buffer
    (page-cache bandwidth) or into newly allocated memory (``fresh``: the floor of any load that
    materialises the weights, page population included)."""
    import numpy as np

    chunk = 1 << 30
    reused = None if fresh else memoryview(np.empty(chunk, np.uint8))
    t0 = time.perf_counter()
    for file in sorted(model.glob("*.safetensors")):
        size = file.stat().st_size
        dest = memoryview(np.empty(size, np.uint8)) if fresh else None
        fd = os.open(file, os.O_RDONLY)
        try:
            pos = 0
            while pos < size:
                n = min(chunk, size - pos)
                target = dest[pos : pos + n] if dest is not None else reused[:n]
                pos += os.preadv(fd, [target], pos)
        finally:
            os.close(fd)
        del dest
    return time.perf_counter() - t0


def default_model() -> Path:
    """ouro-small, built once into the rltserve cache directory."""
    sys.path.insert(0, str(ROOT))
    from rltserve.models.demo import cache_root
    from rltserve.models.presets import make_model

    path = cache_root() / "bench-ouro-small"
    if not (path / "model.safetensors").is_file():
        make_model("ouro-small", path)
    return path


def measure(name: str, model: Path, dtype: str, repeat: int, timeout: float) -> list[float]:
    run = (
        (lambda: _generate_cli(timeout))
        if name == "generate_cli"
        else (lambda: _snippet(name, str(model), dtype, timeout))
    )
    run()  # warm-up: page cache, compiled bytecode
    return [run() for _ in range(repeat)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default ouro-small)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=ORDER, action="append", help="measure only these")
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat={args.repeat}: must be >= 1")
    model = (args.model or default_model()).resolve()
    if not (model / "config.json").is_file():
        parser.error(f"--model {model}: not a checkpoint directory (no config.json)")
    results: dict[str, dict[str, float]] = {}
    for name in args.only or ORDER:
        runs = measure(name, model, args.dtype, args.repeat, args.timeout)
        results[name] = {"median_s": statistics.median(runs), "min_s": min(runs)}
        print(f"{name}: median {results[name]['median_s']:.3f} s", file=sys.stderr)
    size = _weight_bytes(model)
    report: dict[str, object] = {
        "model": str(model),
        "dtype": args.dtype,
        "weight_bytes": size,
        "repeat": args.repeat,
        "python": sys.version.split()[0],
        "results": results,
    }
    if "load_model" in results:
        _read_seconds(model, fresh=False)  # warm, as the load runs were
        for key, fresh in (("read_cached_gbps", False), ("read_fresh_gbps", True)):
            seconds = min(_read_seconds(model, fresh) for _ in range(args.repeat))
            report[key] = size / seconds / 1e9
        report["load_model_gbps"] = size / results["load_model"]["min_s"] / 1e9
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
