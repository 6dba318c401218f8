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
    monkeypatch.setattr("rltserve.ray.offline.run_replicas_bench", refuse)


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


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-prompts", "5", "--n", "2"], "--num-prompts 5: not a multiple of --n 2"),
        (["--n", "2", "--compare", "--kv-pressure"], "--n 2: a benchmark of its own, not run "
         "with --kv-pressure or --compare"),
        (["--shared-prefix-len", "4", "--disaggregate"], "--shared-prefix-len 4: a benchmark of "
         "its own, not run with --disaggregate"),
        (["--kv-pressure", "--compare"], "--kv-pressure: a benchmark of its own, not run with "
         "--compare"),
        (["--kv-reservation", "full", "--compare", "--disaggregate"], "--kv-reservation full "
         "--compare: a benchmark of its own, not run with --disaggregate"),
    ],
)  # fmt: skip
def test_bench_offline_refuses_flags_whose_benchmark_would_not_run(no_runs, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _run("offline", *flags)


def test_bench_offline_kv_pressure_needs_swap_space(no_runs):
    """Its swap cases would fail after the runs before them, naming a mode never asked for."""
    with pytest.raises(ValueError) as info:
        _run("offline", "--kv-pressure", "--swap-space-gb", "0")
    assert str(info.value) == (
        "--swap-space-gb 0: --kv-pressure runs swap preemption cases, which need swap space; "
        "give some (default 4)"
    )


@pytest.mark.parametrize(
    "flags, given",
    [
        (["--num-prompts", "8", "--n", "4"], "--n 4"),
        (["--compare"], "--compare"),
        (["--shared-prefix-len", "16"], "--shared-prefix-len 16"),
        (["--kv-pressure"], "--kv-pressure"),
    ],
)
def test_bench_offline_refuses_what_replicas_would_ignore(no_runs, flags, given):
    """``--replicas N`` runs one sample per prompt, no comparison: its report had no n."""
    with pytest.raises(ValueError) as info:
        _run("offline", "--replicas", "2", *flags)
    assert str(info.value) == (
        f"{given}: not with --replicas N (it measures one sample per prompt spread over the "
        "replicas, with no comparison); run it without --replicas"
    )


@pytest.mark.parametrize(
    "flags", [["--num-prompts", "6", "--n", "2"], ["--kv-reservation", "full", "--compare"]]
)
def test_bench_offline_runs_a_benchmark_that_takes_all_its_flags(monkeypatch, capsys, flags):
    ran = []
    monkeypatch.setattr(
        rltserve.bench.offline, "run_offline_bench", lambda a, kw: ran.append(a) or {}
    )
    assert _run("offline", "--quiet", *flags) == 0
    assert len(ran) == 1


@pytest.mark.parametrize("name", ["num-prompts", "n", "input-len", "max-tokens", "steps"])
def test_bench_rollout_refuses_counts_below_one(no_runs, name):
    with pytest.raises(ValueError, match=f"--{name} 0: must be >= 1"):
        _run("rollout", f"--{name}", "0")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "--temperature -1: must be a finite number >= 0"),
        (["--exit-threshold", "0"], "--exit-threshold 0: must be > 0"),
        (["--input-len", "64"], "--input-len 64: leaves no room to generate within the context "
         "limit of 64 tokens"),
        (["--input-len", "16", "--max-model-len", "16"], "limit of 16 tokens"),
    ],
)  # fmt: skip
def test_bench_rollout_refuses_sampling_and_lengths_before_any_engine(
    no_runs, tmp_path, flags, message
):
    (tmp_path / "config.json").write_text('{"model_type": "ouro", "max_position_embeddings": 64}')
    with pytest.raises(ValueError, match=re.escape(message)):
        _run("rollout", "--model", str(tmp_path), *flags)


def test_bench_rollout_quiet_turns_the_progress_bars_off(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(
        "rltserve.bench.rollout.run_rollout_bench", lambda args, kw: seen.append(args) or {}
    )
    assert _run("rollout", "--quiet", "--json") == 0
    assert seen[0].progress is False


@pytest.mark.parametrize("name", ["steps", "repeats"])
def test_bench_host_refuses_counts_below_one(no_runs, name):
    with pytest.raises(ValueError, match=f"--{name} 0: must be >= 1"):
        _run("host", f"--{name}", "0")


def test_bench_host_refuses_an_out_file_in_a_missing_directory_before_running(no_runs, tmp_path):
    with pytest.raises(ValueError, match="its directory does not exist"):
        _run("host", "--quick", "--out", str(tmp_path / "missing" / "report.json"))


def test_bench_host_refuses_an_out_path_that_is_a_directory_before_running(no_runs, tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"--out {tmp_path}: is a directory")):
        _run("host", "--quick", "--out", str(tmp_path))


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


def test_bench_host_prints_the_report_before_writing_it(host_calls, tmp_path, capsys, monkeypatch):
    def fail(self, text):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(commands.Path, "write_text", fail)
    with pytest.raises(PermissionError):
        _run("host", "--quick", "--quiet", "--out", str(tmp_path / "report.json"))
    assert orjson.loads(capsys.readouterr().out) == {"cells": 2}  # (not lost)


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
