"""The ``rltserve bench offline|rollout|host`` commands: their flag checks, the run, and the
report printed for people (``--json``: for programs). ``rltserve.cli`` builds their parsers;
``bench serve`` is ``rltserve.bench.serve_cli``'s."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from rltserve.config import SchedulerConfig
from rltserve.engine_args import checked_engine_kwargs
from rltserve.progress import progress_enabled


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from rltserve.bench.offline import kv_pressure_requested, run_offline_bench

    for name in ("num_prompts", "input_len", "output_len", "concurrency", "n", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len {args.shared_prefix_len}: must be >= 0")
    default_seqs = SchedulerConfig.__dataclass_fields__["max_num_seqs"].default
    if args.max_num_seqs != default_seqs:  # (was silently replaced by --concurrency)
        raise ValueError(
            f"--max-num-seqs {args.max_num_seqs}: bench offline runs --concurrency requests at "
            "a time; set that instead"
        )
    if args.n > args.num_prompts:  # (--num-prompts/N prompts sampled N times each)
        raise ValueError(f"--n {args.n}: above --num-prompts ({args.num_prompts})")
    if args.num_prompts % args.n:  # (else fewer requests would run than the report says)
        raise ValueError(f"--num-prompts {args.num_prompts}: not a multiple of --n {args.n}")
    _check_one_benchmark(args)
    _check_kv_pressure_swap(args)
    if args.replicas is not None:
        _check_replica_benchmark(args)
    from rltserve.ray.offline import bench_replica_config

    bench_replica_config(args)  # (a bad replica flag, or one given without --replicas)
    if not args.chunk_sizes or min(args.chunk_sizes) < 1:
        raise ValueError(f"--chunk-sizes {args.chunk_sizes}: every value must be >= 1")
    if args.repeats > 1 and not kv_pressure_requested(args):
        raise ValueError(f"--repeats {args.repeats}: only the --kv-pressure runs repeat")
    args.progress = progress_enabled(args.quiet)
    # --cuda-graphs --compare picks graphs per cell (eager only off CUDA): not a config error.
    graphs = args.cuda_graphs and not args.compare
    if args.replicas is not None:
        from rltserve.ray.offline import run_replicas_bench

        report = run_replicas_bench(args, checked_engine_kwargs(args))
    else:
        report = run_offline_bench(args, checked_engine_kwargs(args, cuda_graphs=graphs))
    print_report(report, args.json)
    return 0


def _check_one_benchmark(args: argparse.Namespace) -> None:
    """Refuses flags whose benchmark would not run: the prompt-sharing comparisons and the KV
    pressure workload each run alone (one benchmark per call; see ``run_offline_bench``)."""
    from rltserve.bench.offline import kv_pressure_requested

    sharing = [f"--shared-prefix-len {args.shared_prefix_len}"] * bool(args.shared_prefix_len)
    sharing += [f"--n {args.n}"] * (args.n > 1)
    if args.kv_pressure:
        kv, kv_others = _kv_flag(args), ("disaggregate", "compare")
    else:  # (the older spelling: its --compare is part of it)
        kv, kv_others = "--kv-reservation full --compare", ("disaggregate",)
    rules = [
        (" ".join(sharing), ("kv_pressure", "disaggregate", "compare")),
        (kv if kv_pressure_requested(args) else "", kv_others),
    ]
    for flags, others in rules:
        extra = [f"--{name.replace('_', '-')}" for name in others if getattr(args, name)]
        if flags and extra:
            raise ValueError(
                f"{flags}: a benchmark of its own, not run with {' or '.join(extra)}; "
                "run them one at a time"
            )


def _check_kv_pressure_swap(args: argparse.Namespace) -> None:
    """The KV pressure workload runs swap preemption cases whatever --preemption-mode says:
    without swap space they would fail after the runs before them."""
    if args.kv_pressure and args.swap_space_gb == 0:
        raise ValueError(
            f"--swap-space-gb 0: {_kv_flag(args)} runs swap preemption cases, which need swap "
            "space; give some (default 4)"
        )


def _kv_flag(args: argparse.Namespace) -> str:
    """``--kv-pressure`` as given: the decode workload's spelling alone (its default)."""
    return "--kv-pressure" + (" prefill" if args.kv_pressure == "prefill" else "")


def _check_replica_benchmark(args: argparse.Namespace) -> None:
    """Refuses the flags ``--replicas N`` would ignore: its run (``run_replicas_bench``) is the
    throughput of one sample per prompt spread over the replicas, with no comparison."""
    given = [f"--n {args.n}"] * (args.n > 1)
    given += [f"--shared-prefix-len {args.shared_prefix_len}"] * bool(args.shared_prefix_len)
    given += ["--compare"] * args.compare + [_kv_flag(args)] * bool(args.kv_pressure)
    if given:
        raise ValueError(
            f"{', '.join(given)}: not with --replicas N (it measures one sample per prompt "
            "spread over the replicas, with no comparison); run it without --replicas"
        )


def print_report(report: dict, as_json: bool) -> None:
    if as_json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return
    for key, value in report.items():
        if key == "kv_pressure":
            from rltserve.bench.kv import format_report

            print(format_report(value))
        elif key == "prefill_pressure":
            from rltserve.bench.prefill_pressure import format_report

            print(format_report(value))
        else:
            print("\n".join(_report_lines(key, value, "")))


def _report_lines(key: str, value, pad: str) -> list[str]:
    """``key: value``, a nested report indented under its key (lists of reports as ``-``
    items), for people; ``--json`` is for programs."""
    if isinstance(value, dict) and value:
        return [f"{pad}{key}:"] + [
            line for k, v in value.items() for line in _report_lines(k, v, pad + "  ")
        ]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        lines = [f"{pad}{key}:"]
        for item in value:
            inner = [line for k, v in item.items() for line in _report_lines(k, v, pad + "    ")]
            lines += [f"{pad}  - {inner[0].lstrip()}", *inner[1:]] if inner else [f"{pad}  - {{}}"]
        return lines
    return [f"{pad}{key}: {value}"]


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    from rltserve.bench.rollout import check_workload, run_rollout_bench

    for name in ("num_prompts", "n", "input_len", "max_tokens", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    engine_kw = checked_engine_kwargs(args)
    check_workload(args, engine_kw["model"])
    args.progress = progress_enabled(args.quiet)
    report = run_rollout_bench(args, engine_kw)
    print_report(report, args.json)
    return 0


def cmd_bench_host(args: argparse.Namespace) -> int:
    from rltserve.bench.host import run_host_bench

    quick = args.quick
    rows = [8, 32] if quick else args.rows
    contexts = [128] if quick else args.contexts
    steps = 8 if quick else args.steps
    for name, values in (("rows", rows), ("contexts", contexts)):
        if not values or min(values) < 1:
            raise ValueError(f"--{name} {values}: every value must be >= 1")
    for name in ("steps", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)}: must be >= 1")
    for name, allowed in (
        ("modes", ("sync", "async")),
        ("kinds", ("decode", "mixed")),
        ("schedules", ("carried", "reference")),
    ):
        values = getattr(args, name)
        if not values or any(v not in allowed for v in values):
            raise ValueError(f"--{name} {','.join(values)}: a list of {' and '.join(allowed)}")
    if args.out and Path(args.out).is_dir():  # (checked before the run, not after it)
        raise ValueError(f"--out {args.out}: is a directory; give the report's file path")
    if args.out and not Path(args.out).parent.is_dir():
        raise ValueError(f"--out {args.out}: its directory does not exist")
    report = run_host_bench(
        rows,
        contexts,
        steps=steps,
        repeats=args.repeats,
        modes=tuple(args.modes),
        kinds=tuple(args.kinds),
        schedules=tuple(args.schedules),
        threads=args.threads,
        stage_gc=not args.default_gc,
        progress=(lambda line: print(line, file=sys.stderr)) if not args.quiet else None,
        sampling={"temperature": args.temperature, "repetition_penalty": args.repetition_penalty},
    )
    text = orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()
    print(text, flush=True)  # first: a file that cannot be written must not lose the report
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
