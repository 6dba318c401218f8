"""The ``bench offline|rollout|host`` commands (rltserve/bench/commands.py): flag checks that
fail before anything runs, and what the commands hand the runs (runs replaced by stubs)."""

from __future__ import annotations

import re

import orjson
import pytest

import rltserve.bench.host
import rltserve.bench.offline
from rltserve.bench import commands
from rltserve.cli import build_parser


def _run(*argv: str) -> int:
    args = build_parser().parse_args(["bench", *argv])
    return args.func(args)


@pytest.fixture
def no_runs(monkeypatch):
    """Any run reached fails the test: the checks must come first."""

    def refuse(*a, **kw):
        raise AssertionError("the run started")

    monkeypatch.setattr(rltserve.bench.offline, "run_offline_bench", refuse)
    monkeypatch.setattr(rltserve.bench.host, "run_host_bench", refuse)
    monkeypatch.setattr("rltserve.bench.rollout.run_rollout_bench", refuse)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--input-len", "0"], "--input-len 0: must be >= 1"),
        (["--output-len", "0"], "--output-len 0: must be >= 1"),
        (["--concurrency", "0"], "--concurrency 0: must be >= 1"),
        (["--n", "0"], "--n 0: must be >= 1"),
        (["--repeats", "0"], "--repeats 0: must be >= 1"),
        (["--shared-prefix-len=-1"], "--shared-prefix-len -1: must be >= 0"),
        (["--num-prompts", "8", "--n", "9"], "--n 9: above --num-prompts (8)"),
    ],
)
def test_bench_offline_refuses_bad_counts_before_running(no_runs, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _run("offline", *flags)


@pytest.mark.parametrize("name", ["num-prompts", "n", "input-len", "max-tokens", "steps"])
def test_bench_rollout_refuses_counts_below_one(no_runs, name):
    with pytest.raises(ValueError, match=f"--{name} 0: must be >= 1"):
        _run("rollout", f"--{name}", "0")


@pytest.mark.parametrize("name", ["steps", "repeats"])
def test_bench_host_refuses_counts_below_one(no_runs, name):
    with pytest.raises(ValueError, match=f"--{name} 0: must be >= 1"):
        _run("host", f"--{name}", "0")


def test_bench_host_refuses_an_out_file_in_a_missing_directory_before_running(no_runs, tmp_path):
    with pytest.raises(ValueError, match="its directory does not exist"):
        _run("host", "--quick", "--out", str(tmp_path / "missing" / "report.json"))


@pytest.fixture
def host_calls(monkeypatch):
    calls: list[dict] = []

    def fake(rows, contexts, **kw):
        calls.append({"rows": rows, "contexts": contexts, **kw})
        return {"cells": len(rows) * len(contexts)}

    monkeypatch.setattr(rltserve.bench.host, "run_host_bench", fake)
    return calls


def test_bench_host_quick_runs_a_small_grid_and_writes_the_report(host_calls, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert _run("host", "--quick", "--quiet", "--steps", "100", "--out", str(out)) == 0
    (call,) = host_calls
    assert (call["rows"], call["contexts"], call["steps"]) == ([8, 32], [128], 8)
    assert call["stage_gc"] is True
    assert orjson.loads(out.read_text()) == {"cells": 2}
    assert orjson.loads(capsys.readouterr().out) == {"cells": 2}


def test_bench_host_default_gc_turns_staged_gc_off(host_calls, capsys):
    _run("host", "--quick", "--quiet", "--default-gc")
    assert host_calls[0]["stage_gc"] is False


@pytest.mark.parametrize("compare, graphs", [([], True), (["--compare"], False)])
def test_bench_offline_compare_picks_cuda_graphs_per_cell(monkeypatch, capsys, compare, graphs):
    seen = []
    monkeypatch.setattr(
        commands, "checked_engine_kwargs", lambda args, **as_run: seen.append(as_run) or {}
    )
    monkeypatch.setattr(rltserve.bench.offline, "run_offline_bench", lambda args, kw: {})
    assert _run("offline", "--cuda-graphs", "--quiet", *compare) == 0
    assert seen == [{"cuda_graphs": graphs}]
