"""Two checkouts' host work per step, alternating processes: ratios robust to a drifting machine.

    python scripts/bench_host_ab.py --base /path/to/old/checkout --new . --kind decode \
        --rows 256 --pairs 10
    python scripts/bench_host_ab.py --base /path/to/old/checkout --new . --instructions

Each pair runs one process per checkout (in alternating order), each driving the engine with
the stand-in model as ``rltserve bench host`` does (one cell: ``--kind``, ``--rows``, context
``--context``, ``--steps`` measured steps after ``--warmup``, synchronous, one torch thread).
A shared machine's speed drifts by tens of percent over minutes, so the report's figure of
merit is the median of the pairwise new/base ratios of thread CPU per step, per phase; apply
and emit, where neither checkout changed them, show what is left of the drift. JSON on stdout.

``--instructions``: instead, the instructions the CPU executes per measured step (all phases),
counted by valgrind's callgrind with instrumentation on only while the measured steps run:
deterministic to about 0.1%, so one run per checkout settles a change of a few percent that
timings on a shared machine cannot. (Instructions are not time: cache misses and the cost of
each torch call differ; a change that moves work into fewer, larger calls gains more time
than instructions.) The two checkouts run at once, one per process. Needs valgrind.

``--temperature`` / ``--repetition-penalty``: the decode rows sample (each from its request's
seeded generator) and are penalized, as a rollout's, instead of greedy ones.

``--cache-sim`` (with ``--instructions``): callgrind also simulates the caches (about twice as
slow), and the report adds its cycle estimate per step, instructions plus 10 per first-level
miss and 100 per last-level miss (callgrind's documented weights): a deterministic figure for
changes whose gain is memory traffic (fewer objects touched) rather than instructions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("host_cpu_ms", "plan_cpu_ms", "runner_cpu_ms", "apply_cpu_ms", "emit_cpu_ms")

# Run before _ONE or _COUNT: the decode requests' sampling fields (``--temperature``,
# ``--repetition-penalty``), set where ``_Cell`` makes their params, so that a checkout from
# before ``_Cell`` took them runs them too.
_SAMPLING = """
import json, sys
import rltserve.bench.host as _host
_extra = json.loads(sys.argv[6])
if _extra:
    _made = _host.SamplingParams
    _host.SamplingParams = lambda **k: _made(**({**k, **_extra} if k["max_tokens"] > 1 else k))
"""

# Run inside each checkout, with that checkout first on sys.path.
_ONE = """
import json, sys
from rltserve.bench.host import _Cell, _measure
from rltserve.bench.standin import StandInModel
from rltserve.core import stage_worker
rows, context, warmup, steps = (int(a) for a in sys.argv[1:3] + sys.argv[4:6])
mixed = sys.argv[3] == "mixed"
import torch
torch.set_num_threads(1)  # as ``bench host`` runs by default
stage_worker.tune_gc()  # the stage's worker process settings, as that checkout has them
getattr(stage_worker, "tune_malloc", bool)()
cell = _Cell(StandInModel(), rows, context)
_measure(cell, warmup, mixed, False)
print(json.dumps(_measure(cell, steps, mixed, False)))
"""


# As _ONE, counting instructions of the measured steps only (callgrind_control toggles the
# instrumentation of this process).
_COUNT = """
import json, os, subprocess, sys
from rltserve.bench.host import _Cell, _measure
from rltserve.bench.standin import StandInModel
from rltserve.core import stage_worker
rows, context, warmup, steps = (int(a) for a in sys.argv[1:3] + sys.argv[4:6])
mixed = sys.argv[3] == "mixed"
import torch
torch.set_num_threads(1)
stage_worker.tune_gc()
getattr(stage_worker, "tune_malloc", bool)()
cell = _Cell(StandInModel(), rows, context)
_measure(cell, warmup, mixed, False)
toggle = ["callgrind_control", "-i"]
subprocess.run(toggle + ["on", str(os.getpid())], check=True, capture_output=True)
_measure(cell, steps, mixed, False)
subprocess.run(toggle + ["off", str(os.getpid())], check=True, capture_output=True)
"""


def _count(checkouts: dict[str, Path], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per checkout, instructions per measured step (and with ``--cache-sim`` the estimated
    cycles), both checkouts run at once under callgrind."""
    argv = [str(args.rows), str(args.context), args.kind, str(args.warmup), str(args.steps)]
    argv.append(json.dumps(_sampling(args)))
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for name, checkout in checkouts.items():
            out = Path(tmp) / f"{name}.out"
            procs[name] = subprocess.Popen(
                [
                    "valgrind",
                    "--tool=callgrind",
                    "--instr-atstart=no",
                    f"--cache-sim={'yes' if args.cache_sim else 'no'}",
                    f"--callgrind-out-file={out}",
                    sys.executable,
                    "-c",
                    _SAMPLING + _COUNT,
                    *argv,
                ],
                cwd=checkout,
                env=dict(os.environ, PYTHONPATH=str(checkout)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        counts = {}
        for name, proc in procs.items():
            _, err = proc.communicate()
            found = re.search(r"Collected : ([\d ]+)", err)
            if proc.returncode != 0 or found is None:
                raise SystemExit(f"bench_host_ab: the {name} checkout's count failed:\n{err}")
            # Ir, then with the cache simulation Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw.
            events = [int(x) / args.steps for x in found.group(1).split()]
            counts[name] = {"instructions": events[0]}
            if args.cache_sim:
                l1, ll = sum(events[3:6]), sum(events[6:9])
                counts[name]["cycles_estimate"] = events[0] + 10 * l1 + 100 * ll
    return counts


def _run(checkout: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    argv = [str(args.rows), str(args.context), args.kind, str(args.warmup), str(args.steps)]
    argv.append(json.dumps(_sampling(args)))
    out = subprocess.run(
        [sys.executable, "-c", _SAMPLING + _ONE, *argv],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sampling(args: argparse.Namespace) -> dict[str, float]:
    """The decode requests' sampling fields the flags set (none: greedy, as ``bench host``)."""
    out = {}
    if args.temperature:
        out["temperature"] = args.temperature
    if args.repetition_penalty != 1.0:
        out["repetition_penalty"] = args.repetition_penalty
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--new", type=Path, default=Path("."), help="the checkout measured")
    parser.add_argument("--kind", choices=("decode", "mixed"), default="decode")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=0.0, help="decode rows' (0: greedy)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="decode rows'")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per step under callgrind (valgrind) instead of timing pairs",
    )
    parser.add_argument(
        "--cache-sim",
        action="store_true",
        help="with --instructions: simulate the caches too and report estimated cycles",
    )
    args = parser.parse_args()
    if args.cache_sim and not args.instructions:
        parser.error("--cache-sim goes with --instructions")
    if args.instructions:
        if shutil.which("valgrind") is None:
            parser.error("--instructions needs valgrind (callgrind) on PATH")
        counts = _count({"base": args.base.resolve(), "new": args.new.resolve()}, args)
        cell = f"{args.kind}/sync/rows{args.rows}/ctx{args.context}"
        report: dict = {"cell": cell, "steps": args.steps, "sampling": _sampling(args)}
        for figure in counts["base"]:
            per_step = {k: round(v[figure]) for k, v in counts.items()}
            report[f"{figure}_per_step"] = per_step
            report[f"{figure}_new_over_base"] = round(per_step["new"] / per_step["base"], 4)
        print(json.dumps(report, indent=1))
        return
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for i in range(args.pairs):
        for name in ("base", "new") if i % 2 == 0 else ("new", "base"):
            runs[name].append(_run(getattr(args, name).resolve(), args))
    report = {"cell": f"{args.kind}/sync/rows{args.rows}/ctx{args.context}", "pairs": args.pairs}
    report["sampling"] = _sampling(args)
    for phase in PHASES:
        ratios = [n[phase] / b[phase] for b, n in zip(runs["base"], runs["new"])]
        report[phase] = {
            "base_median": round(statistics.median(r[phase] for r in runs["base"]), 4),
            "new_median": round(statistics.median(r[phase] for r in runs["new"]), 4),
            "new_over_base_median": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios],
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
