"""KV pressure benchmark: whole-context reservation vs on-demand blocks (recompute, swap).

The pool holds ``pool_requests`` worst-case requests (prompt + ``max_tokens``); 8x as many
requests arrive at once, each allowed ``8 * output_len`` tokens but stopping after
``output_len`` (every token id is a stop token once ``min_tokens`` are out), as chat requests
without ``max_tokens`` do. ``full`` can only run ``pool_requests`` at a time; on-demand runs as
many as the written tokens allow and preempts under pressure. ``unpressured`` is on-demand with
a pool for every request's worst case (no preemption): the reference for the pressure cost.

``sweep``: the on-demand modes again at pools of several fractions of the blocks the
unpressured run held at its peak (the heaviest, ``pool_requests`` worst cases, first), each
without and with time slicing (``preemption_time_slice``: the engine's, else
``SWEEP_TIME_SLICE``), with the tokens/s lost against the unpressured run. On a device where a
step costs about the same at any batch size, that loss follows the step counts.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.models.base import LoopedModel
from rltserve.sampling import SamplingParams

SWEEP_FRACTIONS = (0.7, 0.85)  # of the unpressured run's peak blocks, after the main pool
SWEEP_TIME_SLICE = 8

CASES = (
    ("full", {"kv_reservation": "full"}),
    ("ondemand_recompute", {"kv_reservation": "ondemand", "preemption_mode": "recompute"}),
    ("ondemand_swap", {"kv_reservation": "ondemand", "preemption_mode": "swap"}),
)


def _run(
    model: LoopedModel, engine_kw: dict, prompts: list[list[int]], params: SamplingParams
) -> dict[str, Any]:
    core = EngineCore(EngineConfig.from_flat(**engine_kw), model=model)
    for i, prompt in enumerate(prompts):
        core.add_request(f"k{i}", prompt, params)
    tokens = peak = peak_blocks = 0
    total = core.kv.pool.num_total
    start = time.perf_counter()
    while core.has_work():
        for update in core.step():
            tokens += len(update.new_token_ids)
        peak = max(peak, core.scheduler.num_running)
        peak_blocks = max(peak_blocks, total - core.kv.num_free_blocks)
    elapsed = time.perf_counter() - start
    stats = core.stats()
    model_seconds = core.runner.model_seconds
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
    }


def run_kv_pressure(
    model: LoopedModel, engine_kw: dict, args: argparse.Namespace, prompts_for
) -> dict[str, Any]:
    """``prompts_for(n)``: n benchmark prompts of ``args.input_len`` tokens."""
    pool_requests = max(1, args.concurrency // 8)
    num = 8 * pool_requests
    max_tokens = 8 * args.output_len
    prompts = prompts_for(num)
    vocab = model.spec.vocab_size
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=args.output_len,
        stop_token_ids=tuple(range(vocab)),
        exit_threshold=args.exit_threshold,
    )
    kw = {**engine_kw, "max_num_seqs": num, "kv_watermark": 0.0}
    probe = EngineCore(EngineConfig.from_flat(**{**kw, "num_blocks": 1}), model=model)
    request = probe.make_request(None, prompts[0], params)
    worst = probe.kv.blocks_needed(request.kv_tokens, request.num_loops)
    probe.shutdown()
    report: dict[str, Any] = {
        "pool_requests": pool_requests,
        "num_requests": num,
        "max_tokens": max_tokens,
        "stops_after": args.output_len,
        "num_blocks": worst * pool_requests,
    }
    for name, case in CASES:
        report[name] = _run(
            model, {**kw, **case, "num_blocks": worst * pool_requests}, prompts, params
        )
    report["unpressured"] = _run(model, {**kw, "num_blocks": worst * num}, prompts, params)
    full, free = report["full"], report["unpressured"]
    report["sweep"] = _sweep(model, kw, prompts, params, report["num_blocks"], free)
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


def _sweep(
    model: LoopedModel,
    kw: dict,
    prompts: list[list[int]],
    params: SamplingParams,
    main_pool: int,
    free: dict[str, Any],
) -> list[dict[str, Any]]:
    """The on-demand modes at the main pool and at ``SWEEP_FRACTIONS`` of the unpressured
    peak, each without and with time slicing."""
    peak = free["peak_blocks"]
    pools = [main_pool] + [int(f * peak) for f in SWEEP_FRACTIONS if int(f * peak) > main_pool]
    sliced = kw.get("preemption_time_slice") or SWEEP_TIME_SLICE
    rows = []
    for pool in pools:
        for mode in ("recompute", "swap"):
            for time_slice in (0, sliced):
                case = {"preemption_mode": mode, "preemption_time_slice": time_slice}
                run = _run(model, {**kw, **case, "num_blocks": pool}, prompts, params)
                rate = run["output_tokens_per_s"] / free["output_tokens_per_s"]
                rows.append(
                    {
                        "pool_blocks": pool,
                        "pool_fraction": round(pool / peak, 3),
                        **case,
                        **run,
                        "loss_vs_unpressured": round(1 - rate, 3),
                        "steps_vs_unpressured": round(run["steps"] / free["steps"], 3),
                    }
                )
    return rows
