#!/usr/bin/env python
"""Benchmark: where a step's time goes on the host: planning, the runner (outside model calls),
model calls, applying the result.

    python scripts/bench_step_phases.py --model /tmp/rltserve-ouro-tiny --concurrency 128
    python scripts/bench_step_phases.py --model DIR --rounds 5 --out phases.json

Drives an in-process ``EngineCore`` step by step over a synthetic workload (random prompts, EOS
ignored) and times each phase with the thread's CPU time (``time.thread_time``: steady on a
shared machine, where wall time also counts other tenants) and with wall time. Model calls are
the runner's ``model_seconds`` (wall). Medians over ``--rounds`` runs after one warm-up run, in
milliseconds per step. The script imports the rltserve beside it, so a copy placed in another
checkout measures that checkout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rltserve.bench.offline import _workload  # noqa: E402
from rltserve.config import EngineConfig  # noqa: E402
from rltserve.core.engine import EngineCore  # noqa: E402
from rltserve.models import load_model  # noqa: E402
from rltserve.sampling import SamplingParams  # noqa: E402


def run_once(model, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    config = EngineConfig.from_flat(
        model=args.model, max_num_seqs=args.concurrency, device="cpu", dtype="float32"
    )
    core = EngineCore(config, model=model)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        ignore_eos=True,
        exit_threshold=args.exit_threshold,
    )
    for i, prompt in enumerate(prompts):
        core.add_request(f"p{i}", prompt, params)
    cpu = {"plan": 0.0, "runner": 0.0, "apply": 0.0}
    wall = dict(cpu)
    steps = 0
    while core.has_work():
        marks = [(time.thread_time(), time.perf_counter())]
        plan = core.plan()
        marks.append((time.thread_time(), time.perf_counter()))
        if plan is None:
            break
        result = core.runner.execute(plan)
        marks.append((time.thread_time(), time.perf_counter()))
        core.apply(plan, result)
        marks.append((time.thread_time(), time.perf_counter()))
        for name, (a, b) in zip(cpu, zip(marks, marks[1:])):
            cpu[name] += b[0] - a[0]
            wall[name] += b[1] - a[1]
        steps += 1
    model_s = core.runner.model_seconds
    core.shutdown()
    per_step = 1e3 / max(steps, 1)
    return {
        "steps": steps,
        "plan_cpu_ms": cpu["plan"] * per_step,
        "apply_cpu_ms": cpu["apply"] * per_step,
        "runner_cpu_ms": cpu["runner"] * per_step,
        "plan_wall_ms": wall["plan"] * per_step,
        "apply_wall_ms": wall["apply"] * per_step,
        "runner_outside_model_wall_ms": (wall["runner"] - model_s) * per_step,
        "model_wall_ms": model_s * per_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--exit-threshold", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = load_model(args.model, dtype="float32", device="cpu")
    prompts = _workload(args.num_prompts, args.input_len, model.spec.vocab_size)
    run_once(model, args, prompts)  # warm-up
    runs = [run_once(model, args, prompts) for _ in range(args.rounds)]
    report = {
        "model": args.model,
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "rounds": args.rounds,
        "median": {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
