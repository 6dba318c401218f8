"""Prefill pressure benchmark (``bench offline --kv-pressure prefill``): requests that run out
of KV blocks during their chunked prefill, in every engine mode side by side.

The workload is fixed (seeded): ``NUM_PROMPTS`` prompts of 20-150 tokens, in four families
that share a prefix of 0, 40, 70 or 100 tokens (cut to leave each prompt 8 tokens of its
own), asking in turn for no ``max_tokens`` (the context's rest), 30 and 60 greedy tokens, EOS
ignored; ``max_model_len`` 200, a pool of ``POOL_TOKENS`` positions on each of a request's KV
planes (about one long request; 60 blocks for a 4-loop model at block size 16), steps of 48
tokens at most, prompt chunks of 32, on-demand blocks without a watermark. Every request is
added at once, so the later ones start their prefill beside the earlier ones' decoding and,
being the worst running, preempt themselves when a chunk finds no blocks.

Each mode (``MODES``: whole-budget chunks, 32-token chunks, async scheduling, wavefront prefill
with async scheduling) runs under recompute and under swap preemption, and once on a pool that
holds every request (``unpressured``): each pressured run's outputs must equal it. A request
that preempted itself is re-admitted once the pool holds what it was growing to
(``Request.resume_need``); re-admitted at once, it recomputed up to where it stopped and
preempted itself again every few steps, which ``preemptions`` shows (the figures other than
times are deterministic).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.core.executor import ExecutionFuture
from rltserve.models.base import LoopedModel
from rltserve.sampling import SamplingParams

NUM_PROMPTS = 14
PREFIX_LENS = (0, 40, 70, 100)
PROMPT_LENS = (20, 150)
MAX_TOKENS = (None, 30, 60)
POOL_TOKENS = 240
SCENARIO = {
    "max_model_len": 200,
    "max_num_batched_tokens": 48,
    "prefill_chunk_size": 32,
    "kv_reservation": "ondemand",
    "kv_watermark": 0.0,
    "max_num_seqs": NUM_PROMPTS,
}
MODES = {
    "sync": {"prefill_chunk_size": 48, "async_scheduling": False, "wavefront_prefill": False},
    "chunked": {"async_scheduling": False, "wavefront_prefill": False},
    "async": {"async_scheduling": True, "wavefront_prefill": False},
    "wavefront_async": {"async_scheduling": True, "wavefront_prefill": True},
}
PREEMPTION_MODES = ("recompute", "swap")


def workload(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int | None]]:
    """The prompts and their ``max_tokens`` (the same for a vocabulary and seed)."""
    rng = random.Random(seed)
    ids = min(vocab, 1000)  # (token ids any model of the family has)
    prefixes = [[rng.randrange(ids) for _ in range(n)] for n in PREFIX_LENS]
    prompts = []
    for i in range(NUM_PROMPTS):
        length = rng.randint(*PROMPT_LENS)
        prefix = prefixes[i % len(prefixes)][: length - 8]
        prompts.append(prefix + [rng.randrange(ids) for _ in range(length - len(prefix))])
    return prompts, [MAX_TOKENS[i % len(MAX_TOKENS)] for i in range(NUM_PROMPTS)]


def _run(
    model: LoopedModel,
    engine_kw: dict,
    prompts: list[list[int]],
    params: list[SamplingParams],
) -> dict[str, Any]:
    """One engine's run, driven as the engine loop drives it: with async scheduling the next
    step is planned before the last one's result is applied."""
    core = EngineCore(EngineConfig.from_flat(**engine_kw), model=model)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(f"p{i}", prompt, p)
    limit = 2 if core.config.scheduler.async_scheduling else 1
    outputs: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    in_flight: deque = deque()
    peak = 0
    start = time.perf_counter()
    while core.has_work() or in_flight:
        while len(in_flight) < limit and (plan := core.plan()) is not None:
            future = (
                core.runner.submit(plan)
                if limit > 1
                else ExecutionFuture.completed(core.runner.execute(plan))
            )
            in_flight.append((plan, future))
        peak = max(peak, core.scheduler.num_running)
        if not in_flight:
            raise RuntimeError("requests wait but no step can be planned")
        plan, future = in_flight.popleft()
        for update in core.apply(plan, future.result()):
            if update.error:
                raise RuntimeError(f"request {update.request_id} failed: {update.error}")
            outputs[update.request_id].extend(update.new_token_ids)
    elapsed = time.perf_counter() - start
    stats = core.stats()
    core.shutdown()
    tokens = sum(map(len, outputs.values()))
    return {
        "preemptions": stats.num_preemptions,
        "swap_fallbacks": stats.swap_fallbacks,
        "steps": stats.num_steps,
        # Rows run through the loop, all steps together: the work done, recomputation included.
        "loop_rows": stats.num_rows,
        "peak_running": peak,
        "output_tokens": tokens,
        "seconds": round(elapsed, 4),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "outputs": outputs,
    }


def run_prefill_pressure(
    model: LoopedModel, engine_kw: dict, args: argparse.Namespace, modes: Iterable[str] = MODES
) -> dict[str, Any]:
    """Each of ``modes`` (of ``MODES``) under recompute and swap, against its unpressured run
    (``--repeats R``: every run R times, in rounds; times are medians)."""
    from rltserve.bench.kv import _median

    prompts, max_tokens = workload(model.spec.vocab_size)
    base = SamplingParams(
        temperature=0.0,
        ignore_eos=True,
        exit_threshold=args.exit_threshold,
        exit_criterion=getattr(args, "exit_criterion", None),
        max_loops=args.max_loops,
    )
    params = [base.replace(max_tokens=n) for n in max_tokens]
    kw = {**engine_kw, **SCENARIO}
    probe = EngineCore(EngineConfig.from_flat(**kw), model=model)
    loops = probe.make_request(None, prompts[0], params[0]).num_loops
    pool = probe.kv.blocks_needed(POOL_TOKENS, loops)
    roomy = probe.kv.blocks_needed(SCENARIO["max_model_len"], loops) * NUM_PROMPTS
    caching = probe.prefix_caching
    probe.shutdown()
    cases: dict[str, dict] = {}
    for name in modes:
        mode = {**kw, **MODES[name]}
        if mode["async_scheduling"] and mode.get("exit_mode") == "gate":
            mode["exit_mode"] = "delayed"  # (async scheduling decides exits a loop ahead)
        cases[f"{name}/unpressured"] = {**mode, "num_blocks": roomy}
        for preemption in PREEMPTION_MODES:
            cases[f"{name}/{preemption}"] = {
                **mode,
                "num_blocks": pool,
                "preemption_mode": preemption,
            }
    repeats = getattr(args, "repeats", 1)
    runs: dict[str, list] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            runs[name].append(_run(model, case, prompts, params))
    merged = {name: _median(done) for name, done in runs.items()}
    report: dict[str, Any] = {
        "num_prompts": NUM_PROMPTS,
        "prompt_lens": [len(p) for p in prompts],
        "prefix_lens": list(PREFIX_LENS),
        "max_tokens": max_tokens,
        "num_blocks": pool,
        "unpressured_num_blocks": roomy,
        "block_size": kw.get("block_size", 16),
        **{k: v for k, v in SCENARIO.items() if k != "max_num_seqs"},
        "prefix_caching": caching,
        "repeats": repeats,
        "modes": {},
    }
    for name in modes:
        free = merged[f"{name}/unpressured"]
        row = {"unpressured": _without_outputs(free)}
        for preemption in PREEMPTION_MODES:
            run = merged[f"{name}/{preemption}"]
            row[preemption] = {
                **_without_outputs(run),
                "outputs_match_unpressured": run["outputs"] == free["outputs"],
                "steps_vs_unpressured": round(run["steps"] / free["steps"], 3),
            }
        report["modes"][name] = row
    return report


def _without_outputs(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "outputs"}


COLUMNS = ("mode", "preemption", "preemptions", "steps", "loop rows", "running", "tok/s",
           "same outputs")  # fmt: skip


def format_report(report: dict[str, Any]) -> str:
    """The runs side by side, for people (``--json``: all of it)."""
    head = (
        f"prefill pressure: {report['num_prompts']} prompts of "
        f"{min(report['prompt_lens'])}-{max(report['prompt_lens'])} tokens (shared prefixes "
        f"of {', '.join(map(str, report['prefix_lens']))}), max_tokens "
        f"{'/'.join(str(n) for n in MAX_TOKENS)}, max_model_len {report['max_model_len']}, a "
        f"pool of {report['num_blocks']} blocks, steps of {report['max_num_batched_tokens']} "
        f"tokens, prefix caching {'on' if report['prefix_caching'] else 'off'}"
        + (f"; times are medians of {report['repeats']} rounds" if report["repeats"] > 1 else "")
    )
    cells = [list(COLUMNS)]
    for name, row in report["modes"].items():
        for preemption in ("unpressured", *PREEMPTION_MODES):
            run = row[preemption]
            same = run.get("outputs_match_unpressured")
            cells.append([str(c) for c in (
                name, preemption, run["preemptions"], run["steps"], run["loop_rows"],
                run["peak_running"], f"{run['output_tokens_per_s']:.1f}",
                "-" if same is None else ("yes" if same else "NO"),
            )])  # fmt: skip
    widths = [max(len(c[k]) for c in cells) for k in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if k < 2 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    ]
    return "\n".join([head, *lines])
