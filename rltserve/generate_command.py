"""``rltserve generate``: a few prompts through the offline ``LLM``, one line (or JSON record)
per prompt; its flags are the engine's (``engine_args``) and the sampling ones here."""

from __future__ import annotations

import argparse
import sys

import orjson

from rltserve.engine_args import add_engine_args, checked_engine_kwargs
from rltserve.progress import is_terminal
from rltserve.sampling import EXIT_CRITERIA, INIT_STATES


def add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    gen = sub.add_parser("generate", help="generate text offline")
    gen.add_argument(
        "prompt",
        nargs="*",
        help="prompt text(s); '-', or none with stdin a pipe: stdin's lines, one prompt each "
        "(default on a terminal: 'Hello')",
    )
    gen.add_argument(
        "--token-ids",
        action="store_true",
        help="each prompt is comma-separated token ids ('1,5,7'), as a checkpoint without a "
        "tokenizer needs",
    )
    gen.add_argument("--json", action="store_true", help="one JSON record per prompt")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    return gen


def sampling_from_args(args: argparse.Namespace):
    from rltserve.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.request_seed,
        exit_threshold=args.exit_threshold,
        exit_criterion=args.exit_criterion,
        min_loops=args.min_loops,
        max_loops=args.max_loops,
        ignore_eos=args.ignore_eos,
        init_state=args.init_state,
        truncate_prompt_tokens=args.truncate_prompt_tokens,
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32, help="output tokens at most (default: 32)")
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (default: 0.0, greedy; SamplingParams' default is 1.0)",
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0)")
    g.add_argument("--top-k", type=int, default=-1, help="top-k sampling (default: -1, off)")
    g.add_argument("--request-seed", type=int, default=None, help="sampling seed of the request")
    g.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="adaptive exit below 1: Ouro's gate CDF level, or the zero-shot criterion's "
        "threshold (Huginn, Nanbeige)",
    )
    g.add_argument(
        "--exit-criterion",
        choices=sorted(EXIT_CRITERIA),
        default=None,
        help="models without a gate (Huginn, Nanbeige): the zero-shot exit criterion, adaptive at "
        "any --exit-threshold (kl when "
        "--exit-threshold < 1 alone)",
    )
    g.add_argument("--min-loops", type=int, default=1, help="loops per token at least (default 1)")
    g.add_argument(
        "--max-loops",
        "--num-steps",  # (Huginn's name, as chat's and complete's)
        dest="max_loops",
        type=int,
        default=None,
        help="loops per token at most (Huginn, Nanbeige: their depth; default: the model's)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end tokens")
    g.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=None,
        help="keep each prompt's last K tokens (-1: as many as leave room for a token), as "
        "SamplingParams' truncate_prompt_tokens",
    )
    g.add_argument(
        "--init-state",
        choices=INIT_STATES,
        default=None,
        help="Huginn: the recurrent state's start (random per seed, the default, or zeros)",
    )


def _stdin_prompts() -> list[str]:
    """stdin's non-blank lines, one prompt each (as ``rltserve complete`` reads its input)."""
    lines = sys.stdin or ()  # (None: started with stdin closed, ``<&-``)
    prompts = [line.rstrip("\n") for line in lines if line.strip()]
    if not prompts:
        raise ValueError(
            "prompt: none on stdin (read, one per line, for '-' or when no prompt is given "
            "and stdin is not a terminal)"
        )
    return prompts


def _prompt_args(args: argparse.Namespace) -> list[str]:
    """``generate``'s prompt arguments, "-" standing for stdin's lines; with none given,
    stdin's lines when it is not a terminal (a pipe), else the default 'Hello' (or, with
    ``--token-ids``, nothing)."""
    if not args.prompt:
        if sys.stdin is not None and not is_terminal(sys.stdin):  # (None: no stdin at all)
            return _stdin_prompts()
        return [] if args.token_ids else ["Hello"]
    prompts: list[str] = []
    for text in args.prompt:
        prompts += _stdin_prompts() if text == "-" else [text]
    return prompts


def _prompts(args: argparse.Namespace) -> list:
    """``generate``'s prompts as ``LLM.generate`` takes them: texts, or token-id prompts with
    ``--token-ids`` (ValueError naming a prompt that is not ids)."""
    texts = _prompt_args(args)
    if not args.token_ids:
        return texts
    if not texts:
        raise ValueError("--token-ids: give each prompt's ids, e.g. --token-ids 1,5,7")
    out = []
    for text in texts:
        try:
            ids = [int(t) for t in text.split(",")]
        except ValueError:
            raise ValueError(
                f"--token-ids: prompt {text!r} is not comma-separated token ids (e.g. 1,5,7)"
            ) from None
        out.append({"prompt_token_ids": ids})
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    from rltserve.llm import LLM

    params = sampling_from_args(args)
    prompts = _prompts(args)
    with LLM(**checked_engine_kwargs(args)) as llm:
        if llm.tokenizer is None and not args.token_ids:
            raise ValueError(
                "prompt: this checkpoint has no tokenizer, so text cannot be encoded; give "
                "token ids with --token-ids (e.g. --token-ids 1,5,7)"
            )
        outputs = llm.generate(prompts, params, use_tqdm=False)  # (a few prompts, at once)
        has_text = llm.tokenizer is not None
    for out in outputs:
        sample = out.outputs[0]
        if args.json:
            record = {
                "prompt_token_ids": out.prompt_token_ids,
                "text": sample.text,
                "token_ids": sample.token_ids,
                "exit_depths": sample.exit_depths,
                "finish_reason": sample.finish_reason,
            }
            sys.stdout.write(orjson.dumps(record).decode() + "\n")
        else:
            depth = f"mean exit depth {sample.mean_exit_depth:.2f}"
            shown = sample.text if has_text else ",".join(map(str, sample.token_ids))
            sys.stdout.write(
                f"{shown}\n[{len(sample.token_ids)} tokens, {depth}, {sample.finish_reason}]\n"
            )
    return 0
