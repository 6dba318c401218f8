"""The ``rltserve`` command: generate, serve, chat, complete, bench, make-model, info.

Engine flags are derived from the config dataclasses (``rltserve.engine_args``), so names and
help texts have one source.

Exit codes: 0 done, 1 a failure at run time (a checkpoint that does not load, a stage that
does not start, a port in use, no server to benchmark), 2 bad input (flags, paths, devices).
Either way the failure is one line on stderr, ``rltserve: error: ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import orjson

from rltserve import __version__
from rltserve.bench.commands import cmd_bench_host, cmd_bench_offline, cmd_bench_rollout
from rltserve.bench.rollout import add_rollout_parser
from rltserve.chat_cli import add_client_parsers
from rltserve.engine_args import add_engine_args
from rltserve.generate_command import add_generate_parser
from rltserve.http.cli import add_bench_serve_parser, add_serve_parser
from rltserve.http.config_file import add_config_flag, apply_config_file, named_file
from rltserve.preflight import check_output_dir
from rltserve.progress import progress_enabled, watch_dir_growth
from rltserve.ray.config import add_resource_args
from rltserve.sampling import EXIT_CRITERIA
from rltserve.utils import FlexibleArgumentParser


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


def cmd_make_model(args: argparse.Namespace) -> int:
    from rltserve.models.presets import get_preset, run_make_model

    out: Path = args.out
    check_output_dir(out, args.force)
    spec = get_preset(args.preset)
    itemsize = spec.dtype.itemsize
    total = sum(itemsize * _numel(shape) for shape in spec.tensor_shapes().values())
    with watch_dir_growth(out, total, f"{spec.name} weights", progress_enabled(args.quiet)):
        return run_make_model(args)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    from rltserve.models.presets import add_make_model_args

    description = __doc__.splitlines()[0].replace("``", "")
    # (vLLM's parser: ``--max_model_len`` is ``--max-model-len``, in every command)
    parser = FlexibleArgumentParser(prog="rltserve", description=description)
    parser.add_argument("--version", action="version", version=f"rltserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = add_generate_parser(sub)

    mm = sub.add_parser("make-model", help="write a random checkpoint of a preset shape")
    add_make_model_args(mm)
    mm.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    mm.set_defaults(func=cmd_make_model)

    info = sub.add_parser("info", help="versions and available backends")
    info.set_defaults(func=cmd_info)
    add_serve_parser(sub)
    add_client_parsers(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    off = bench_sub.add_parser("offline", help="offline throughput of the engine")
    off.add_argument("--num-prompts", type=int, default=32, help="requests (default: 32)")
    off.add_argument(
        "--input-len", type=int, default=64, help="prompt tokens per request (default: 64)"
    )
    off.add_argument(
        "--output-len",
        "--max-tokens",
        dest="output_len",
        type=int,
        default=32,
        help="output tokens per request (default: 32)",
    )
    off.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="requests running at once: the engine's max_num_seqs (default: 32)",
    )
    off.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="adaptive exit below 1 (default: full depth, or the --exit-criterion's own)",
    )
    off.add_argument(
        "--exit-criterion",
        choices=sorted(EXIT_CRITERIA),
        default=None,
        help="models without a gate (Huginn, Nanbeige): the zero-shot exit criterion",
    )
    off.add_argument(
        "--max-loops",
        "--num-steps",
        dest="max_loops",
        type=int,
        default=None,
        help="loops per token at most (Huginn, Nanbeige: their depth; default: the model's)",
    )
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
        "--kv-pressure",
        nargs="?",
        const="decode",
        choices=("decode", "prefill"),
        default=None,
        help="a KV pressure workload. decode (the default): a pool for --concurrency/8 "
        "worst-case requests, --concurrency requests that stop early; full reservation vs "
        "on-demand (recompute, swap) vs an unpressured pool in one run (also: "
        "--kv-reservation full --compare). prefill: 14 fixed prompts that preempt themselves "
        "during their chunked prefill (its own pool, context, step and chunk sizes), in "
        "every engine mode (sync, chunked, async, wavefront+async) under recompute and swap, "
        "each against an unpressured run",
    )
    off.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="--kv-pressure: runs of every case, in rounds over all of them; median times",
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
    off.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="split the prompts over N engine replicas on Ray actors and measure their "
        "throughput, one sample per prompt (needs the 'ray' extra; not with --n, "
        "--shared-prefix-len, --compare or --kv-pressure)",
    )
    off.add_argument(
        "--ray-address", default=None, help="Ray cluster for --replicas (default: a local one)"
    )
    add_resource_args(off)  # (--replica-cpus, --replica-gpus: ReplicaConfig's)
    off.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="prompts are one shared prefix of this many tokens plus a distinct --input-len "
        "suffix; compares prefix caching off and on (TTFT, tokens/s)",
    )
    off.add_argument(
        "--n",
        type=int,
        default=1,
        help="also compare --num-prompts/N prompts (a multiple of N) sampled N times each as "
        "groups (one prefill per prompt) with the same requests sent independently",
    )
    off.add_argument("--json", action="store_true", help="print the report as JSON")
    off.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    add_engine_args(off)
    off.set_defaults(func=cmd_bench_offline)
    add_bench_serve_parser(bench_sub)
    rollout = add_rollout_parser(bench_sub)
    add_engine_args(rollout)
    rollout.set_defaults(func=cmd_bench_rollout)
    for command in (gen, off, rollout):  # (the engine commands: serve has its own)
        add_config_flag(command)
    host = bench_sub.add_parser("host", help="host work per engine step, with a stand-in model")
    host.add_argument(
        "--rows", type=_int_list, default=[32, 128, 256, 512], help="decode rows per step (list)"
    )
    host.add_argument(
        "--contexts", type=_int_list, default=[128, 1024, 4096], help="context lengths (list)"
    )
    host.add_argument(
        "--modes", type=_str_list, default=["sync", "async"], help="sync and/or async (list)"
    )
    host.add_argument(
        "--kinds", type=_str_list, default=["decode", "mixed"], help="decode and/or mixed (list)"
    )
    host.add_argument(
        "--schedules",
        type=_str_list,
        default=["carried"],
        help="carried (decode tokens planned once, the default) and/or reference (every loop "
        "planned: carry_decode off); both: cells of each, and their ratios (list)",
    )
    host.add_argument("--steps", type=int, default=40, help="measured steps per cell")
    host.add_argument("--repeats", type=int, default=1, help="runs per cell; medians reported")
    host.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    host.add_argument(
        "--default-gc",
        action="store_true",
        help="Python's default collector settings instead of the stage worker's",
    )
    host.add_argument(
        "--temperature", type=float, default=0.0, help="decode rows' (0: greedy; > 0: seeded draws)"
    )
    host.add_argument("--repetition-penalty", type=float, default=1.0, help="decode rows'")
    host.add_argument("--quick", action="store_true", help="smoke run: rows 8,32, context 128")
    host.add_argument("--out", help="also write the JSON report to this file")
    host.add_argument("--quiet", action="store_true", help="no per-cell lines on stderr")
    # (its report is JSON either way: taken as every other bench command takes it)
    host.add_argument("--json", action="store_true", help="the report as JSON (always)")
    host.set_defaults(func=cmd_bench_host)
    for commands in (sub, bench_sub):  # a missing one is named by its choices, not its dest
        commands.metavar = "{" + ",".join(commands.choices) + "}"

    return parser


def exit_code(exc: BaseException) -> int | None:
    """2 for bad input, 1 for a failure at run time, None for anything else (a bug: its
    traceback is kept)."""
    # CheckpointError is a ValueError, but the checkpoint path was checked before loading: what
    # is left is a file that does not load. Not imported here (it pulls in torch); an instance
    # can only exist once its module is loaded.
    loader = sys.modules.get("rltserve.models.loader")
    if loader is not None and isinstance(exc, loader.CheckpointError):
        return 1
    stage = sys.modules.get("rltserve.core.stage")  # (its StageCheckpointError: the same case)
    if stage is not None and isinstance(exc, stage.StageCheckpointError):
        return 1
    if isinstance(exc, ValueError):
        return 2
    if isinstance(exc, (OSError, RuntimeError)):  # StageError, torch, sockets, files
        return 1
    return None


def one_line(message: str) -> str:
    """``message``'s lines joined by "; ", except a listing: the lines indented under one that
    ends in ":" (``missing tensors (2):`` and its names) follow it joined by ", "."""
    parts: list[str] = []
    listing_at: int | None = None  # the indent of the line that opened the current listing
    for line in message.splitlines():
        text = line.strip()
        if not text:
            continue
        indent = len(line) - len(line.lstrip())
        if listing_at is not None and indent > listing_at:
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + text
            continue
        listing_at = indent if text.endswith(":") else None
        parts.append(text)
    return "; ".join(parts)


def _command_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` were parsed by."""
    for name in (args.command, getattr(args, "bench_command", None)):
        commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if name is None or not commands:
            break
        parser = commands[0].choices[name]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    first, flags = argv[0], parser._option_string_actions
    if first.startswith("-") and not any(flag.startswith(first) for flag in flags):
        # (argparse would report the missing command, not the flag it does not know)
        parser.error(f"unrecognized arguments: {first}")
    args, extra = parser.parse_known_args(argv)
    if extra:  # (parse_args would show the top-level usage, not the command's)
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if getattr(args, "config", None) is not None:  # --config FILE: the flags win over it
            apply_config_file(_command_parser(parser, args), args.config)
            args = parser.parse_known_args(argv)[0]
        return args.func(args)
    except KeyboardInterrupt:
        print("rltserve: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`rltserve info | head -c 1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush)
        return 1
    except Exception as exc:
        code = exit_code(exc)
        if code is None:
            raise
        message = named_file(one_line(str(exc)), args)  # (a value the --config file set)
        print(f"rltserve: error: {message or type(exc).__name__}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
