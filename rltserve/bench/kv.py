"""KV pressure benchmark: whole-context reservation vs on-demand blocks (recompute, swap).

The pool holds ``pool_requests`` worst-case requests (prompt + ``max_tokens``); 8x as many
requests arrive at once, each allowed ``8 * output_len`` tokens but stopping after
``output_len`` (every token id is a stop token once ``min_tokens`` are out), as chat requests
without ``max_tokens`` do. ``full`` can only run ``pool_requests`` at a time; on-demand runs as
many as the written tokens allow and preempts under pressure. ``unpressured`` is on-demand with
a pool for every request's worst case (no preemption): the reference for the pressure cost.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.models.base import LoopedModel
from rltserve.sampling import SamplingParams

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
    tokens = peak = 0
    start = time.perf_counter()
    while core.has_work():
        for update in core.step():
            tokens += len(update.new_token_ids)
        peak = max(peak, core.scheduler.num_running)
    elapsed = time.perf_counter() - start
    stats = core.stats()
    core.shutdown()
    return {
        "output_tokens": tokens,
        "seconds": round(elapsed, 4),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "peak_running": peak,
        "preemptions": stats.num_preemptions,
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
