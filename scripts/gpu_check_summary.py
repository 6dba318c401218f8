"""The summary of scripts/gpu_check.sh: reads the steps' JSON reports from WORK and writes
summary.json and summary.txt to OUT.

Usage: gpu_check_summary.py WORK OUT DEVICE SMALL_PRESET SMALL_DTYPE

A step that failed, timed out or was skipped left no report (or an empty one): its target lines
read "not measured" and the rest is summarised as usual. Targets are one line each: measured
value, target, met yes/no (docs/benchmarks.md has where each target comes from).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

KV_RUNS = ("full", "ondemand_recompute", "ondemand_swap", "unpressured")
PREEMPTION_MODES = ("recompute", "swap")
PHASES = ("plan", "runner", "apply", "emit")  # bench host's
# The host-path targets, as bench host's report states them: (cell, field, op, limit, unit).
HOST_TARGETS = (
    ("decode/sync/rows256/ctx1024", "host_wall_ms", "<=", 1.0, "ms"),
    ("decode/sync/rows256/ctx1024", "steps_per_s", ">=", 1000.0, "steps/s"),
    ("decode/sync/rows512/ctx1024", "host_wall_ms", "<=", 2.0, "ms"),
    ("mixed/sync/rows256/ctx1024", "host_wall_ms", "<=", 1.5, "ms"),
)


def load(work: Path, name: str, key: str | None = None) -> Any:
    f = work / name
    try:
        if not f.is_file() or not f.stat().st_size:
            return None
        report = json.loads(f.read_text())
    except ValueError:
        return None
    return report.get(key) if key else report


def check(target: str, measured: float | None, op: str, limit: float, unit: str, detail=""):
    """One target: ``measured op limit`` is met; ``measured`` None: not measured."""
    met = None
    if measured is not None:
        met = {">=": measured >= limit, "<=": measured <= limit, "<": measured < limit}[op]
    return {
        "target": target,
        "measured": measured,
        "op": op,
        "limit": limit,
        "unit": unit,
        "met": met,
        "detail": detail,
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def kv_checks(kv: dict | None) -> list[dict]:
    """Issue targets of the KV-pressure workload, per preemption mode: on-demand vs full
    reservation (concurrent requests >= 4x, tokens/s >= 2x), and the throughput lost against
    an unpressured pool (< 30%)."""
    kv = kv or {}
    full, free = kv.get("full"), kv.get("unpressured")
    out = []
    for mode in PREEMPTION_MODES:
        run = kv.get(f"ondemand_{mode}")
        running = tokens = loss = None
        if run and full:
            running = _ratio(run["peak_running"], full["peak_running"])
            tokens = _ratio(run["output_tokens_per_s"], full["output_tokens_per_s"])
        if run and free and free["output_tokens_per_s"]:
            loss = round(1 - run["output_tokens_per_s"] / free["output_tokens_per_s"], 3)
        out += [
            check(f"kv {mode} vs full: peak running requests", running, ">=", 4.0, "x"),
            check(f"kv {mode} vs full: tokens/s", tokens, ">=", 2.0, "x"),
            check(f"kv {mode} vs unpressured: tokens/s lost", loss, "<", 0.30, "fraction"),
        ]
    # The pressure sweep: the same loss at each pool size with time slicing.
    for row in kv.get("sweep") or []:
        if row["preemption_time_slice"]:
            out.append(
                check(
                    f"kv {row['preemption_mode']} sliced, pool {row['pool_fraction']:.0%} of "
                    "peak: tokens/s lost",
                    row["loss_vs_unpressured"],
                    "<",
                    0.30,
                    "fraction",
                    f"time slice {row['preemption_time_slice']}, {row['steps']} steps, "
                    f"{row['preemptions']} preemptions",
                )
            )
    return out


def rollout_check(rollout: dict | None) -> dict:
    """Issue target: a training step (weights, then rollouts) takes >= 3x less wall time with
    in-place weight updates than with a new engine per step."""
    if not rollout or "step_speedup" not in rollout:
        return check("rollout restart vs in place: step time", None, ">=", 3.0, "x")
    inplace, restart = rollout["in_place"], rollout["restart"]
    detail = (
        f"in place {inplace['mean_step_s']} s/step (update {inplace['mean_weights_s']} s), "
        f"restart {restart['mean_step_s']} s/step (save + start {restart['mean_weights_s']} s)"
    )
    return check(
        "rollout restart vs in place: step time", rollout["step_speedup"], ">=", 3.0, "x", detail
    )


def host_checks(host: dict | None) -> list[dict]:
    """The host-path targets (``HOST_TARGETS``), from the cells ``bench host`` ran; a cell that
    is missing (its row count not run, or its process timed out) reads "not measured"."""
    cells = (host or {}).get("cells", {})
    out = []
    for key, field, op, limit, unit in HOST_TARGETS:
        cell = cells.get(key)
        name = f"host {key}: " + ("steps/s" if field == "steps_per_s" else "wall per step")
        out.append(check(name, cell[field] if cell else None, op, limit, unit))
    return out


def merge_host(work: Path) -> dict | None:
    """The host reports, one per row count, as one: cells and targets together."""
    merged: dict | None = None
    for f in sorted(work.glob("host_rows*.json"), key=lambda f: int(f.stem[len("host_rows") :])):
        part = load(work, f.name)
        if not part:
            continue
        if merged is None:
            merged = {**part, "cells": {}, "targets": {}}
        merged["cells"].update(part["cells"])
        merged["targets"].update(part["targets"])
    return merged


def graphs_rows(graphs_cmp: dict | None) -> list[dict]:
    rows = []
    for c, row in (graphs_cmp or {}).items():
        if not c.isdigit():
            continue
        for mode in graphs_cmp["modes"]:
            for q in graphs_cmp["exit_thresholds"]:
                run = row.get(f"{mode}_q{q}", {})
                rows.append(
                    {
                        "concurrency": int(c),
                        "mode": mode,
                        "exit_threshold": q,
                        "tokens_per_s": run.get("output_tokens_per_s"),
                        "mean_exit_depth": run.get("mean_exit_depth"),
                        "graph_steps": run.get("graph_steps"),
                        "steps": run.get("steps"),
                        "vs_full_depth": row.get(f"{mode}_vs_full_depth") if q != 1.0 else None,
                        "vs_eager": row.get(f"graphs_vs_eager_q{q}") if mode != "eager" else None,
                    }
                )
    return rows


def _shown(x: float, unit: str) -> str:
    if unit == "fraction":
        return f"{x:.0%}"
    return f"{x:g}" + {"x": "x", "ms": " ms", "steps/s": " steps/s", "cases": " cases"}[unit]


def fuzz_check(fuzz: dict | None) -> dict:
    """The engine on the device equals the CPU oracle (``scripts/fuzz_oracle.py``): no case
    differs beyond float32 rounding of a decision, none crashes."""
    target = "fuzz_oracle on the device: failing cases"
    if not fuzz or "counts" not in fuzz:
        return check(target, None, "<=", 0, "cases")
    n = fuzz["counts"]
    detail = f"{n['cases']} cases: {n['equal']} equal, {n['tie']} ties, {n['refused']} refused"
    return check(target, n["mismatch"] + n["crash"], "<=", 0, "cases", detail)


def check_line(c: dict) -> str:
    measured = "not measured" if c["measured"] is None else _shown(c["measured"], c["unit"])
    limit = _shown(c["limit"], c["unit"])
    met = {None: "-", True: "yes", False: "no"}[c["met"]]
    line = f"  {c['target']:<48} {measured:>16}  target {c['op']} {limit:<13} met {met}"
    return line + (f"  ({c['detail']})" if c["detail"] else "")


def kinds_text(run: dict) -> str:
    """A run's time per step of each kind (``bench/kv.py`` ``step_kind``), with their counts:
    whether pressure makes the steps with turns cost more, or every step. Empty for a report
    without them."""
    kinds = run.get("step_kinds") or {}
    parts = [f"{kind} {s['ms_per_step']} ms ({s['steps']})" for kind, s in kinds.items()]
    return f"; {', '.join(parts)}" if parts else ""


def target_lines(kv, rollout, host, setup: dict) -> list[str]:
    lines = [
        f"targets: kv pressure and rollout on {setup['preset']} ({setup['device']}, "
        f"{setup['dtype']}); host path on the host CPU (stand-in model)"
    ]
    if (kv or {}).get("repeats", 1) > 1:
        lines.append(f"  kv times: medians of {kv['repeats']} runs of each case, in rounds")
    for name in KV_RUNS:
        run = (kv or {}).get(name)
        if run:
            lines.append(
                f"  kv {name:<19} peak running {run['peak_running']:>4}, steps {run['steps']:>5}, "
                f"preemptions {run['preemptions']:>3}, loop rows {run['loop_rows']:>6}, "
                f"{run['output_tokens_per_s']} tok/s"
                + (f", {run['ms_per_step']} ms/step" if "ms_per_step" in run else "")
                + kinds_text(run)
            )
    for row in (kv or {}).get("sweep") or []:
        lines.append(
            f"  kv sweep pool {row['pool_blocks']:>5} ({row['pool_fraction']:.0%} of peak) "
            f"{row['preemption_mode']:<9} slice {row['preemption_time_slice']:>2}: steps "
            f"{row['steps']:>5}, preemptions {row['preemptions']:>3}, loop rows "
            f"{row['loop_rows']:>6}, {row['output_tokens_per_s']} tok/s, lost "
            f"{row['loss_vs_unpressured']:.0%}"
            + (f", {row['ms_per_step']} ms/step" if "ms_per_step" in row else "")
            + kinds_text(row)
        )
    for arm in ("in_place", "restart"):
        run = (rollout or {}).get(arm)
        if run:
            lines.append(
                f"  rollout {arm:<9} {run['mean_step_s']} s/step {run['steps_s']}, weights "
                f"{run['mean_weights_s']} s/step, {run['rollout_tokens_per_s']} tok/s"
                + (f", start-up {run['startup_s']} s once" if "startup_s" in run else "")
            )
    for key, cell in (host or {}).get("cells", {}).items():
        # Asynchronous cells time the runner (on the step thread) by wall clock only; their
        # total CPU time is the engine thread's.
        phases = " ".join(
            f"{p} {cell[f'{p}_cpu_ms']}"
            if f"{p}_cpu_ms" in cell
            else f"{p} ({cell[f'{p}_wall_ms']} wall)"
            for p in PHASES
        )
        total = "total" if "runner_cpu_ms" in cell else "engine thread"
        lines.append(
            f"  host {key:<28} cpu ms: {phases}, {total} {cell['host_cpu_ms']}; wall "
            f"{cell['host_wall_ms']} ms, {cell['steps_per_s']} steps/s"
        )
    return lines


def pad_budget_lines(kv: dict | None, padded: dict | None) -> list[str]:
    """The KV pressure runs (``kv``) against the same runs with an attention pad budget
    (``padded``: ``--attention-pad-budget N``): tokens/s and the loss against each report's own
    unpressured run."""
    if not kv or not padded:
        return []
    budgets = f"{kv.get('attention_pad_budget', 0)} vs {padded.get('attention_pad_budget')}"
    lines = [f"kv pressure, attention pad budget {budgets} (tok/s; loss vs unpressured):"]
    free, free_pad = kv["unpressured"], padded["unpressured"]
    lines.append(
        f"  unpressured            {free['output_tokens_per_s']} vs "
        f"{free_pad['output_tokens_per_s']} tok/s, {free['ms_per_step']} vs "
        f"{free_pad['ms_per_step']} ms/step" + _kinds_vs(free, free_pad)
    )
    key = ("pool_blocks", "preemption_mode", "preemption_time_slice")
    other = {tuple(r[k] for k in key): r for r in padded.get("sweep") or []}
    for row in kv.get("sweep") or []:
        row_pad = other.get(tuple(row[k] for k in key))
        if row_pad:
            lines.append(
                f"  {row['pool_fraction']:.0%} {row['preemption_mode']:<9} slice "
                f"{row['preemption_time_slice']:>2}: {row['output_tokens_per_s']} vs "
                f"{row_pad['output_tokens_per_s']} tok/s, lost {row['loss_vs_unpressured']:.0%} "
                f"vs {row_pad['loss_vs_unpressured']:.0%}, {row['ms_per_step']} vs "
                f"{row_pad['ms_per_step']} ms/step" + _kinds_vs(row, row_pad)
            )
    return lines


def _kinds_vs(run: dict, padded: dict) -> str:
    """Each kind of step's time in ``run`` vs ``padded``: a pad budget pays where the steps
    with prompt chunks or replays (``chunks``) get cheaper and decode steps do not get
    slower."""
    kinds, other = run.get("step_kinds") or {}, padded.get("step_kinds") or {}
    parts = [
        f"{kind} {kinds[kind]['ms_per_step']} vs {other[kind]['ms_per_step']}"
        for kind in kinds
        if kind in other
    ]
    return f"; ms/step {', '.join(parts)}" if parts else ""


def main(argv: list[str]) -> int:
    if len(argv) != 6 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv[1:2] in (["-h"], ["--help"]) else 2
    work, out = Path(argv[1]), Path(argv[2])
    setup = {"device": argv[3], "preset": argv[4], "dtype": argv[5]}
    graphs_cmp = None
    for f in sorted(work.glob("graphs_compare_c*.json"), key=lambda f: int(f.stem.split("_c")[-1])):
        part = load(work, f.name, "graphs_compare")
        if part:
            graphs_cmp = {**(graphs_cmp or {}), **part}
    async_cmp = load(work, "async_compare.json", "async_compare")
    native = load(work, "native_build.json", "backend_info")
    env = load(work, "env.json") or {}
    kv = load(work, "kv_pressure.json", "kv_pressure")
    kv_pad = load(work, "kv_pressure_pad.json", "kv_pressure")
    rollout = load(work, "rollout.json")
    host = merge_host(work)
    fuzz = load(work, "fuzz_oracle.json")
    checks = [*kv_checks(kv), rollout_check(rollout), *host_checks(host), fuzz_check(fuzz)]
    rows = graphs_rows(graphs_cmp)
    summary = {
        "env": env,
        "native": native,
        "runs": rows,
        "graphs_compare": graphs_cmp,
        "async_compare": async_cmp,
        "targets_setup": setup,
        "targets": checks,
        "kv_pressure": kv,
        "kv_pressure_pad_budget": kv_pad,
        "rollout": rollout,
        "host": host,
        "fuzz_oracle": fuzz,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"native backend: {native['backend'] if native else 'not built'}",
        f"{'conc':>5} {'mode':>6} {'thr':>5} {'tok/s':>9} {'depth':>6} {'vs full':>8} "
        f"{'vs eager':>8} {'graphed':>9}",
    ]
    for r in rows:
        graphed = f"{r['graph_steps']}/{r['steps']}" if r["graph_steps"] is not None else "-"
        lines.append(
            f"{r['concurrency']:>5} {r['mode']:>6} {r['exit_threshold']:>5} "
            f"{r['tokens_per_s'] or '-':>9} {r['mean_exit_depth'] or '-':>6} "
            f"{r['vs_full_depth'] or '-':>8} {r['vs_eager'] or '-':>8} {graphed:>9}"
        )
    for c, row in (async_cmp or {}).items():
        lines.append(
            f"async c={c}: sync {row['sync']['output_tokens_per_s']} tok/s, async "
            f"{row['async']['output_tokens_per_s']} tok/s ({row['async_vs_sync']}x), busy "
            f"{row['sync']['executor_busy']} / {row['async']['executor_busy']}"
        )
    lines += target_lines(kv, rollout, host, setup)
    lines += pad_budget_lines(kv, kv_pad)
    lines += [check_line(c) for c in checks]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
