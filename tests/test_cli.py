"""The ``rltserve`` command's offline paths: every engine flag reaches the engine."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import orjson
from reference import Reference
from test_http_harness import tiny_checkpoint

from rltserve import LLM
from rltserve.bench.commands import print_report
from rltserve.cli import build_parser, main
from rltserve.engine_args import ENGINE_CONFIGS, checked_engine_kwargs, engine_kwargs
from rltserve.models.tokenizer import load_tokenizer


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
