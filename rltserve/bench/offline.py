"""Offline throughput benchmark (``rltserve bench offline``).

Runs a synthetic workload (random token-id prompts, fixed output length, EOS ignored) through an
in-process engine driven step by step, and reports throughput, steps, rows per step, mean exit
depth and the FLOP bound of DESIGN §10 (``flops``: 1.0 or none where early exit saves no
compute or the formula leaves out what the run spends). ``--compare`` runs, in one process on
one loaded model: refill at the requested threshold, no-refill at the same threshold, refill
at full depth, and a plain per-request generate loop (the naive baseline), so ratios come from
one run.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from typing import Any

from rltserve.bench.flops import exit_criterion_run, flops_per_token, run_flop_bound
from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.models import load_model
from rltserve.models.base import LoopedModel
from rltserve.models.naive import naive_generate
from rltserve.progress import progress_bar
from rltserve.sampling import SamplingParams


def _workload(num: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num)]


def _show(args: argparse.Namespace) -> bool:
    """Whether the run shows progress bars (set by the command; tests leave it unset)."""
    return getattr(args, "progress", False)


def run_engine(
    model: LoopedModel,
    engine_kw: dict,
    prompts: list[list[int]],
    params: SamplingParams,
    desc: str = "engine",
    show: bool = False,
) -> dict[str, Any]:
    core = EngineCore(EngineConfig.from_flat(**engine_kw), model=model)
    for i, prompt in enumerate(prompts):
        core.add_request(f"b{i}", prompt, params)
    depths: list[int] = []
    tokens = 0
    bar = progress_bar(len(prompts) * params.max_tokens, desc, show, unit="tok")
    start = time.perf_counter()
    with bar:
        while core.has_work():
            for update in core.step():
                tokens += len(update.new_token_ids)
                depths.extend(update.new_exit_depths)
                bar.update(len(update.new_token_ids))
    elapsed = time.perf_counter() - start
    stats = core.stats()
    model_seconds = core.runner.model_seconds
    core.shutdown()
    extra: dict[str, Any] = {}
    if core.config.scheduler.speculative_tokens:
        extra["draft_loops"] = core.config.scheduler.draft_loops  # the model's default if unset
    if stats.drafts_checked:
        extra["draft_acceptance"] = round(1 - stats.drafts_rejected / stats.drafts_checked, 3)
    if core.runner.graphs is not None:  # how much of the run the CUDA graphs covered
        extra["graph_steps"] = stats.num_graph_steps
    return extra | {
        "output_tokens": tokens,
        "seconds": round(elapsed, 4),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        # (vllm bench throughput's requests/s and tokens/s: prompt and output tokens)
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "total_tokens_per_s": round((sum(map(len, prompts)) + tokens) / elapsed, 2),
        "steps": stats.num_steps,
        "mean_rows_per_step": round(stats.num_rows / max(stats.num_steps, 1), 2),
        "mean_exit_depth": round(sum(depths) / max(len(depths), 1), 3),
        "model_seconds": round(model_seconds, 4),
        "step_overhead": round(elapsed / max(model_seconds, 1e-9), 3),
    }


def _params(args: argparse.Namespace) -> SamplingParams:
    """Each request's: ``output_len`` tokens at ``--exit-threshold`` (``--exit-criterion`` on
    models without a gate) and ``--max-loops``."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        ignore_eos=True,
        exit_threshold=args.exit_threshold,
        exit_criterion=getattr(args, "exit_criterion", None),
        max_loops=args.max_loops,
    )


def run_pipelining_compare(model: LoopedModel, engine_kw: dict, args: argparse.Namespace) -> dict:
    """Token pipelining vs block mode (greedy, full depth) at concurrency 1 and 8."""
    out: dict[str, Any] = {"speculative_tokens": engine_kw["speculative_tokens"]}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for concurrency in (1, 8):
        prompts = _workload(concurrency, args.input_len, model.spec.vocab_size, seed=concurrency)
        kw = {**engine_kw, "max_num_seqs": concurrency}
        no_spec = {**kw, "speculative_tokens": 0, "draft_loops": None}
        block = run_engine(model, no_spec, prompts, params, f"c{concurrency} block", _show(args))
        piped = run_engine(model, kw, prompts, params, f"c{concurrency} pipelined", _show(args))
        out["draft_loops"] = piped["draft_loops"]
        out[str(concurrency)] = {
            "block": block,
            "pipelined": piped,
            "speedup": _ratio(piped, block),
        }
    return out


def run_graphs_compare(model: LoopedModel, engine_kw: dict, args: argparse.Namespace) -> dict:
    """Eager vs CUDA graphs, each at --exit-threshold and at full depth, at every concurrency of
    --concurrency-list, on one loaded model. A concurrency c runs max(4, 2c) prompts (two waves
    of requests); graphs are left out where the device is not CUDA (the eager cells still run,
    e.g. to smoke-test scripts/gpu_check.sh on a CPU)."""
    cuda = engine_kw["device"].startswith("cuda")
    modes = {"eager": False, "graphs": True} if cuda else {"eager": False}
    chosen = 1.0 if args.exit_threshold is None else args.exit_threshold  # (None: full depth)
    thresholds = list(dict.fromkeys((chosen, 1.0)))
    out: dict[str, Any] = {"modes": list(modes), "exit_thresholds": thresholds}
    if not cuda:
        out["note"] = f"device={engine_kw['device']}: CUDA graphs need a CUDA device; eager only"
    warm = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True
    )  # first-use costs stay out of the cells
    run_engine(model, {**engine_kw, "cuda_graphs": False}, _workload(2, 8, 2), warm)
    for concurrency in args.concurrency_list:
        num = max(4, 2 * concurrency)
        prompts = _workload(num, args.input_len, model.spec.vocab_size, seed=concurrency)
        row: dict[str, Any] = {}
        for mode, graphs in modes.items():
            kw = {**engine_kw, "max_num_seqs": concurrency, "cuda_graphs": graphs}
            for q in thresholds:
                params = SamplingParams(
                    temperature=0.0, max_tokens=args.output_len, ignore_eos=True, exit_threshold=q
                )
                row[f"{mode}_q{q}"] = run_engine(
                    model, kw, prompts, params, f"c{concurrency} {mode} q{q}", _show(args)
                )
                _release_device_memory()
        for mode in modes:
            if chosen != 1.0:
                row[f"{mode}_vs_full_depth"] = _ratio(row[f"{mode}_q{chosen}"], row[f"{mode}_q1.0"])
        if "graphs" in modes:
            for q in thresholds:
                row[f"graphs_vs_eager_q{q}"] = _ratio(row[f"graphs_q{q}"], row[f"eager_q{q}"])
        out[str(concurrency)] = row
    return out


def _release_device_memory() -> None:
    """Frees a finished engine's KV and graph pool before the next one allocates its own."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_naive(
    model: LoopedModel, prompts: list[list[int]], params: SamplingParams, show: bool = False
) -> dict:
    tokens = 0
    start = time.perf_counter()
    with progress_bar(len(prompts), "naive", show, unit="req") as bar:
        for prompt in prompts:
            out, _ = naive_generate(
                model,
                prompt,
                params.max_tokens,
                max_loops=params.max_loops,
                exit_threshold=params.exit_threshold,
                min_loops=params.min_loops,
            )
            tokens += len(out)
            bar.update()
    elapsed = time.perf_counter() - start
    return {
        "output_tokens": tokens,
        "seconds": round(elapsed, 4),
        "output_tokens_per_s": round(tokens / elapsed, 2),
    }


def kv_pressure_requested(args: argparse.Namespace) -> bool:
    """``--kv-pressure`` (either workload), or the decode workload's older spelling
    ``--kv-reservation full --compare``."""
    return bool(args.kv_pressure) or (args.kv_reservation == "full" and args.compare)


def run_offline_bench(args: argparse.Namespace, engine_kw: dict) -> dict[str, Any]:
    from rltserve.models.demo import model_or_demo

    engine_kw = {**engine_kw, "model": model_or_demo(engine_kw.get("model"))}
    engine_kw["max_num_seqs"] = args.concurrency
    if engine_kw["async_scheduling"] and engine_kw["exit_mode"] == "gate":
        engine_kw["exit_mode"] = "delayed"  # async needs exits decided a loop ahead
    model = load_model(engine_kw["model"], dtype=engine_kw["dtype"], device=engine_kw["device"])
    prompts = _workload(args.num_prompts, args.input_len, model.spec.vocab_size)
    params = _params(args)
    f0, fr = flops_per_token(model)
    report: dict[str, Any] = {
        "model": engine_kw["model"],
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "concurrency": args.concurrency,
        "exit_threshold": params.exit_threshold,
        "exit_criterion": params.exit_criterion,
        "max_loops": args.max_loops,
        "kv_policy": engine_kw["kv_policy"],
        "exit_mode": engine_kw["exit_mode"],
    }
    if getattr(args, "shared_prefix_len", 0) or getattr(args, "n", 1) > 1:
        from rltserve.bench.prefix import run_prefix_compare

        report["prefix_compare"] = run_prefix_compare(model, engine_kw, args)
        return report
    # With --compare, the wavefront, async and pipelining flags select their own comparisons;
    # each runs its own workload, so the report leaves out the workload flags it does not use.
    if engine_kw["speculative_tokens"] and args.compare:
        _drop(report, "num_prompts", "concurrency")  # (concurrency 1 and 8, a prompt each)
        report["pipelining_compare"] = run_pipelining_compare(model, engine_kw, args)
        return report
    if engine_kw["wavefront_prefill"] and args.compare:
        from rltserve.bench.prefill import run_wcpb_compare

        _drop(report, "num_prompts", "input_len", "output_len", "concurrency")
        report["wcpb_compare"] = run_wcpb_compare(model, engine_kw, args.chunk_sizes)
        return report
    if engine_kw["async_scheduling"] and args.compare:
        _drop(report, "concurrency")  # (--concurrency-list)
        report["async_compare"] = run_async_compare(engine_kw, args, model.spec.vocab_size)
        return report
    if engine_kw["disaggregate"]:  # (the in-process arms below run one engine)
        report["pd_compare"] = run_pd_compare(engine_kw, prompts, params, _show(args))
        return report
    if args.kv_pressure == "prefill":
        from rltserve.bench.kv import pool_warnings
        from rltserve.bench.prefill_pressure import run_prefill_pressure

        _drop(report, "num_prompts", "input_len", "output_len", "concurrency")  # (its own)
        with pool_warnings(getattr(args, "quiet", False)):
            report["prefill_pressure"] = run_prefill_pressure(model, engine_kw, args)
        return report
    if kv_pressure_requested(args):
        from rltserve.bench.kv import pool_warnings, run_kv_pressure

        def prompts_for(n: int) -> list[list[int]]:
            return _workload(n, args.input_len, model.spec.vocab_size)

        with pool_warnings(getattr(args, "quiet", False)):
            report["kv_pressure"] = run_kv_pressure(model, engine_kw, args, prompts_for)
        return report
    if engine_kw["cuda_graphs"] and args.compare:
        _drop(report, "num_prompts", "concurrency")  # (--concurrency-list, 2c prompts each)
        report["graphs_compare"] = run_graphs_compare(model, engine_kw, args)
        return report
    show = _show(args)
    main = run_engine(model, engine_kw, prompts, params, engine_kw["scheduling"], show)
    report[engine_kw["scheduling"]] = main
    # Full depth is the depth the run runs at without an exit: --max-loops when given.
    depth = args.max_loops or model.spec.num_loops
    criterion = exit_criterion_run(
        params.exit_criterion, params.exit_threshold, model.spec.has_gate
    )
    report.update(
        run_flop_bound(
            f0,
            fr,
            depth,
            main["mean_exit_depth"],
            args.input_len,
            args.output_len,
            str(engine_kw["kv_policy"]),
            criterion,
        )
    )
    if not args.compare:
        return report
    other = "no_refill" if engine_kw["scheduling"] == "refill" else "refill"
    other_kw = {**engine_kw, "scheduling": other}
    report[other] = run_engine(model, other_kw, prompts, params, other, show)
    full_params = params.replace(exit_threshold=1.0, exit_criterion=None)
    refill_kw = {**engine_kw, "scheduling": "refill"}
    report["full_depth"] = run_engine(model, refill_kw, prompts, full_params, "full depth", show)
    naive_prompts = prompts[: min(len(prompts), 8)]
    report["naive"] = run_naive(model, naive_prompts, params, show)
    refill = report["refill"]
    report["ratios"] = {
        "refill_vs_no_refill": _ratio(refill, report["no_refill"]),
        "refill_vs_full_depth": _ratio(refill, report["full_depth"]),
        "refill_vs_naive": _ratio(refill, report["naive"]),
        "refill_speedup_vs_flop_bound": None,  # (no bound: ``flop_bound_note``)
    }
    if report["flop_bound_workload"] is not None:
        report["ratios"]["refill_speedup_vs_flop_bound"] = round(
            _ratio(refill, report["full_depth"]) / report["flop_bound_workload"], 3
        )
    return report


def run_stage(
    engine_kw: dict,
    prompts: list[list[int]],
    params: SamplingParams,
    desc: str = "stage",
    show: bool = False,
) -> dict:
    """The workload through a spawned stage (engine loop, executor thread, IPC; two with
    ``disaggregate``) with the front end's per-token work (incremental detokenization) in this
    process."""
    from rltserve.core.pd import stage_client
    from rltserve.models.tokenizer import load_tokenizer
    from rltserve.outputs import OutputAssembler

    tokenizer = load_tokenizer(engine_kw.get("tokenizer") or engine_kw["model"])
    client = stage_client(EngineConfig.from_flat(**engine_kw))
    first: dict[str, float] = {}  # request -> its first token's time
    gaps: list[float] = []  # per finished request: its mean inter-token gap
    bar = progress_bar(len(prompts), desc, show, unit="req")
    try:
        client.wait_ready(300)
        done = threading.Event()
        left = [len(prompts)]
        lock = threading.Lock()

        def sink_for(asm: OutputAssembler):
            def sink(update) -> None:
                asm.add(update)
                if update.new_token_ids and update.request_id not in first:
                    first[update.request_id] = time.perf_counter()
                if update.finish_reason is not None:
                    n = len(asm.output.token_ids)
                    if n > 1:  # the request's mean inter-token gap
                        gaps.append((time.perf_counter() - first[update.request_id]) / (n - 1))
                    bar.update()
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()

            return sink

        start = time.perf_counter()
        before = client.stats
        for i, prompt in enumerate(prompts):
            asm = OutputAssembler(f"s{i}", prompt, tokenizer)
            client.add_request(f"s{i}", prompt, params, sink_for(asm))
        done.wait()
        elapsed = time.perf_counter() - start
        stats = client.stats
    finally:
        bar.close()
        client.close()

    def since(name: str) -> float:  # the counter's growth during the run
        return getattr(stats, name) - (getattr(before, name) if before else 0)

    tokens = len(prompts) * params.max_tokens
    steps = int(since("num_steps"))
    ttft = [t - start for t in first.values()]
    return {
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "seconds": round(elapsed, 4),
        "ttft_mean_ms": round(1e3 * sum(ttft) / max(len(ttft), 1), 1),
        "itl_mean_ms": round(1e3 * sum(gaps) / max(len(gaps), 1), 2),
        # Where the wall time goes: executing steps (of which inside model calls); the rest is
        # the engine loop's planning, result handling and IPC not hidden behind a step.
        "executor_busy": round(since("busy_seconds") / elapsed, 3),
        "executor_model": round(since("model_seconds") / elapsed, 3),
        "ms_per_step": round(1e3 * elapsed / max(steps, 1), 2),
        "steps": steps,
    }


def run_async_compare(engine_kw: dict, args: argparse.Namespace, vocab: int) -> dict:
    """Async vs sync scheduling through the real engine loop, at several concurrencies."""
    out: dict[str, Any] = {}
    params = _params(args)
    for concurrency in args.concurrency_list:
        prompts = _workload(max(args.num_prompts, concurrency), args.input_len, vocab)
        row = {}
        for mode in (False, True):
            kw = {**engine_kw, "max_num_seqs": concurrency, "async_scheduling": mode}
            name = "async" if mode else "sync"
            desc = f"c{concurrency} {name}"
            row[name] = run_stage(kw, prompts, params, desc, _show(args))
        row["async_vs_sync"] = _ratio(row["async"], row["sync"])
        out[str(concurrency)] = row
    return out


def run_pd_compare(engine_kw: dict, prompts, params: SamplingParams, show: bool) -> dict:
    """One stage against prefill/decode stages, all requests at once (each arm spawned)."""
    out: dict[str, Any] = {}
    for name, pd in (("one_stage", False), ("disaggregated", True)):
        pd_only = {
            k: engine_kw.get(k) if pd else None for k in ("prefill_device", "kv_transfer_gb")
        }
        kw = {**engine_kw, "disaggregate": pd, **pd_only}
        out[name] = run_stage(kw, prompts, params, name, show)
    out["disaggregated_vs_one_stage"] = _ratio(out["disaggregated"], out["one_stage"])
    return out


def _drop(report: dict, *keys: str) -> None:
    for key in keys:
        del report[key]


def _ratio(a: dict, b: dict) -> float:
    return round(a["output_tokens_per_s"] / b["output_tokens_per_s"], 3)
