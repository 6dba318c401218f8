#!/usr/bin/env python
"""Benchmark: fused native SiLU-and-Mul vs the torch expression, and its end-to-end effect.

    python scripts/bench_silu.py                      # op micro-benchmark, JSON on stdout
    python scripts/bench_silu.py --e2e --rounds 2     # plus ouro-small tokens/s, native off/on
    python scripts/bench_silu.py --share --skip-micro # silu_and_mul's share of the engine time
    python scripts/bench_silu.py --out bench.json     # also write the JSON to a file

Micro-benchmark: for each thread count, dtype and shape, the two implementations run
alternately (torch, native, torch, native, ...) so that load from other processes hits both
alike; medians (and minima) of the per-call times and their ratio torch/native are reported,
with whether the outputs are bit-identical. End-to-end: ``rltserve bench offline`` runs in fresh
processes with RLTSERVE_NATIVE=0 and =1 interleaved (A, B, A, B, ...); medians of
output tokens/s. Needs the extension built (python native/build.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rltserve import native  # noqa: E402

SHAPES = ((256, 2 * 5632), (2048, 2 * 1408), (32, 2 * 11008), (32, 2 * 1408), (1, 2 * 5632))
DTYPES = ("float32", "bfloat16")


def _time_pair(fns: list, x: torch.Tensor, repeats: int, warmup: int) -> list[list[float]]:
    for _ in range(warmup):
        for fn in fns:
            fn(x)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            start = time.perf_counter()
            fns[i](x)
            times[i].append(time.perf_counter() - start)
    return times


def micro(threads: list[int], dtypes: list[str], repeats: int, warmup: int) -> list[dict]:
    fused = torch.ops.rltserve_native.silu_and_mul.default
    rows: list[dict[str, Any]] = []
    saved = torch.get_num_threads()
    try:
        for nt in threads:
            torch.set_num_threads(nt)
            for dt in dtypes:
                for shape in SHAPES:
                    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
                    x = x.to(getattr(torch, dt))
                    same = torch.equal(fused(x), native.torch_silu_and_mul(x))
                    t_torch, t_native = _time_pair(
                        [native.torch_silu_and_mul, fused], x, repeats, warmup
                    )
                    med_t, med_n = statistics.median(t_torch), statistics.median(t_native)
                    rows.append(
                        {
                            "threads": nt,
                            "dtype": dt,
                            "shape": list(shape),
                            "torch_us": round(med_t * 1e6, 1),
                            "native_us": round(med_n * 1e6, 1),
                            "speedup": round(med_t / med_n, 3),
                            "speedup_of_minima": round(min(t_torch) / min(t_native), 3),
                            "bit_identical": same,
                        }
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        torch.set_num_threads(saved)
    return rows


def _bench_once(
    model: str, native_on: bool, extra: list[str], timeout: int, threads: int | None
) -> dict:
    env = {**os.environ, native.ENV_ENABLE: "1" if native_on else "0"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-c", "import sys; from rltserve.cli import main; sys.exit(main())"]
    cmd += ["bench", "offline", "--model", model, "--concurrency", "32", "--json", *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=True)
    report = json.loads(out.stdout)
    return report["refill"]


def e2e(
    model: str, rounds: int, extra: list[str], timeout: int, threads: int | None
) -> dict[str, Any]:
    if not Path(model).is_dir():
        subprocess.run(
            [sys.executable, "-c", "import sys; from rltserve.cli import main; sys.exit(main())"]
            + ["make-model", "--preset", "ouro-small", "--out", model],
            check=True,
        )
    for on, want in ((False, "torch"), (True, "native-")):
        env = {**os.environ, native.ENV_ENABLE: "1" if on else "0"}
        probe = "from rltserve import native; print(native.backend_info()['backend'])"
        got = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        if not got.startswith(want):
            raise RuntimeError(f"{native.ENV_ENABLE}={int(on)} runs would use {got!r}")
    runs: dict[str, list[float]] = {"native_off": [], "native_on": []}
    for r in range(rounds):
        for on in (False, True):
            res = _bench_once(model, on, extra, timeout, threads)
            key = "native_on" if on else "native_off"
            runs[key].append(res["output_tokens_per_s"])
            print(f"e2e round {r} {key}: {res['output_tokens_per_s']} tok/s", file=sys.stderr)
    off, on = statistics.median(runs["native_off"]), statistics.median(runs["native_on"])
    return {
        "model": model,
        "command": "rltserve bench offline --model MODEL --concurrency 32 --json "
        + " ".join(extra),
        "order": "interleaved off, on, off, on, ...",
        "omp_num_threads": threads or "default",
        "tokens_per_s": runs,
        "median_off": off,
        "median_on": on,
        "ratio_on_vs_off": round(on / off, 3),
    }


def share(model: str, rounds: int, extra: list[str]) -> dict[str, Any]:
    """In-process runs of the same bench with a timer around the MLP's silu_and_mul: its share of
    the engine's time, native off vs on (insensitive to load from other processes, unlike the
    tokens/s of separate runs)."""
    from types import SimpleNamespace

    from rltserve.bench.offline import run_offline_bench
    from rltserve.cli import build_parser
    from rltserve.engine_args import engine_kwargs
    from rltserve.models import layers

    argv = ["bench", "offline", "--model", model, "--concurrency", "32", *extra]
    args = build_parser().parse_args(argv)
    spent = [0.0, 0]

    def timed(x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = native.silu_and_mul(x)
        spent[0] += time.perf_counter() - start
        spent[1] += 1
        return out

    saved_module, saved_env = layers._native, os.environ.get(native.ENV_ENABLE)
    layers._native = SimpleNamespace(silu_and_mul=timed)
    result: dict[str, Any] = {"command": "rltserve " + " ".join(argv)}
    try:
        for r in range(rounds):
            for on in (False, True):
                os.environ[native.ENV_ENABLE] = "1" if on else "0"
                backend = native.reload()["backend"]
                assert backend.startswith("native") == on, backend
                spent[:] = [0.0, 0]
                run = run_offline_bench(args, engine_kwargs(args))["refill"]
                key = "native_on" if on else "native_off"
                result.setdefault(key, []).append(
                    {
                        "silu_and_mul_s": round(spent[0], 4),
                        "calls": spent[1],
                        "engine_s": run["seconds"],
                        "share": round(spent[0] / run["seconds"], 5),
                    }
                )
                print(f"share round {r} {key}: {result[key][-1]}", file=sys.stderr)
    finally:
        layers._native = saved_module
        if saved_env is None:
            os.environ.pop(native.ENV_ENABLE, None)
        else:
            os.environ[native.ENV_ENABLE] = saved_env
        native.reload()
    for key in ("native_off", "native_on"):
        result[f"median_silu_s_{key}"] = statistics.median(x["silu_and_mul_s"] for x in result[key])
        result[f"median_share_{key}"] = statistics.median(x["share"] for x in result[key])
    saved = result["median_silu_s_native_off"] - result["median_silu_s_native_on"]
    engine = statistics.median(x["engine_s"] for x in result["native_off"])
    result["expected_e2e_gain"] = round(saved / max(engine - saved, 1e-9), 5)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", default=f"1,{torch.get_num_threads()}", help="comma list")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--e2e", action="store_true", help="also run the ouro-small comparison")
    p.add_argument("--model", default="/tmp/ouro-small")
    p.add_argument("--rounds", type=int, default=2, help="e2e rounds (each: off then on)")
    p.add_argument("--e2e-args", default="", help="extra args for rltserve bench offline")
    p.add_argument("--timeout", type=int, default=900, help="seconds per e2e run")
    p.add_argument("--e2e-threads", type=int, default=None, help="OMP_NUM_THREADS of e2e runs")
    p.add_argument("--skip-micro", action="store_true", help="only the e2e comparison")
    p.add_argument("--share", action="store_true", help="silu_and_mul's share of engine time")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    info = native.backend_info()
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "default_threads": torch.get_num_threads(),
        "backend_info": info,
    }
    if info["backend"] == "torch":
        report["error"] = f"native extension not available: {info['reason']}"
        print(json.dumps(report, indent=2))
        return 1
    threads = sorted({int(t) for t in args.threads.split(",") if t})
    if not args.skip_micro:
        report["micro"] = micro(threads, args.dtypes.split(","), args.repeats, args.warmup)
    if args.e2e:
        report["e2e"] = e2e(
            args.model, args.rounds, args.e2e_args.split(), args.timeout, args.e2e_threads
        )
    if args.share:
        report["share"] = share(args.model, args.rounds, args.e2e_args.split())
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
