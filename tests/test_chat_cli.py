"""``rltserve chat`` / ``rltserve complete`` against a scripted server: the conversation grows
turn by turn, answers stream to the output, sampling and loop flags are sent only when given,
and a server that cannot be reached or fails is one line and exit code 1 (2 when it refused
the input)."""

from __future__ import annotations

import argparse
import asyncio
import io
import signal

import pytest
from test_http_harness import Script, ScriptedStage, running, scripted_factory, scripted_info

from rltserve import chat_cli
from rltserve.cli import build_parser, main
from rltserve.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_http_harness import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory)


def _args(url: str, **kw) -> argparse.Namespace:
    base = {"url": url, "model_name": None, "api_key": None, "max_tokens": 2,
            "temperature": 0.0, "system_prompt": None, "quick": None, "enable_thinking": False,
            "chat_template_kwargs": None}  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.asyncio
async def test_chat_keeps_the_conversation_and_streams_each_answer(ckpt):
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 77]))  # "Hi"
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        out = io.StringIO()
        args = _args(live.url + "/v1", system_prompt="be brief")
        await chat_cli._chat(args, iter(["hello", "again"]), out)
    assert out.getvalue() == "Hi\nHi\n"
    tok = load_tokenizer(ckpt)
    second = tok.apply_chat_template(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "again"},
        ]
    )
    assert stage.added_prompts[1] == second
    assert [p.max_tokens for p in stage.added_params] == [2, 2]


@pytest.mark.asyncio
async def test_thinking_is_asked_for_and_set_apart_from_the_answer(ckpt):
    """--enable-thinking sends enable_thinking; on a pipe the reasoning is shown between its
    tags (an answer cut off while thinking gets the closing tag too), and only the answer goes
    back in the conversation."""
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 81, 4, 44, 77]))  # Hm</think>Hi
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        out = io.StringIO()
        args = _args(live.url, max_tokens=5, enable_thinking=True)
        await chat_cli._chat(args, iter(["hello", "again"]), out)
        cut = io.StringIO()
        await chat_cli._chat(_args(live.url, enable_thinking=True), iter(["hello"]), cut)
    assert out.getvalue() == "<think>Hm</think>Hi\n<think>Hm</think>Hi\n"
    assert cut.getvalue() == "<think>Hm</think>\n"
    tok = load_tokenizer(ckpt)
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "again"},
    ]
    want = tok.apply_chat_template(history, add_generation_prompt=True, enable_thinking=True)
    assert stage.added_prompts[1] == want  # (the template opens the thinking span)
    assert want[-2:] == tok.encode("<think>\n", add_special_tokens=False)


def test_chat_template_kwargs_must_be_a_json_object(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "-q", "hi", "--chat-template-kwargs", "[1]"])
    assert "'[1]': must be a JSON object" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_complete_streams_each_prompts_completion(ckpt):
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 77]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        out = io.StringIO()
        await chat_cli._complete(_args(live.url, max_tokens=3), iter(["a", "b"]), out)
    assert out.getvalue() == "HiH\nHiH\n"
    assert len(stage.added_prompts) == 2


def test_a_server_that_cannot_be_reached_is_one_line_and_exit_1(capsys, unused_tcp_port):
    url = f"http://127.0.0.1:{unused_tcp_port}/v1"
    assert main(["chat", "-q", "hi", "--url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rltserve: error: cannot reach") and err.count("\n") == 1
    assert main(["complete", "-q", "hi", "--max-tokens", "0"]) == 2


def test_a_url_without_a_scheme_is_refused_at_once_exit_2(capsys):
    """The check AsyncClient and ``bench serve --url`` make, before any request or retry."""
    for command in ("chat", "complete"):
        assert main([command, "-q", "hi", "--url", "127.0.0.1:8000/v1"]) == 2
        assert capsys.readouterr().err == (
            "rltserve: error: --url='127.0.0.1:8000/v1': must be an http(s) URL with a host, "
            "e.g. http://127.0.0.1:8000\n"
        )


def test_input_is_quicks_message_or_stdins_nonblank_lines(monkeypatch):
    assert list(chat_cli._lines("just this")) == ["just this"]
    monkeypatch.setattr("sys.stdin", io.StringIO("first\n\n  \nsecond line\n"))
    assert list(chat_cli._lines(None)) == ["first", "second line"]
    monkeypatch.setattr("sys.stdin", None)  # (started with stdin closed, ``<&-``)
    assert list(chat_cli._lines(None)) == []


def test_ctrl_c_while_waiting_for_a_line_interrupts_at_once(monkeypatch):
    """Under asyncio.run (Python 3.11+) a SIGINT only cancels the main task, which a blocked
    read of stdin never notices: the prompt ignored Ctrl-C until a line came, and then threw
    that line away. The read itself raises KeyboardInterrupt, before any line is taken."""

    class Stdin(io.StringIO):
        def readline(self, *args):
            signal.raise_signal(signal.SIGINT)  # (Ctrl-C while the read blocks)
            return super().readline(*args)

    monkeypatch.setattr("sys.stdin", Stdin("hello\n"))
    taken = []

    async def session():
        for line in chat_cli._lines(None):
            taken.append(line)
            await asyncio.sleep(0)

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(session())
    assert taken == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (asyncio's undone)


@pytest.mark.asyncio
async def test_a_chat_past_the_context_drops_its_oldest_turns_and_goes_on(ckpt, capsys):
    """A 64-token context holds the system prompt and two exchanges (74 tokens with a third
    message): the oldest exchange goes, stderr says so, and every message is answered. A
    message that cannot fit alone is refused on stderr and dropped, the conversation kept."""
    stage = ScriptedStage(scripted_info(ckpt, max_model_len=64), Script([44, 77]))  # "Hi"
    lines = ["tell me more", "tell me again", "tell me once", "x " * 60, "tell me last"]
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        out = io.StringIO()
        args = _args(live.url + "/v1", system_prompt="be brief")
        assert await chat_cli._chat(args, iter(lines), out) == 1
    assert out.getvalue() == "Hi\n" * 4
    err = capsys.readouterr().err.splitlines()
    dropped = "rltserve: the conversation outgrew the context: its oldest 2 messages were dropped"
    assert (len(err), err[0], err[2]) == (3, dropped, dropped)
    assert err[1] == (
        "rltserve: message dropped: 400: This model's maximum context length is 64 tokens. "
        "However, your request has 146 input tokens. Please reduce the length of the input "
        "messages."
    )

    def chat(*turns: str) -> list[int]:
        messages = [{"role": "system", "content": "be brief"}]
        for i, text in enumerate(turns):
            messages += [{"role": "user", "content": text}]
            messages += [{"role": "assistant", "content": "Hi"}] * (i < len(turns) - 1)
        return tok.apply_chat_template(messages, add_generation_prompt=True)

    tok = load_tokenizer(ckpt)
    assert stage.added_prompts == [
        chat(lines[0]),
        chat(lines[0], lines[1]),
        chat(lines[1], lines[2]),
        chat(lines[2], lines[4]),  # (the long message refused, its conversation as it was)
    ]


def test_sampling_and_loop_flags_are_sent_only_when_given():
    """generate's names (--seed also as --request-seed, --max-loops also as Huginn's
    --num-steps); a flag not given sends nothing, leaving the server's default."""
    flags = ["--seed", "7", "--top-p", "0.5", "--top-k", "3", "--min-loops", "2",
             "--num-steps", "6", "--exit-threshold", "0.9", "--exit-criterion", "kl",
             "--init-state", "zero", "--max-tokens", "4", "--temperature", "0.7"]  # fmt: skip
    want = {"model": "m", "max_tokens": 4, "temperature": 0.7, "top_p": 0.5, "top_k": 3,
            "seed": 7, "min_loops": 2, "max_loops": 6, "exit_threshold": 0.9,
            "exit_criterion": "kl", "init_state": "zero"}  # fmt: skip
    for command in ("chat", "complete"):
        args = build_parser().parse_args([command, *flags])
        assert chat_cli._params(args, "m") == want
        args = build_parser().parse_args([command, "--request-seed", "8"])
        assert chat_cli._params(args, "m") == {"model": "m", "seed": 8}
        extra = '{"seed": 9, "max_thinking_tokens": 64, "stop": ["\\n"]}'
        args = build_parser().parse_args([command, "--seed", "8", "--extra-body", extra])
        assert chat_cli._params(args, "m") == {
            "model": "m",
            "seed": 9,
            "max_thinking_tokens": 64,
            "stop": ["\n"],
        }


def test_extra_body_cannot_ask_for_more_answers_or_no_stream(capsys):
    """One answer per message, streamed: ``n`` > 1 would interleave the choices' text on the
    output (and a chat would keep them as one answer), and ``stream: false`` was refused in
    the client's words (``use complete()``). Both are exit 2 naming the flag, before any
    request."""
    for command in ("chat", "complete"):
        for extra, why in (
            ('{"n": 2}', "--extra-body n=2: one answer per message here (n must be 1)"),
            ('{"stream": false}', "--extra-body stream=False: answers are always streamed"),
        ):
            assert (
                main([command, "-q", "hi", "--url", "http://127.0.0.1:9", "--extra-body", extra])
                == 2
            )
            assert capsys.readouterr().err == f"rltserve: error: {why}\n"
    args = build_parser().parse_args(["chat", "--extra-body", '{"n": 1, "stream": true}'])
    chat_cli._check_extra_body(args)  # (what the command does anyway)


@pytest.mark.asyncio
async def test_loop_flags_reach_the_engine(ckpt):
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 77]))
    flags = ["--url", "U", "--max-tokens", "2", "--seed", "7", "--max-loops", "3",
             "--init-state", "zero"]  # fmt: skip
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        for command, session in (("complete", chat_cli._complete), ("chat", chat_cli._chat)):
            args = build_parser().parse_args([command, *flags])
            args.url = live.url
            await session(args, iter(["hello"]), io.StringIO())
    seen = [(p.seed, p.max_loops, p.init_state, p.max_tokens) for p in stage.added_params]
    assert seen == [(7, 3, "zero", 2)] * 2


@pytest.mark.asyncio
async def test_a_refused_input_exits_2_and_a_run_time_failure_1(ckpt, capsys, monkeypatch):
    """A flag's value (400), a model name (404) or a chat message (400) the server refuses is
    bad input, exit 2, as a bad flag is; a wrong key (401) fails at run time, exit 1."""
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 77]))
    async with running(ckpt, client_factory=scripted_factory(stage), api_key="k") as live:
        url = live.url + "/v1"

        async def run(*argv: str) -> tuple[int, str]:
            code = await asyncio.to_thread(main, [*argv, "--url", url])
            return code, capsys.readouterr().err

        key = ("--api-key", "k")
        assert await run("complete", "-q", "hi", "--temperature", "9", *key) == (
            2,
            f"rltserve: error: {url}: 400: temperature=9.0: must be in [0, 2]\n",
        )
        code, err = await run("chat", "-q", "hi", "--model-name", "nope", *key)
        assert (code, err) == (
            2,
            f"rltserve: error: {url}: 404: The model `nope` does not exist.\n",
        )
        monkeypatch.setattr("sys.stdin", io.StringIO("x " * 60 + "\nhello\n"))
        code, err = await run("chat", "--max-tokens", "2", *key)
        assert code == 2 and err.startswith(
            "rltserve: message dropped: 400: This model's maximum context length is "
        )
        code, err = await run("complete", "-q", "hi", "--api-key", "wrong")
        assert code == 1 and err.startswith(f"rltserve: error: {url}: 401: ")
        # A key the server took from vLLM's variable reaches it from there too.
        monkeypatch.delenv("RLTSERVE_API_KEY", raising=False)
        monkeypatch.setenv("VLLM_API_KEY", "k")
        assert await run("complete", "-q", "hi") == (0, "")
