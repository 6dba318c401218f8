"""KV pressure benchmark: whole-context reservation vs on-demand blocks (recompute, swap).

The pool holds ``pool_requests`` worst-case requests (prompt + ``max_tokens``); 8x as many
requests arrive at once, each allowed ``8 * output_len`` tokens but stopping after
``output_len`` (every token id stops it once ``output_len`` tokens are out: set on the engine's
requests directly, since as ``stop_token_ids`` with ``min_tokens`` they would be banned, leaving
nothing to sample), as chat requests without ``max_tokens`` do. ``full`` can only run
``pool_requests`` at a time; on-demand runs as many as the written tokens allow and preempts
under pressure. ``unpressured`` is on-demand with
a pool for every request's worst case (no preemption): the reference for the pressure cost.

``sweep``: the on-demand modes again at pools of several fractions of the blocks the
unpressured run held at its peak (the heaviest, ``pool_requests`` worst cases, first), each
without and with time slicing (``preemption_time_slice``: the engine's, else
``SWEEP_TIME_SLICE``), with the tokens/s lost against the unpressured run. On a device where a
step costs about the same at any batch size, that loss follows the step counts.

``--repeats R``: every case R times, in rounds over all of them; times are medians.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from collections.abc import Iterator
from typing import Any

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.core.plan import StepPlan
from rltserve.models.base import LoopedModel
from rltserve.sampling import SamplingParams

SWEEP_FRACTIONS = (0.7, 0.85)  # of the unpressured run's peak blocks, after the main pool
SWEEP_TIME_SLICE = 8

_NO_SLICE = {"preemption_time_slice": 0}
CASES = (
    # (recompute and no time slice whatever the flags say: a full reservation never preempts,
    # and EngineConfig refuses swap and slices with it)
    ("full", {"kv_reservation": "full", "preemption_mode": "recompute", **_NO_SLICE}),
    ("ondemand_recompute", {"kv_reservation": "ondemand", "preemption_mode": "recompute"}),
    ("ondemand_swap", {"kv_reservation": "ondemand", "preemption_mode": "swap"}),
)


STEP_KINDS = ("decode", "chunks", "swap")


@contextlib.contextmanager
def pool_warnings(quiet: bool) -> Iterator[None]:
    """The small pools here are on purpose, so the engine's "max_model_len lowered" warning of
    each is expected: shown once per pool (never with ``quiet``) while the block runs."""
    seen: set[str] = set()

    def once(record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("max_model_len lowered"):
            return True
        text = record.getMessage()
        shown = not quiet and text not in seen
        seen.add(text)
        return shown

    logger = logging.getLogger("rltserve.core.kv_sizing")
    logger.addFilter(once)
    try:
        yield
    finally:
        logger.removeFilter(once)


def step_kind(plan: StepPlan) -> str:
    """What a step runs besides decode tokens: ``"swap"`` when it copies KV to or from swap
    space, ``"chunks"`` when it runs a loop of prompt chunks or replays (items of several rows,
    or given their input tokens), else ``"decode"``. Timed apart, they say whether pressure
    makes the steps with turns cost more or every step (more attention groups, noise)."""
    if plan.swap_out or plan.swap_in:
        return "swap"
    if any(item.num_tokens > 1 or item.token_ids is not None for item in plan.items):
        return "chunks"
    return "decode"


def _run(
    model: LoopedModel, engine_kw: dict, prompts: list[list[int]], params: SamplingParams
) -> dict[str, Any]:
    core = EngineCore(EngineConfig.from_flat(**engine_kw), model=model)
    stop_all = frozenset(range(model.spec.vocab_size))
    for i, prompt in enumerate(prompts):
        request = core.make_request(f"k{i}", prompt, params)
        request.stop_ids = stop_all  # (``params.min_tokens`` holds the stop back)
        core.scheduler.add_request(request)
    tokens = peak = peak_blocks = 0
    total = core.kv.pool.num_total
    runner = core.runner
    # Per kind: steps, wall seconds, model seconds. (Synchronous steps: each one's time is its
    # own.)
    kinds = {kind: [0, 0.0, 0.0] for kind in STEP_KINDS}
    start = time.perf_counter()
    while core.has_work():
        began, model_began = time.perf_counter(), runner.model_seconds
        plan = core.plan()
        if plan is None:
            continue
        for update in core.execute(plan):
            tokens += len(update.new_token_ids)
        kind = kinds[step_kind(plan)]
        kind[0] += 1
        kind[1] += time.perf_counter() - began
        kind[2] += runner.model_seconds - model_began
        peak = max(peak, core.scheduler.num_running)
        peak_blocks = max(peak_blocks, total - core.kv.num_free_blocks)
    elapsed = time.perf_counter() - start
    stats = core.stats()
    model_seconds = runner.model_seconds
    core.shutdown()  # (the preemptor's counts stay readable)
    return {
        "output_tokens": tokens,
        "seconds": round(elapsed, 4),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "peak_running": peak,
        "preemptions": stats.num_preemptions,
        "time_slice_preemptions": core.scheduler.preemptor.num_rotations,
        "peak_blocks": peak_blocks,
        # Wall time per step, and of it inside model calls (the rest: planning, the runner's
        # host work, swap copies), where a step with turns costs more than one without.
        "ms_per_step": round(elapsed * 1e3 / max(stats.num_steps, 1), 3),
        "model_ms_per_step": round(model_seconds * 1e3 / max(stats.num_steps, 1), 3),
        "swap_fallbacks": stats.swap_fallbacks,
        "steps": stats.num_steps,
        # Rows run through the loop, all steps together: the work done, recomputation included
        # (deterministic, unlike the times).
        "loop_rows": stats.num_rows,
        "step_kinds": {
            name: {
                "steps": n,
                "ms_per_step": round(wall * 1e3 / n, 3),
                "model_ms_per_step": round(in_model * 1e3 / n, 3),
            }
            for name, (n, wall, in_model) in kinds.items()
            if n
        },
    }


def run_kv_pressure(
    model: LoopedModel, engine_kw: dict, args: argparse.Namespace, prompts_for
) -> dict[str, Any]:
    """``prompts_for(n)``: n benchmark prompts of ``args.input_len`` tokens. With
    ``args.repeats`` > 1 every case runs that many times, in rounds over all the cases (so a
    slow minute of a shared machine falls on all of them), and the times are the medians."""
    pool_requests = max(1, args.concurrency // 8)
    num = 8 * pool_requests
    max_tokens = 8 * args.output_len
    prompts = prompts_for(num)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=args.output_len,
        ignore_eos=True,  # (``_run`` makes every id stop the request after min_tokens)
        exit_threshold=args.exit_threshold,
    )
    # On demand unless a case says otherwise: the old spelling of the flag (``--kv-reservation
    # full --compare``) must not make the unpressured run and the sweep reserve whole contexts.
    kw = {**engine_kw, "max_num_seqs": num, "kv_watermark": 0.0, "kv_reservation": "ondemand"}
    # A pool that holds one request whatever its planes (at most one per loop, and the
    # boundary's), so that its context is not limited by the pool.
    per_plane = -(-(args.input_len + max_tokens) // kw["block_size"])
    probe_blocks = per_plane * (model.spec.max_loops + 1)
    probe = EngineCore(EngineConfig.from_flat(**{**kw, "num_blocks": probe_blocks}), model=model)
    request = probe.make_request(None, prompts[0], params)
    worst = probe.kv.blocks_needed(request.kv_tokens, request.num_loops)
    probe.shutdown()
    main_pool = worst * pool_requests
    report: dict[str, Any] = {
        "pool_requests": pool_requests,
        "num_requests": num,
        "max_tokens": max_tokens,
        "stops_after": args.output_len,
        "num_blocks": main_pool,
        "repeats": getattr(args, "repeats", 1),
        "attention_pad_budget": engine_kw.get("attention_pad_budget", 0),
        "preemption_time_slice": engine_kw.get("preemption_time_slice", 0),
    }
    if not isinstance(report["repeats"], int) or report["repeats"] < 1:
        raise ValueError(f"repeats={report['repeats']!r}: must be an int >= 1")
    cases = {name: {**kw, **case, "num_blocks": main_pool} for name, case in CASES}
    cases["unpressured"] = {**kw, "num_blocks": worst * num}
    runs = {name: [_run(model, case, prompts, params)] for name, case in cases.items()}
    # The sweep's pools follow the unpressured run's peak (deterministic: the same each round).
    for key, case in _sweep_cases(kw, main_pool, runs["unpressured"][0]["peak_blocks"]):
        cases[key] = case
        runs[key] = [_run(model, case, prompts, params)]
    for _ in range(report["repeats"] - 1):
        for name, case in cases.items():
            runs[name].append(_run(model, case, prompts, params))
    merged = {name: _median(done) for name, done in runs.items()}
    for name, _ in (*CASES, ("unpressured", None)):
        report[name] = merged[name]
    full, free = report["full"], report["unpressured"]
    report["sweep"] = [
        _sweep_row(cases[key], merged[key], free) for key in cases if isinstance(key, tuple)
    ]
    report["ratios"] = {
        "recompute_vs_full_running": round(
            report["ondemand_recompute"]["peak_running"] / full["peak_running"], 3
        ),
        **{
            f"{mode}_vs_full_tokens_per_s": round(
                report[f"ondemand_{mode}"]["output_tokens_per_s"] / full["output_tokens_per_s"], 3
            )
            for mode in ("recompute", "swap")
        },
        **{
            f"{mode}_vs_unpressured_tokens_per_s": round(
                report[f"ondemand_{mode}"]["output_tokens_per_s"] / free["output_tokens_per_s"], 3
            )
            for mode in ("recompute", "swap")
        },
    }
    return report


# Figures that vary from run to run, with the decimals ``_run`` rounds them to (the rest are
# deterministic).
TIMED = {"seconds": 4, "output_tokens_per_s": 2, "ms_per_step": 3, "model_ms_per_step": 3}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run with the median of each timed figure (those of each kind of step too);
    with several runs, also every run's tokens/s (``output_tokens_per_s_runs``), and
    ``differs_across_runs`` naming any other figure whose runs disagree (they should not: the
    schedule is deterministic)."""
    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[0])
    for name, digits in TIMED.items():
        merged[name] = round(statistics.median(run[name] for run in runs), digits)
    merged["output_tokens_per_s_runs"] = [run["output_tokens_per_s"] for run in runs]
    fixed = [_untimed(run) for run in runs]
    differs = [k for k in fixed[0] if any(f[k] != fixed[0][k] for f in fixed)]
    if "step_kinds" in merged and "step_kinds" not in differs:
        merged["step_kinds"] = {
            kind: {
                **first,
                **{
                    name: round(statistics.median(r["step_kinds"][kind][name] for r in runs), 3)
                    for name in ("ms_per_step", "model_ms_per_step")
                },
            }
            for kind, first in runs[0]["step_kinds"].items()
        }
    if differs:
        merged["differs_across_runs"] = differs
    return merged


def _untimed(run: dict[str, Any]) -> dict[str, Any]:
    """A run's figures that should be the same every round: all but the times (a kind of
    step: its count)."""
    fixed = {k: v for k, v in run.items() if k not in TIMED}
    if "step_kinds" in run:
        fixed["step_kinds"] = {kind: s["steps"] for kind, s in run["step_kinds"].items()}
    return fixed


def _sweep_cases(kw: dict, main_pool: int, peak: int) -> list[tuple[tuple, dict]]:
    """The sweep's engine settings, keyed ``(pool, mode, time slice)``: the on-demand modes at
    the main pool and at ``SWEEP_FRACTIONS`` of the unpressured peak, each without and with
    time slicing."""
    pools = [main_pool] + [int(f * peak) for f in SWEEP_FRACTIONS if int(f * peak) > main_pool]
    pools = list(dict.fromkeys(pools))  # (small peaks: fractions may round to one pool)
    sliced = kw.get("preemption_time_slice") or SWEEP_TIME_SLICE
    return [
        (
            (pool, mode, time_slice),
            {
                **kw,
                "preemption_mode": mode,
                "preemption_time_slice": time_slice,
                "num_blocks": pool,
            },
        )
        for pool in pools
        for mode in ("recompute", "swap")
        for time_slice in (0, sliced)
    ]


def _sweep_row(case: dict, run: dict[str, Any], free: dict[str, Any]) -> dict[str, Any]:
    """A sweep run as a report row, with its loss against the unpressured run."""
    rate = run["output_tokens_per_s"] / free["output_tokens_per_s"]
    return {
        "pool_blocks": case["num_blocks"],
        "pool_fraction": round(case["num_blocks"] / free["peak_blocks"], 3),
        "preemption_mode": case["preemption_mode"],
        "preemption_time_slice": case["preemption_time_slice"],
        **run,
        "loss_vs_unpressured": round(1 - rate, 3),
        "steps_vs_unpressured": round(run["steps"] / free["steps"], 3),
    }


# The targets of docs/benchmarks.md "KV pressure": on-demand against full reservation (running
# requests, tokens/s), and the most a run under forced pressure may lose against the
# unpressured one.
TARGET_RUNNING, TARGET_TOKENS, TARGET_LOSS = 4.0, 2.0, 0.30

COLUMNS = ("run", "pool (of peak)", "mode", "slice", "running", "steps", "preemptions",
           "loop rows", "tok/s", "ms/step", *(f"{k} ms (steps)" for k in STEP_KINDS),
           "lost")  # fmt: skip


def format_report(kv: dict[str, Any]) -> str:
    """The report for people (``--json`` prints all of it): every run side by side, then each
    target and whether this run met it, then anything that makes the figures suspect."""
    repeats = kv.get("repeats", 1)
    head = (
        f"KV pressure: {kv['num_requests']} requests (max_tokens {kv['max_tokens']}, each "
        f"stopping after {kv['stops_after']}), a pool of {kv['num_blocks']} blocks "
        f"({kv['pool_requests']} worst cases), attention pad budget "
        f"{kv.get('attention_pad_budget', 0)}"
        + (f"; times are medians of {repeats} rounds" if repeats > 1 else "")
    )
    return "\n".join([head, *_table(kv), *_targets(kv), *_warnings(kv)])


def _table(kv: dict[str, Any]) -> list[str]:
    """A row per run: its pool as a share of the unpressured run's peak blocks, its time per
    step of each kind (``step_kind``), its tokens/s lost against that run. (Each on-demand row
    repeats the setting of a sweep row at the main pool: measured apart, the two show the
    noise.)"""
    free = kv["unpressured"]
    peak = free["peak_blocks"]

    def row(name: str, pool: str, mode: str, time_slice, run: dict[str, Any]) -> list[str]:
        lost = 1 - run["output_tokens_per_s"] / free["output_tokens_per_s"]
        kinds = run.get("step_kinds", {})
        by_kind = [
            f"{kinds[k]['ms_per_step']:.2f} ({kinds[k]['steps']})" if k in kinds else "-"
            for k in STEP_KINDS
        ]
        return [str(c) for c in (
            name, pool, mode, time_slice, run["peak_running"], run["steps"], run["preemptions"],
            run["loop_rows"], f"{run['output_tokens_per_s']:.1f}", f"{run['ms_per_step']:.2f}",
            *by_kind, "" if run is free else f"{lost:.1%}",
        )]  # fmt: skip

    main = f"{kv['num_blocks']} ({kv['num_blocks'] / peak:.0%})"
    time_slice = kv.get("preemption_time_slice", 0)
    cells = [
        list(COLUMNS),
        row("full reservation", main, "-", "-", kv["full"]),
        row("on-demand", main, "recompute", time_slice, kv["ondemand_recompute"]),
        row("on-demand", main, "swap", time_slice, kv["ondemand_swap"]),
        row("unpressured", f"all fit ({peak} used)", "-", "-", free),
    ]
    for r in kv["sweep"]:
        pool = f"{r['pool_blocks']} ({r['pool_blocks'] / peak:.0%})"
        cells.append(row("sweep", pool, r["preemption_mode"], r["preemption_time_slice"], r))
    widths = [max(len(c[k]) for c in cells) for k in range(len(COLUMNS))]
    # (Text columns to the left, figures to the right.)
    return [
        "  ".join(
            c.ljust(w) if k < 4 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in cells
    ]


def _targets(kv: dict[str, Any]) -> list[str]:
    """A line per target: the figure and whether it is met (under pressure, each mode's best
    time slice per pool)."""
    ratios = kv["ratios"]
    peak = kv["unpressured"]["peak_blocks"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    running = ratios["recompute_vs_full_running"]
    out = [
        f"target: on-demand runs >= {TARGET_RUNNING:g}x the requests of full reservation: "
        f"{running:.2f}x, {verdict(running >= TARGET_RUNNING)}"
    ]
    for mode in ("recompute", "swap"):
        x = ratios[f"{mode}_vs_full_tokens_per_s"]
        out.append(
            f"target: {mode} >= {TARGET_TOKENS:g}x the tokens/s of full reservation: "
            f"{x:.2f}x, {verdict(x >= TARGET_TOKENS)}"
        )
    sweep = kv["sweep"]
    for pool in dict.fromkeys(r["pool_blocks"] for r in sweep):
        for mode in ("recompute", "swap"):
            runs = [r for r in sweep if (r["pool_blocks"], r["preemption_mode"]) == (pool, mode)]
            best = min(runs, key=lambda r: r["loss_vs_unpressured"])
            loss = best["loss_vs_unpressured"]
            figure = f"loses {loss:.1%}" if loss >= 0 else f"gains {-loss:.1%}"
            out.append(
                f"target: {mode} with a pool of {pool} blocks ({pool / peak:.0%} of the peak) "
                f"loses < {TARGET_LOSS:.0%}: {figure} at best (slice "
                f"{best['preemption_time_slice']}), {verdict(loss < TARGET_LOSS)}"
            )
    return out


def _warnings(kv: dict[str, Any]) -> list[str]:
    """Runs whose swap fell back to recompute, and figures that should be the same every
    round but were not (the schedule is deterministic)."""
    runs = {name: kv[name] for name in ("full", "ondemand_recompute", "ondemand_swap")}
    runs["unpressured"] = kv["unpressured"]
    for r in kv["sweep"]:
        key = f"sweep {r['pool_blocks']} {r['preemption_mode']} {r['preemption_time_slice']}"
        runs[key] = r
    out = []
    for name, run in runs.items():
        if run.get("swap_fallbacks"):
            out.append(f"note: {name}: {run['swap_fallbacks']} swaps fell back to recompute")
        if run.get("differs_across_runs"):
            out.append(f"warning: {name}: differs across rounds: {run['differs_across_runs']}")
    return out
