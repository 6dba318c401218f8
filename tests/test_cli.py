"""The ``rltserve`` command's offline paths: every engine flag reaches the engine."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import math
import re

import orjson
import pytest
from reference import Reference
from test_http_harness import tiny_checkpoint

import rltserve.cli as cli
import rltserve.llm
from rltserve import LLM
from rltserve.bench.commands import print_report
from rltserve.cli import build_parser, main
from rltserve.config import EngineConfig
from rltserve.engine_args import ENGINE_CONFIGS, checked_engine_kwargs, engine_kwargs
from rltserve.generate_command import sampling_from_args
from rltserve.http.config import ServerConfig
from rltserve.models.tokenizer import load_tokenizer
from rltserve.outputs import CompletionOutput, RequestOutput


def test_llm_takes_every_engine_option_with_the_config_default():
    """`rltserve generate` passes every config field to LLM: the two must not drift apart."""
    params = inspect.signature(LLM).parameters
    for cls in ENGINE_CONFIGS:
        for f in dataclasses.fields(cls):
            if f.name == "model":
                continue  # LLM's positional argument (None: the demo model)
            assert f.name in params, f"LLM has no argument {f.name!r} ({cls.__name__})"
            default = f.default_factory() if callable(f.default_factory) else f.default
            if f.name == "kv_cache_gb":  # None: the config's default (or, on CUDA, what
                default = None  # vLLM's gpu_memory_utilization leaves)
            assert params[f.name].default == default, f.name
    args = build_parser().parse_args(["generate", "Hi"])
    assert set(engine_kwargs(args)) <= set(params)


def test_dtype_flag_takes_vllms_names(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    for flag, dtype in [("auto", "float32"), ("half", "float16"), ("float", "float32")]:
        args = build_parser().parse_args(["generate", "Hi", "--model", str(ckpt), "--dtype", flag])
        assert checked_engine_kwargs(args)["dtype"] == dtype, flag


def test_generate_command_prints_json_records(tmp_path_factory, capsys):
    model = tiny_checkpoint(tmp_path_factory)  # has a tokenizer
    rc = main(
        ["generate", "Hello", "world", "--model", str(model), "--max-tokens", "3",
         "--ignore-eos", "--json", "--num-blocks", "64"]
    )  # fmt: skip
    assert rc == 0
    records = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 2
    tok = load_tokenizer(model)
    ref = Reference.load(model)
    for prompt, record in zip(["Hello", "world"], records, strict=True):
        # ouro-tiny's default: the model's 4 loops, fixed depth, greedy.
        want = ref.generate(tok.encode(prompt), 3, kv_policy="last_exited")
        assert record["token_ids"] == want.tokens and record["exit_depths"] == want.exit_depths
        assert record["text"] == tok.decode(want.tokens)
        assert record["finish_reason"] == "length"


def test_bench_reports_print_nested_figures_indented_under_their_keys(capsys):
    report = {
        "model": "m",
        "refill": {"steps": 16, "ratios": {"vs_full": 1.5}},
        "rows": [{"pool": 1, "run": {"steps": 3}}, {"pool": 2}],
        "plain": [1, 2],
        "empty": {},
    }
    print_report(report, as_json=False)
    assert capsys.readouterr().out.splitlines() == [
        "model: m",
        "refill:",
        "  steps: 16",
        "  ratios:",
        "    vs_full: 1.5",
        "rows:",
        "  - pool: 1",
        "    run:",
        "      steps: 3",
        "  - pool: 2",
        "plain: [1, 2]",
        "empty: {}",
    ]


def test_every_flag_of_every_command_has_help():
    def unexplained(parser: argparse.ArgumentParser, name: str) -> list[str]:
        out = []
        for action in parser._actions:  # (argparse keeps no public list of them)
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    out += unexplained(child, f"{name} {sub}")
            elif action.option_strings and not action.help:
                out.append(f"{name} {action.option_strings[0]}")
        return out

    assert unexplained(build_parser(), "rltserve") == []


def _flags(parser: argparse.ArgumentParser, name: str = "rltserve"):
    """(command, action) for every optional flag of every (sub)command."""
    for action in parser._actions:  # (argparse keeps no public list of them)
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _flags(child, f"{name} {sub}")
        elif action.option_strings:
            yield name, action


def test_help_names_both_models_without_a_gate_where_the_zero_shot_criteria_apply():
    helps = {(command, a.dest): a.help for command, a in _flags(build_parser())}
    criterion = "models without a gate (Huginn, Nanbeige): the zero-shot exit criterion"
    depth = "loops per token at most (Huginn, Nanbeige: their depth; default: the model's)"
    assert helps["rltserve bench offline", "exit_criterion"] == criterion
    assert helps["rltserve generate", "exit_criterion"].startswith(criterion + ", adaptive at")
    for command in ("rltserve bench offline", "rltserve generate"):
        assert helps[command, "max_loops"] == depth
    assert helps["rltserve generate", "exit_threshold"] == (
        "adaptive exit below 1: Ouro's gate CDF level, or the zero-shot criterion's threshold "
        "(Huginn, Nanbeige)"
    )
    said = [key for key, text in helps.items() if "zero-shot" in (text or "")]
    assert said and all("Nanbeige" in helps[key] for key in said), said


def test_every_default_a_help_text_states_is_the_flags_default():
    stated = re.compile(r"\(default:? ([^\s,;)]+(?:,[^\s,;)]+)*)")
    checked = 0
    for command, action in _flags(build_parser()):
        said = stated.search(action.help or "")
        if said is None or action.default is None:
            continue  # (a dataclass flag of serve passes only what is given: its default is None)
        default, text = action.default, said.group(1)
        if isinstance(default, list):
            assert ",".join(map(str, default)) == text, (command, action.dest)
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            assert float(text) == default, (command, action.dest)
        else:
            assert str(default) == text, (command, action.dest)
        checked += 1
    assert checked > 50


def test_dataclass_flags_state_their_fields_default():
    actions = {a.dest: a for command, a in _flags(build_parser()) if command == "rltserve serve"}
    for cls in (*ENGINE_CONFIGS, ServerConfig):
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True) and f.default is not None:
                assert actions[f.name].help.endswith(f"(default: {f.default})"), f.name


def test_generate_sampling_flags_and_their_defaults_reach_the_request():
    params = sampling_from_args(build_parser().parse_args(["generate", "--seed", "5"]))
    assert (params.max_tokens, params.temperature, params.top_p) == (32, 0.0, 1.0)
    assert (params.seed, params.min_loops, params.max_loops) == (None, 1, None)
    assert (params.exit_threshold, params.exit_criterion, params.ignore_eos) == (1.0, None, False)
    assert params.init_state is None and params.top_k in (-1, 0)  # (the model's; both: off)
    assert params.truncate_prompt_tokens is None
    flags = ["--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "3",
             "--request-seed", "11", "--exit-threshold", "0.4", "--exit-criterion", "kl",
             "--min-loops", "2", "--max-loops", "3", "--ignore-eos",
             "--init-state", "zero", "--truncate-prompt-tokens", "4"]  # fmt: skip
    params = sampling_from_args(build_parser().parse_args(["generate", *flags]))
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.5, 0.9, 3)
    assert (params.seed, params.exit_threshold, params.exit_criterion) == (11, 0.4, "kl")
    assert (params.min_loops, params.max_loops, params.ignore_eos) == (2, 3, True)
    assert params.init_state == "zero" and params.truncate_prompt_tokens == 4
    # Huginn's num_steps names max_loops here too, as in chat, complete and HTTP bodies.
    for command in (["generate"], ["bench", "offline"]):
        assert build_parser().parse_args([*command, "--num-steps", "64"]).max_loops == 64


class _FakeLLM:
    """Stands in for ``LLM`` in ``cmd_generate``: records what it was given."""

    calls: list = []
    tokenizer = object()

    def __init__(self, **engine):
        self.engine = engine

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((self.engine, prompts, params))
        sample = CompletionOutput(0, "ab", [5, 6, 7], None, None, "length", exit_depths=[1, 2, 4])
        return [RequestOutput(str(i), p, [1], [sample]) for i, p in enumerate(prompts)]


class _Stdin(io.StringIO):
    """stdin holding ``text``: a terminal (``tty``) or a pipe."""

    def __init__(self, text: str = "", tty: bool = False):
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_generate_without_prompts_says_hello_and_prints_each_samples_summary(monkeypatch, capsys):
    monkeypatch.setattr(rltserve.llm, "LLM", _FakeLLM)
    monkeypatch.setattr(_FakeLLM, "calls", [])
    monkeypatch.setattr("sys.stdin", _Stdin(tty=True))  # (an interactive run)
    assert main(["generate", "--max-num-seqs", "3"]) == 0
    [(engine, prompts, params)] = _FakeLLM.calls
    assert prompts == ["Hello"] and params.max_tokens == 32
    assert engine["max_num_seqs"] == 3 and engine["model"] is None
    assert capsys.readouterr().out == "ab\n[3 tokens, mean exit depth 2.33, length]\n"


def test_generate_reads_prompts_from_a_pipe_or_dash_one_per_line(monkeypatch, capsys):
    """With no prompt argument and stdin a pipe, or for '-', each non-blank line of stdin is a
    prompt (as `rltserve complete` reads it); an empty one is an error before any model
    loads."""
    monkeypatch.setattr(rltserve.llm, "LLM", _FakeLLM)
    monkeypatch.setattr(_FakeLLM, "calls", [])
    monkeypatch.setattr("sys.stdin", _Stdin("Hello world\n\n  \nsecond\n"))
    assert main(["generate"]) == 0
    monkeypatch.setattr("sys.stdin", _Stdin("Hello world\n", tty=True))
    assert main(["generate", "first", "-", "last"]) == 0
    monkeypatch.setattr("sys.stdin", _Stdin("1,5\n9\n"))
    assert main(["generate", "--token-ids", "-"]) == 0
    assert [prompts for _, prompts, _ in _FakeLLM.calls] == [
        ["Hello world", "second"],
        ["first", "Hello world", "last"],
        [{"prompt_token_ids": [1, 5]}, {"prompt_token_ids": [9]}],
    ]
    capsys.readouterr()
    for argv in (["generate"], ["generate", "-"]):
        monkeypatch.setattr("sys.stdin", _Stdin("\n"))
        assert main(argv) == 2
        assert capsys.readouterr().err == (
            "rltserve: error: prompt: none on stdin (read, one per line, for '-' or when no "
            "prompt is given and stdin is not a terminal)\n"
        )
    assert len(_FakeLLM.calls) == 3


def test_generate_with_stdin_closed_says_hello_and_reads_no_dash(monkeypatch, capsys):
    # A process started with stdin closed (``<&-``, some job runners) has sys.stdin None: no
    # prompts to read, as on a terminal; '-' then reads none.
    monkeypatch.setattr(rltserve.llm, "LLM", _FakeLLM)
    monkeypatch.setattr(_FakeLLM, "calls", [])
    monkeypatch.setattr("sys.stdin", None)
    assert main(["generate"]) == 0
    assert [prompts for _, prompts, _ in _FakeLLM.calls] == [["Hello"]]
    capsys.readouterr()
    assert main(["generate", "-"]) == 2
    assert capsys.readouterr().err.startswith("rltserve: error: prompt: none on stdin")


def test_generate_token_ids_prompts(monkeypatch, capsys):
    monkeypatch.setattr(rltserve.llm, "LLM", _FakeLLM)
    monkeypatch.setattr(_FakeLLM, "calls", [])
    monkeypatch.setattr("sys.stdin", _Stdin(tty=True))
    assert main(["generate", "--token-ids", "1,5,7", "9", "--json"]) == 0
    [(_, prompts, _)] = _FakeLLM.calls
    assert prompts == [{"prompt_token_ids": [1, 5, 7]}, {"prompt_token_ids": [9]}]
    capsys.readouterr()
    for argv, message in (
        ([], "--token-ids: give each prompt's ids, e.g. --token-ids 1,5,7"),
        (["1,x"], "--token-ids: prompt '1,x' is not comma-separated token ids (e.g. 1,5,7)"),
        (["1,,2"], "--token-ids: prompt '1,,2' is not comma-separated token ids (e.g. 1,5,7)"),
    ):
        assert main(["generate", "--token-ids", *argv]) == 2
        assert capsys.readouterr().err == f"rltserve: error: {message}\n"
    assert len(_FakeLLM.calls) == 1  # (checked before any model loads)


def test_generate_on_a_checkpoint_without_a_tokenizer_takes_token_ids(tmp_path, capsys):
    from rltserve.models.presets import make_model

    model = make_model("ouro-tiny", tmp_path / "m", tokenizer=False)
    common = ["--model", str(model), "--max-tokens", "2", "--num-blocks", "32"]
    assert main(["generate", "Hi", *common]) == 2
    assert capsys.readouterr().err.splitlines()[-1] + "\n" == (
        "rltserve: error: prompt: this checkpoint has no tokenizer, so text cannot be encoded; "
        "give token ids with --token-ids (e.g. --token-ids 1,5,7)\n"
    )
    assert main(["generate", "--token-ids", "5,6", *common, "--json", "--ignore-eos"]) == 0
    (record,) = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = Reference.load(model).generate([5, 6], 2, kv_policy="last_exited")
    assert record["prompt_token_ids"] == [5, 6] and record["token_ids"] == want.tokens
    # without --json (no text to show): the output's ids
    assert main(["generate", "--token-ids", "5,6", *common, "--ignore-eos"]) == 0
    shown = capsys.readouterr().out.splitlines()[0]
    assert shown == ",".join(map(str, want.tokens))


def test_float_flags_parse_as_numbers_the_configs_take():
    flags = ["--kv-cache-gb", "0.5", "--kv-watermark", "0.25", "--swap-space-gb", "2"]
    args = build_parser().parse_args(["serve", *flags, "--drain-timeout-s", "2.5"])
    kw = engine_kwargs(args)
    assert (kw["kv_cache_gb"], kw["kv_watermark"], kw["swap_space_gb"]) == (0.5, 0.25, 2.0)
    assert EngineConfig.from_flat(**kw).cache.kv_watermark == 0.25
    assert args.drain_timeout_s == 2.5 and args.port is None


def test_gpu_memory_utilization_sizes_the_pool_as_llm_does(monkeypatch):
    """vLLM's --gpu-memory-utilization on every engine command: on CUDA, what the share leaves
    is the pool's kv_cache_gb, unless --kv-cache-gb or --num-blocks (also vLLM's
    --num-gpu-blocks-override) is given; on the CPU it has no effect, as LLM's."""
    import rltserve.preflight
    import rltserve.vllm_args

    measured = []

    def kv_cache_gb_for(utilization, device, model, dtype, stages=1):
        measured.append((utilization, device, stages))
        return 3.5 if device.startswith("cuda") else None

    monkeypatch.setattr(rltserve.vllm_args, "kv_cache_gb_for", kv_cache_gb_for)
    monkeypatch.setattr(rltserve.preflight, "check_device", lambda device, flag="": None)
    share = ["--gpu-memory-utilization", "0.5"]

    def kv(*flags: str) -> tuple[float, int | None]:
        kw = checked_engine_kwargs(build_parser().parse_args(["serve", *flags]))
        return kw["kv_cache_gb"], kw["num_blocks"]

    assert kv(*share, "--device", "cuda") == (3.5, None)
    assert kv(*share, "--device", "cuda", "--disaggregate") == (3.5, None)
    assert kv(*share) == (1.0, None)  # the CPU's pool: --kv-cache-gb's default
    assert measured == [(0.5, "cuda", 1), (0.5, "cuda", 2), (0.5, "cpu", 1)]
    measured.clear()  # ("cuda" and "cuda:0" are one GPU: its share is split; cuda:1 has its own)
    pd = ["--device", "cuda", "--disaggregate", "--prefill-device"]
    assert kv(*share, *pd, "cuda:0") == kv(*share, *pd, "cuda:1") == (3.5, None)
    assert measured == [(0.5, "cuda", 2), (0.5, "cuda", 1)]
    measured.clear()
    assert kv(*share, "--device", "cuda", "--kv-cache-gb", "2") == (2.0, None)
    assert kv(*share, "--device", "cuda", "--num-gpu-blocks-override", "100") == (1.0, 100)
    assert kv("--device", "cuda") == (1.0, None)
    assert measured == []
    for command in (["generate"], ["bench", "offline"]):
        args = build_parser().parse_args([*command, *share, "--num-blocks", "7"])
        assert (args.gpu_memory_utilization, args.num_blocks) == (0.5, 7)
    for bad in ("0.0", "1.5", "nan"):
        with pytest.raises(
            ValueError, match=rf"^gpu_memory_utilization={bad}: must be in \(0, 1\]$"
        ):
            kv("--gpu-memory-utilization", bad)


def test_a_token_budget_below_the_default_chunk_caps_the_chunk():
    args = build_parser().parse_args(["generate", "--max-num-batched-tokens", "256"])
    assert checked_engine_kwargs(args)["prefill_chunk_size"] == 256
    args = build_parser().parse_args(["generate", "--prefill-chunk-size", "64"])
    assert checked_engine_kwargs(args)["prefill_chunk_size"] == 64


def test_list_flags_and_aliases():
    parse = build_parser().parse_args
    assert parse(["bench", "host", "--modes", "sync, async"]).modes == ["sync", "async"]
    assert parse(["bench", "offline", "--chunk-sizes", "8,32,"]).chunk_sizes == [8, 32]
    assert parse(["bench", "offline", "--max-tokens", "7"]).output_len == 7
    assert math.isinf(parse(["bench", "serve"]).request_rate)


def test_flags_spelled_with_underscores_as_vllms():
    parse = build_parser().parse_args
    args = parse(
        ["serve", "--max_model_len=4k", "--max_num_seqs", "8", "--served_model_name", "a_b"]
    )
    assert (args.max_model_len, args.max_num_seqs, args.served_model_name) == (4000, 8, ["a_b"])
    assert parse(["generate", "--max_tokens", "3", "--", "--a_b"]).prompt == ["--a_b"]


@pytest.mark.parametrize(
    ("raised", "code", "line"),
    [
        (ValueError("bad\n  value\n"), 2, "rltserve: error: bad; value"),
        (  # the loader's listings: each title and its names on one line
            ValueError(
                "c: checkpoint does not match the config\n  missing tensors (2):\n    a.w\n"
                "    b.w\n  unexpected tensors (1):\n    extra.weight\n  wrong shapes (1):\n"
                "    lm_head.weight: checkpoint [100, 64], expected [512, 64]"
            ),
            2,
            "rltserve: error: c: checkpoint does not match the config; missing tensors (2): "
            "a.w, b.w; unexpected tensors (1): extra.weight; wrong shapes (1): lm_head.weight: "
            "checkpoint [100, 64], expected [512, 64]",
        ),
        (ValueError(""), 2, "rltserve: error: ValueError"),
        (RuntimeError("stage failed"), 1, "rltserve: error: stage failed"),
        (KeyboardInterrupt(), 130, "rltserve: interrupted"),
    ],
)
def test_a_failing_command_ends_with_one_line_and_its_exit_code(
    monkeypatch, capsys, raised, code, line
):
    def fail(args):
        raise raised

    monkeypatch.setattr(cli, "cmd_info", fail)
    assert main(["info"]) == code
    assert capsys.readouterr().err == line + "\n"
