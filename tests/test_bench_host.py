"""``rltserve bench host``: the host-overhead benchmark's report (shape and consistency; no
timings are asserted), and the stand-in model it drives."""

from __future__ import annotations

import gc
import platform
import shutil

import orjson
import pytest
import torch

from rltserve.bench.host import _Cell
from rltserve.bench.standin import StandInModel
from rltserve.cli import main
from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.sampling import SamplingParams

PHASES = ("plan", "runner", "apply", "emit")


def test_quick_report_has_every_cell_and_sane_values(capsys):
    threads, thresholds = torch.get_num_threads(), gc.get_threshold()
    assert main(["bench", "host", "--quick", "--quiet"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert torch.get_num_threads() == threads  # restored
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
    assert report["stage_gc"] is True
    assert report["stage_malloc"] is (platform.libc_ver()[0] == "glibc")
    assert report["steps"] == 8 and report["threads"] == 1 and report["chunk_tokens"] == 512
    expected = {
        f"{kind}/{mode}/rows{rows}/ctx128"
        for kind in ("decode", "mixed")
        for mode in ("sync", "async")
        for rows in (8, 32)
    }
    assert set(report["cells"]) == expected
    for key, cell in report["cells"].items():
        kind, mode = key.split("/")[:2]
        assert cell["steps"] == 8
        assert cell["context"] == 128 and cell["rows"] in (8, 32)
        assert cell["steps_per_s"] > 0 and cell["gc_ms"] >= 0
        for phase in PHASES:
            assert cell[f"{phase}_wall_ms"] > 0, (key, phase)
            if mode == "sync" or phase != "runner":  # the async runner is on another thread
                assert cell[f"{phase}_cpu_ms"] >= 0, (key, phase)
        assert ("runner_cpu_ms" in cell) == (mode == "sync")
        parts = sum(cell[f"{phase}_wall_ms"] for phase in PHASES)
        assert abs(cell["host_wall_ms"] - parts) < 1e-3 + 1e-6 * parts
        cpu = sum(cell.get(f"{phase}_cpu_ms", 0.0) for phase in PHASES)
        assert abs(cell["host_cpu_ms"] - cpu) < 1e-3 + 1e-6 * cpu
        # Every mixed step carries the 512-token chunk; no decode-only step does.
        assert cell["chunk_steps"] == (8 if kind == "mixed" else 0)
    assert report["targets"] == {}  # no cell at 256 or 512 rows, 1k context


def test_bench_host_usage_errors(capsys):
    assert main(["bench", "host", "--rows", "0", "--quiet"]) == 2
    assert "--rows [0]: every value must be >= 1" in capsys.readouterr().err
    assert main(["bench", "host", "--threads", "0", "--quiet"]) == 2
    assert "--threads 0: must be >= 1" in capsys.readouterr().err
    assert main(["bench", "host", "--modes", "sync,eager", "--quiet"]) == 2
    assert "--modes sync,eager: a list of sync and async" in capsys.readouterr().err
    assert main(["bench", "host", "--kinds", "", "--quiet"]) == 2
    assert "--kinds : a list of decode and mixed" in capsys.readouterr().err
    assert main(["bench", "host", "--schedules", "carried,lazy", "--quiet"]) == 2
    assert "--schedules carried,lazy: a list of carried and reference" in capsys.readouterr().err


def test_one_cell_by_mode_and_kind(capsys):
    argv = ["bench", "host", "--rows", "4", "--contexts", "32", "--steps", "4"]
    assert main([*argv, "--modes", "sync", "--kinds", "decode", "--quiet"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert list(report["cells"]) == ["decode/sync/rows4/ctx32"]
    assert report["cells"]["decode/sync/rows4/ctx32"]["steps"] == 4


def test_both_schedules_side_by_side(capsys):
    """Carried and reference cells in one run (``carry_decode`` on and off), with their
    ratios."""
    argv = ["bench", "host", "--rows", "16", "--contexts", "32", "--steps", "16"]
    argv += ["--modes", "sync", "--kinds", "decode", "--schedules", "carried,reference"]
    assert main([*argv, "--quiet"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    carried, reference = "decode/sync/rows16/ctx32", "decode/sync/rows16/ctx32/reference"
    assert set(report["cells"]) == {carried, reference}
    ratios = report["ratios"][carried]
    assert set(ratios) == {
        "host_cpu_ms_reference_over_carried",
        "steps_per_s_carried_over_reference",
    }
    assert all(v > 0 for v in ratios.values())


def test_standin_model_decodes_deterministically_at_a_fixed_depth():
    """Through the engine: each token is its input + 1, and with threshold 0.8 (CDF 0.5, 0.75,
    0.875 by depth) every token exits at depth 3."""
    model = StandInModel(vocab_size=64)
    core = EngineCore(
        EngineConfig.from_flat(model="stand-in", device="cpu", num_blocks=64), model=model
    )
    core.add_request("a", [5, 9], SamplingParams(temperature=0.0, max_tokens=4, exit_threshold=0.8))
    core.add_request("b", [62], SamplingParams(temperature=0.0, max_tokens=3, exit_threshold=0.8))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    depths: dict[str, list[int]] = {"a": [], "b": []}
    while core.has_work():
        for u in core.step():
            tokens[u.request_id] += u.new_token_ids
            depths[u.request_id] += u.new_exit_depths
    core.kv.check_no_leaks()
    core.shutdown()
    assert tokens == {"a": [10, 11, 12, 13], "b": [63, 0, 1]}
    assert depths == {"a": [3, 3, 3, 3], "b": [3, 3, 3]}


def test_model_cpu_time_is_counted_only_for_the_benchmark():
    """An engine times its model calls by the wall clock alone (the thread's CPU clock is a
    system call each way); the benchmark's cells also count their CPU time, which it leaves
    out of the runner's host work."""
    core = EngineCore(
        EngineConfig.from_flat(model="stand-in", device="cpu", num_blocks=64),
        model=StandInModel(vocab_size=64),
    )
    core.add_request("a", [5, 9], SamplingParams(temperature=0.0, max_tokens=3, exit_threshold=0.8))
    while core.has_work():
        core.step()
    runner = core.runner
    assert runner.count_model_cpu is False
    assert runner.model_seconds > 0 and runner.model_cpu_seconds == 0
    core.shutdown()
    cell = _Cell(StandInModel(), 2, 16)
    assert cell.core.runner.count_model_cpu is True
    assert cell.core.runner.model_cpu_seconds > 0  # (reaching the context ran model calls)
    cell.core.shutdown()


def test_ab_script_compares_two_checkouts_by_pairwise_ratios():
    """scripts/bench_host_ab.py: one process per checkout and pair; its report has every
    phase's medians and ratios (here the checkout against itself)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = ["--rows", "4", "--context", "64", "--pairs", "1", "--warmup", "2", "--steps", "4"]
    args += ["--temperature", "1.0"]  # (sampled decode rows, as a rollout's)
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "bench_host_ab.py"), "--base", str(root)]
        + ["--new", str(root), "--kind", "mixed", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    report = orjson.loads(out.stdout)
    assert report["cell"] == "mixed/sync/rows4/ctx64" and report["pairs"] == 1
    assert report["sampling"] == {"temperature": 1.0}
    for phase in PHASES:
        entry = report[f"{phase}_cpu_ms"]
        assert entry["base_median"] > 0 and entry["new_median"] > 0
        assert len(entry["ratios"]) == 1 and entry["new_over_base_median"] > 0


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (callgrind)")
def test_ab_script_counts_instructions_per_step():
    """``--instructions --cache-sim``: the checkout against itself counts the same instructions
    and estimated cycles per step (callgrind is deterministic to well under a percent)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = ["--rows", "4", "--context", "32", "--warmup", "2", "--steps", "4"]
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "bench_host_ab.py"), "--base", str(root)]
        + ["--new", str(root), "--instructions", "--cache-sim", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    report = orjson.loads(out.stdout)
    assert report["cell"] == "decode/sync/rows4/ctx32" and report["steps"] == 4
    for figure in ("instructions", "cycles_estimate"):
        counts = report[f"{figure}_per_step"]
        assert counts["base"] > 0 and counts["new"] > 0
        assert abs(report[f"{figure}_new_over_base"] - 1) < 0.02
    assert report["cycles_estimate_per_step"]["new"] > report["instructions_per_step"]["new"]


def test_targets_are_met_at_their_limits():
    from rltserve.bench.host import _targets

    cells = {
        "decode/sync/rows256/ctx1024": {"host_wall_ms": 1.0, "steps_per_s": 1000.0},
        "decode/sync/rows512/ctx1024": {"host_wall_ms": 2.5},
        "mixed/sync/rows256/ctx1024": {"host_wall_ms": 1.5},
    }
    assert _targets(cells) == {
        "decode/sync/rows256/ctx1024": {"host_wall_ms": 1.0, "limit": 1.0, "met": True},
        "decode/sync/rows512/ctx1024": {"host_wall_ms": 2.5, "limit": 2.0, "met": False},
        "mixed/sync/rows256/ctx1024": {"host_wall_ms": 1.5, "limit": 1.5, "met": True},
        "decode/sync/rows256/ctx1024/steps_per_s": {"value": 1000.0, "limit": 1000, "met": True},
    }


def test_repeats_merge_into_medians():
    from rltserve.bench.host import _median

    runs = [{"steps_per_s": 10.0, "gc_ms": 0.5}, {"steps_per_s": 40.0, "gc_ms": 0.1},
            {"steps_per_s": 20.0, "gc_ms": 0.2}]  # fmt: skip
    assert _median(runs) == {"steps_per_s": 20.0, "gc_ms": 0.2}


def test_sampled_rows_as_a_rollouts(capsys):
    """``--temperature`` / ``--repetition-penalty``: the decode requests sample from their own
    generators and are penalized (the report says so); the probe stays greedy."""
    cell = _Cell(StandInModel(), 2, 16, sampling={"temperature": 1.0, "repetition_penalty": 1.1})
    params = [r.params for r in cell.core.scheduler.running]
    assert [(p.temperature, p.repetition_penalty) for p in params] == [(1.0, 1.1)] * 2
    assert cell.probe.temperature == 0.0
    cell.core.shutdown()
    argv = ["bench", "host", "--quick", "--quiet", "--modes", "sync", "--kinds", "decode"]
    assert main([*argv, "--temperature", "1.0", "--repetition-penalty", "1.1"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert report["sampling"] == {"temperature": 1.0, "repetition_penalty": 1.1}
    assert all(c["steps_per_s"] > 0 for c in report["cells"].values())
    assert main([*argv, "--temperature", "-1"]) == 2  # SamplingParams' own check
