"""``rltserve chat`` and ``rltserve complete``: clients of a running server, as vLLM's ``vllm
chat`` and ``vllm complete``, for trying a served model's chat template and stops by hand.

``chat`` keeps the conversation (and an optional system prompt) and streams each answer; the
thinking span of an answer (``reasoning``, or ``reasoning_content`` from
older servers) is shown dimmed on a terminal, between
``<think>`` and ``</think>`` elsewhere (a pipe keeps the two apart), and is not sent back in
later turns. ``--enable-thinking`` asks a thinking model's template to think
(``chat_template_kwargs``, as the request field; ``--chat-template-kwargs`` gives any).
``complete`` streams a completion of each prompt. Without ``-q`` both read one message or
prompt per line from stdin until end of input, so they work in a pipe too. Sampling and loop
flags (``--seed``, ``--top-p``, ``--max-loops``, ``--init-state``, ...) are spelled as
``rltserve generate``'s and sent only when given: the server's defaults stand for the rest.

A conversation that outgrows the server's context limit goes on, as a chat product's does: its
oldest exchanges are dropped (never the system prompt) until the new message fits, and stderr
says so. A message the server refuses even so (400 or 413: alone too long, say) is dropped with
its error on stderr, the conversation left as it was, and the chat goes on; the command then
exits 2. Any other error (a wrong key, an unknown model) ends the chat, as does any error of
``-q``'s one message. Exit codes follow ``rltserve``'s: 2 when the server refused the input
(400, 404, 413, 422: a flag's value, a model name, a message), 1 for a failure at run time (no
server, a 5xx, a wrong key), 130 on Ctrl-C (at the prompt too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from rltserve.http.api_keys import API_KEY_ENVS, api_key_env
from rltserve.sampling import EXIT_CRITERIA, INIT_STATES
from rltserve.utils.argparse_utils import json_object_arg

if TYPE_CHECKING:
    from rltserve.client import APIError

DEFAULT_URL = "http://localhost:8000/v1"  # (vLLM's; the server's root works too)
_DIM, _RESET = "\x1b[2m", "\x1b[0m"
# Statuses of a server that refused what the user gave (a flag's value, a model name, a
# message): bad input, exit 2; any other error is a failure at run time, exit 1.
_INPUT_REFUSALS = (400, 404, 413, 422)
# The request fields of the optional sampling and loop flags (argparse dest = field name).
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_loops",
    "max_loops",
    "exit_threshold",
    "exit_criterion",
    "init_state",
)


def add_client_parsers(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="chat with a running server (one turn per input line)")
    _add_common(chat)
    chat.add_argument("--system-prompt", default=None, help="a system message opening the chat")
    chat.add_argument("-q", "--quick", metavar="MESSAGE", help="send one message, print, exit")
    chat.add_argument(
        "--enable-thinking",
        action="store_true",
        help="ask a thinking model to think (chat_template_kwargs enable_thinking=true)",
    )
    chat.add_argument(
        "--chat-template-kwargs",
        type=json_object_arg,
        default=None,
        metavar="JSON",
        help="the request's chat_template_kwargs, e.g. '{\"enable_thinking\": true}'",
    )
    chat.set_defaults(func=cmd_chat)
    complete = sub.add_parser(
        "complete", help="complete prompts on a running server (one per input line)"
    )
    _add_common(complete)
    complete.add_argument("-q", "--quick", metavar="PROMPT", help="complete one prompt, exit")
    complete.set_defaults(func=cmd_complete)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server URL (default: {DEFAULT_URL})")
    parser.add_argument(
        "--model-name", default=None, help="model to ask for (default: the server's first)"
    )
    parser.add_argument("--api-key", default=None, help="or env " + " or ".join(API_KEY_ENVS))
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer")
    parser.add_argument("--temperature", type=float, default=None, help="(default: the server's)")
    # (generate's names; none has a default here: what is not given is not sent)
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling")
    parser.add_argument("--top-k", type=int, default=None, help="top-k sampling (-1: off)")
    parser.add_argument(
        "--seed",
        "--request-seed",
        dest="seed",
        type=int,
        default=None,
        help="sampling seed (Huginn: also its random initial state), for repeatable answers",
    )
    parser.add_argument("--min-loops", type=int, default=None, help="loops per token at least")
    parser.add_argument(
        "--max-loops",
        "--num-steps",
        dest="max_loops",
        type=int,
        default=None,
        help="loops per token at most (Huginn, Nanbeige: their depth; default: the server's)",
    )
    parser.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="adaptive exit below 1: Ouro's gate CDF level, or the zero-shot criterion's "
        "threshold (Huginn, Nanbeige)",
    )
    parser.add_argument(
        "--exit-criterion",
        choices=sorted(EXIT_CRITERIA),
        default=None,
        help="models without a gate (Huginn, Nanbeige): the zero-shot exit criterion",
    )
    parser.add_argument(
        "--init-state",
        choices=INIT_STATES,
        default=None,
        help="Huginn: the recurrent state's start (random per seed, or zeros)",
    )
    parser.add_argument(
        "--extra-body",
        type=json_object_arg,
        default=None,
        metavar="JSON",
        help="more request fields, over the flags' (as the OpenAI SDK's extra_body), e.g. "
        '\'{"max_thinking_tokens": 64, "stop": ["\\n\\n"]}\'',
    )


def cmd_chat(args: argparse.Namespace) -> int:
    return _run(args, _chat)


def cmd_complete(args: argparse.Namespace) -> int:
    return _run(args, _complete)


def _run(args: argparse.Namespace, session: Callable) -> int:
    from rltserve.client import APIConnectionError, APIError
    from rltserve.client_request import check_url

    check_url(args.url, "--url")  # (AsyncClient's check, naming the flag)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: must be >= 1")
    _check_extra_body(args)
    try:
        dropped = asyncio.run(session(args, _lines(args.quick), sys.stdout))
    except APIConnectionError as exc:  # (it names the URL)
        raise RuntimeError(str(exc)) from exc
    except APIError as exc:  # (one line; a refused input exits 2, as a bad flag does)
        error = ValueError if exc.status in _INPUT_REFUSALS else RuntimeError
        raise error(f"{args.url}: {exc}") from exc
    return 2 if dropped else 0


def _check_extra_body(args: argparse.Namespace) -> None:
    """ValueError for ``--extra-body`` fields the commands cannot show: several choices (their
    streamed text would interleave on the output, and a chat keeps one answer) or an answer
    not streamed."""
    extra = args.extra_body or {}
    if extra.get("n", 1) not in (1, None):
        raise ValueError(
            f"--extra-body n={extra['n']!r}: one answer per message here (n must be 1)"
        )
    if "stream" in extra and not extra["stream"]:
        raise ValueError(f"--extra-body stream={extra['stream']!r}: answers are always streamed")


def _lines(quick: str | None):
    """The messages to send: ``-q``'s, else stdin's lines (a prompt shown on a terminal)."""
    if quick is not None:
        yield quick
        return
    if sys.stdin is None:  # (started with stdin closed, ``<&-``: no lines to read)
        return
    tty = sys.stdin.isatty()
    while True:
        try:
            with _interruptible():
                line = input("> ") if tty else sys.stdin.readline()
        except EOFError:
            return
        if not tty and not line:
            return
        if line.strip():
            yield line.rstrip("\n")


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C raises KeyboardInterrupt within it. Lines are read while ``asyncio.run`` runs the
    session, and its SIGINT handler (Python 3.11+) only cancels the main task, which a read
    blocked on stdin never notices: the prompt would ignore Ctrl-C until a line came."""
    main = threading.current_thread() is threading.main_thread()  # (only it handles signals)
    previous = signal.getsignal(signal.SIGINT) if main else None
    if not callable(previous) or previous is signal.default_int_handler:
        yield  # (no asyncio handler to undo: another thread, SIGINT ignored or raising)
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


async def _open(args: argparse.Namespace):
    """The client and the model name to send."""
    from rltserve.client import AsyncClient

    # (AsyncClient takes a URL ending in /v1, as OpenAI clients give it)
    # (the server's variables, in its order: a key set for it reaches it from here too)
    env = api_key_env()
    client = AsyncClient(args.url, args.api_key or (os.environ[env] if env else None))
    try:
        model = args.model_name or (await client.models())[0]["id"]
    except BaseException:
        await client.close()
        raise
    return client, model


def _params(args: argparse.Namespace, model: str) -> dict:
    params: dict = {"model": model}
    for name in _OPTIONAL_FIELDS:
        if (value := getattr(args, name, None)) is not None:
            params[name] = value
    params.update(getattr(args, "extra_body", None) or {})
    return params


# Refusals of one message (the rest of the chat may still be answered): 400 (one the context
# cannot hold, among others) and 413 (a body past the server's limit).
_TURN_REFUSALS = (400, 413)


def _past_context(exc: APIError) -> bool:
    """Whether the server refused the conversation as longer than its context (vLLM's wording,
    ``http.context_limit``'s; "context limit": an older rltserve's, where its KV pool held
    less than the model's context)."""
    return exc.status == 400 and any(
        words in exc.message for words in ("maximum context length", "context limit")
    )


def _drop_oldest(messages: list[dict]) -> int:
    """Drops the oldest exchange (a user message and the answers up to the next one) of
    ``messages``, keeping the system prompt and the last message; returns how many went."""
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    after = next(
        (i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), None
    )
    if after is None:
        return 0  # (the new message alone is left)
    del messages[first:after]
    return after - first


async def _chat(args: argparse.Namespace, lines, out: TextIO) -> int:
    """The chat; returns how many messages the server refused (each dropped)."""
    from rltserve.client import APIError

    client, model = await _open(args)
    messages = (
        [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
    )
    params = _params(args, model)
    template_kwargs = dict(args.chat_template_kwargs or {})
    if args.enable_thinking:
        template_kwargs["enable_thinking"] = True
    if template_kwargs:
        params["chat_template_kwargs"] = template_kwargs
    # A terminal tells reasoning from the answer by dimming it; other outputs by its tags.
    opening, closing = (_DIM, _RESET) if out.isatty() else ("<think>", "</think>")
    refused = 0
    async with client:
        for line in lines:
            history = list(messages)  # (what a refused message leaves)
            messages.append({"role": "user", "content": line})
            gone = 0
            while True:
                try:
                    answer = await _answer(client, messages, params, out, opening, closing)
                except APIError as exc:
                    if args.quick is not None or exc.status not in _TURN_REFUSALS:
                        raise
                    if _past_context(exc) and (dropped := _drop_oldest(messages)):
                        gone += dropped
                        continue
                    print(f"rltserve: message dropped: {exc}", file=sys.stderr)
                    messages[:] = history
                    refused += 1
                    break
                messages.append({"role": "assistant", "content": answer})
                if gone:
                    print(
                        f"rltserve: the conversation outgrew the context: its oldest {gone} "
                        "messages were dropped",
                        file=sys.stderr,
                    )
                break
    return refused


async def _answer(
    client, messages: list[dict], params: dict, out: TextIO, opening: str, closing: str
) -> str:
    """Streams the answer to ``messages`` to ``out``; returns its text (the reasoning left
    out)."""
    answer: list[str] = []
    thinking = False
    async for chunk in client.chat_stream(messages, **params):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if reasoning := delta.get("reasoning") or delta.get("reasoning_content"):
                out.write(reasoning if thinking else opening + reasoning)
                thinking = True
            if content := delta.get("content"):
                answer.append(content)
                out.write(closing + content if thinking else content)
                thinking = False
        out.flush()
    out.write(closing + "\n" if thinking else "\n")
    return "".join(answer)


async def _complete(args: argparse.Namespace, lines, out: TextIO) -> int:
    client, model = await _open(args)
    async with client:
        for line in lines:
            async for chunk in client.stream(line, **_params(args, model)):
                for choice in chunk["choices"]:
                    out.write(choice["text"])
                out.flush()
            out.write("\n")
    return 0
