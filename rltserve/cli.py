"""The ``rltserve`` command: generate, serve, bench, make-model, info.

Engine flags are derived from the config dataclasses (``--max-num-seqs`` from
``SchedulerConfig.max_num_seqs``), so names and help texts have one source.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Sequence

import orjson

from rltserve.config import CacheConfig, ExecutionConfig, ModelConfig, SchedulerConfig
from rltserve.http.cli import add_bench_serve_parser, add_serve_parser

ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ExecutionConfig)


def _flag_type(field: dataclasses.Field, hints: dict) -> type:
    hint = hints[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and args:
        hint = args[0]
    return hint if hint in (int, float, str) else str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per engine config field."""
    for cls in ENGINE_CONFIGS:
        group = parser.add_argument_group(cls.__name__)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if hints[f.name] is bool:
                group.add_argument(
                    flag,
                    dest=f.name,
                    action=argparse.BooleanOptionalAction,
                    default=f.default,
                    help=f.metadata.get("help", ""),
                )
                continue
            group.add_argument(
                flag,
                dest=f.name,
                type=_flag_type(f, hints),
                default=f.default,
                help=f"{f.metadata.get('help', '')} (default: {f.default})",
            )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        f.name: getattr(args, f.name) for cls in ENGINE_CONFIGS for f in dataclasses.fields(cls)
    }


def _sampling_from_args(args: argparse.Namespace):
    from rltserve.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.request_seed,
        exit_threshold=args.exit_threshold,
        min_loops=args.min_loops,
        max_loops=args.max_loops,
        ignore_eos=args.ignore_eos,
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--request-seed", type=int, default=None, help="sampling seed of the request")
    g.add_argument("--exit-threshold", type=float, default=1.0, help="Ouro exit-gate CDF level")
    g.add_argument("--min-loops", type=int, default=1)
    g.add_argument("--max-loops", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")


def cmd_generate(args: argparse.Namespace) -> int:
    from rltserve.llm import LLM

    params = _sampling_from_args(args)
    prompts = args.prompt or ["Hello"]
    with LLM(**engine_kwargs(args)) as llm:
        outputs = llm.generate(prompts, params)
    for out in outputs:
        if args.json:
            record = {
                "prompt_token_ids": out.prompt_token_ids,
                "text": out.text,
                "token_ids": out.token_ids,
                "exit_depths": out.exit_depths,
                "finish_reason": out.finish_reason,
            }
            sys.stdout.write(orjson.dumps(record).decode() + "\n")
        else:
            depth = f"mean exit depth {out.mean_exit_depth:.2f}"
            sys.stdout.write(
                f"{out.text}\n[{len(out.token_ids)} tokens, {depth}, {out.finish_reason}]\n"
            )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from rltserve import __version__
    from rltserve.native import backend_info

    info = {
        "version": __version__,
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "native": backend_info(),
    }
    print(orjson.dumps(info, option=orjson.OPT_INDENT_2).decode())
    return 0


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from rltserve.bench import run_offline_bench

    report = run_offline_bench(args, engine_kwargs(args))
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    from rltserve.models.presets import add_make_model_args, run_make_model

    parser = argparse.ArgumentParser(prog="rltserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline")
    gen.add_argument("prompt", nargs="*", help="prompt text(s) (default: 'Hello')")
    gen.add_argument("--json", action="store_true", help="one JSON record per prompt")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    mm = sub.add_parser("make-model", help="write a random checkpoint of a preset shape")
    add_make_model_args(mm)
    mm.set_defaults(func=run_make_model)

    info = sub.add_parser("info", help="versions and available backends")
    info.set_defaults(func=cmd_info)
    add_serve_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    off = bench_sub.add_parser("offline", help="offline throughput of the engine")
    off.add_argument("--num-prompts", type=int, default=32)
    off.add_argument("--input-len", type=int, default=64)
    off.add_argument("--output-len", type=int, default=32)
    off.add_argument("--concurrency", type=int, default=32)
    off.add_argument("--exit-threshold", type=float, default=1.0)
    off.add_argument(
        "--compare",
        action="store_true",
        help="refill, no-refill, full depth and a naive loop in one run; with "
        "--async-scheduling: async vs sync through the engine loop at --concurrency-list; "
        "with --cuda-graphs: eager vs CUDA graphs at --exit-threshold and full depth at "
        "--concurrency-list; "
        "with --wavefront-prefill: time to first token vs chunked prefill at --chunk-sizes",
    )
    off.add_argument(
        "--concurrency-list",
        type=_int_list,
        default=[1, 8, 32, 64],
        help="concurrencies of the async and CUDA-graph comparisons (default 1,8,32,64)",
    )
    off.add_argument(
        "--chunk-sizes",
        type=_int_list,
        default=[8, 32, 128],
        help="prefill chunk sizes of the wavefront comparison (default 8,32,128)",
    )
    off.add_argument("--json", action="store_true")
    add_engine_args(off)
    off.set_defaults(func=cmd_bench_offline)
    add_bench_serve_parser(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
