"""scripts/gpu_check.sh end to end on the CPU (DEVICE=cpu, ouro-tiny): the one-shot GPU check
only gets to run when a GPU is at hand, so its plumbing is kept working here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from script_util import load_script

REPO = Path(__file__).resolve().parents[1]


def _count_gpu_tests() -> int:
    """How many gpu-marked tests pytest collects (they all skip without CUDA)."""
    modules = [
        str(p) for p in sorted((REPO / "tests").glob("test_*.py")) if "mark.gpu" in p.read_text()
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "--collect-only",
            "-o",
            "addopts=",
            "-q",
            "-p",
            "no:cacheprovider",
            *modules,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    return sum(1 for line in proc.stdout.splitlines() if "::" in line)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_cpu_smoke_run_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    # SMOKE=1: DEVICE=cpu, ouro-tiny for both models (made once, in MODEL_DIR), concurrency 2,
    # 8 prompts of 8 tokens, 4 out; KV pressure on 8 requests, rollout 1 step of 1 prompt x 2,
    # host path at 256 rows, 1k context, 4 steps.
    env = {
        **os.environ,
        "SMOKE": "1",
        "MODEL_DIR": str(tmp_path / "model"),
        "PYTHON": sys.executable,
        "OUT": str(out),
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    runs = {(r["concurrency"], r["mode"], r["exit_threshold"]): r for r in summary["runs"]}
    assert set(runs) == {(2, "eager", 0.55), (2, "eager", 1.0)}
    assert all(r["tokens_per_s"] > 0 for r in runs.values())
    assert runs[(2, "eager", 1.0)]["mean_exit_depth"] == 4.0
    assert summary["graphs_compare"]["note"].startswith("device=cpu")
    assert set(summary["async_compare"]) == {"2"}
    # On a CPU every gpu test skips: reported as such, never as "ok".
    match = re.search(r"\n  SKIPPED  pytest -m gpu: 0 passed, all (\d+) skipped", proc.stdout)
    assert match and int(match.group(1)) == _count_gpu_tests(), proc.stdout
    assert "ok       pytest -m gpu" not in proc.stdout and "FAILED" not in proc.stdout
    text = (out / "summary.txt").read_text()
    assert text.startswith("native backend:")
    _assert_targets(summary, text)


def _assert_targets(summary: dict, text: str) -> None:
    """The target steps ran and their checks hold numbers, each with its line in the text."""
    assert summary["targets_setup"] == {"device": "cpu", "preset": "ouro-tiny", "dtype": "float32"}
    checks = {c["target"]: c for c in summary["targets"]}
    kv = summary["kv_pressure"]
    # Pool for 8 // 8 = 1 worst-case request, 8 requests: full reservation runs one at a time.
    assert (kv["pool_requests"], kv["num_requests"], kv["full"]["peak_running"]) == (1, 8, 1)
    assert kv["repeats"] == 2 and len(kv["unpressured"]["output_tokens_per_s_runs"]) == 2
    assert "  kv times: medians of 2 runs of each case, in rounds\n" in text
    # The runs with a pad budget.
    pad = summary["kv_pressure_pad_budget"]
    assert (pad["repeats"], pad["attention_pad_budget"]) == (1, 262144)
    assert kv["attention_pad_budget"] == 0 and len(pad["sweep"]) == len(kv["sweep"])
    assert "kv pressure, attention pad budget 0 vs 262144 (tok/s; loss vs unpressured):" in text
    for mode in ("recompute", "swap"):
        running = checks[f"kv {mode} vs full: peak running requests"]
        assert running["measured"] == kv[f"ondemand_{mode}"]["peak_running"] > 1
        assert running["limit"] == 4.0 and running["met"] == (running["measured"] >= 4.0)
        tokens = checks[f"kv {mode} vs full: tokens/s"]
        assert tokens["measured"] > 0 and tokens["limit"] == 2.0
        lost = checks[f"kv {mode} vs unpressured: tokens/s lost"]
        assert lost["measured"] < 1 and lost["limit"] == 0.3
    rollout = checks["rollout restart vs in place: step time"]
    assert rollout["measured"] == summary["rollout"]["step_speedup"] > 0
    assert rollout["limit"] == 3.0 and rollout["met"] == (rollout["measured"] >= 3.0)
    assert summary["rollout"]["in_place"]["tokens_per_step"] == 1 * 2 * 2
    cells = summary["host"]["cells"]
    kinds, modes = ("decode", "mixed"), ("sync", "async")
    assert set(cells) == {f"{k}/{m}/rows256/ctx1024" for k in kinds for m in modes}
    wall = checks["host decode/sync/rows256/ctx1024: wall per step"]
    assert wall["measured"] == cells["decode/sync/rows256/ctx1024"]["host_wall_ms"]
    assert (wall["limit"], wall["op"]) == (1.0, "<=")
    assert checks["host decode/sync/rows256/ctx1024: steps/s"]["measured"] > 0
    assert checks["host mixed/sync/rows256/ctx1024: wall per step"]["measured"] > 0
    fuzz = checks["fuzz_oracle on the device: failing cases"]
    assert (
        summary["fuzz_oracle"]["counts"]["cases"] == 3 and summary["fuzz_oracle"]["device"] == "cpu"
    )
    assert fuzz["measured"] == 0 and fuzz["met"] is True
    # 512 rows did not run: its target is listed as such, not dropped.
    missing = checks.pop("host decode/sync/rows512/ctx1024: wall per step")
    assert missing["measured"] is None and missing["met"] is None
    assert re.search(r"  host decode/sync/rows512/ctx1024: wall per step +not measured ", text)
    for c in checks.values():
        assert isinstance(c["measured"], float | int) and isinstance(c["met"], bool), c
        met = "yes" if c["met"] else "no"
        assert re.search(rf"  {re.escape(c['target'])} .* met {met}", text), (c, text)


def test_summary_of_a_run_whose_steps_left_no_reports(tmp_path):
    # Every step failed, timed out or was skipped (no JSON, or an empty file): the summary is
    # still written, with every target listed as not measured rather than dropped.
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "kv_pressure.json").write_text("")  # a step killed before it printed
    args = [str(work), str(out), "cuda", "ouro-small", "float32"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check_summary.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kv_pressure"] is None and summary["rollout"] is None
    assert summary["host"] is None
    targets = summary["targets"]
    assert len(targets) == 6 + 1 + 4 + 1  # kv: 3 per preemption mode; rollout; host; fuzz
    assert all(t["measured"] is None and t["met"] is None for t in targets)
    text = (out / "summary.txt").read_text()
    assert text.startswith("native backend: not built\n")
    assert text.count("not measured") == len(targets)
    assert "rollout restart vs in place: step time" in text


def _kv_report(rate: float, rows: list[tuple[int, str, int, float]], budget: int = 0) -> dict:
    """A KV pressure report with an unpressured run at ``rate`` tok/s and sweep rows
    ``(pool, mode, slice, tok/s)``, at attention pad budget ``budget``; the unpressured run's
    steps are 80 decode and 11 chunk steps of 9.0 and 17.0 ms (plus the budget / 2^20)."""
    extra = budget / (1 << 20)
    free = {
        "output_tokens_per_s": rate,
        "ms_per_step": 10.0,
        "step_kinds": {
            "decode": {"steps": 80, "ms_per_step": 9.0 + extra, "model_ms_per_step": 7.0},
            "chunks": {"steps": 11, "ms_per_step": 17.0 + extra, "model_ms_per_step": 14.0},
        },
    }
    sweep = [
        {
            "pool_blocks": pool,
            "pool_fraction": pool / 512,
            "preemption_mode": mode,
            "preemption_time_slice": q,
            "output_tokens_per_s": r,
            "loss_vs_unpressured": round(1 - r / rate, 3),
            "ms_per_step": 12.0,
        }
        for pool, mode, q, r in rows
    ]
    return {"kv_pressure": {"unpressured": free, "sweep": sweep, "attention_pad_budget": budget}}


def test_summary_compares_kv_runs_without_and_with_a_pad_budget(tmp_path):
    summary_module = load_script("gpu_check_summary")
    pad_budget_lines = summary_module.pad_budget_lines
    no_pad = _kv_report(1000.0, [(288, "recompute", 8, 700.0), (288, "swap", 8, 800.0)])
    pad = _kv_report(900.0, [(288, "swap", 8, 600.0), (288, "recompute", 8, 450.0)], 262144)
    lines = pad_budget_lines(no_pad["kv_pressure"], pad["kv_pressure"])
    assert lines[0].startswith("kv pressure, attention pad budget 0 vs 262144 (tok/s;")
    assert "1000.0 vs 900.0 tok/s" in lines[1]
    # Each kind of step against itself: where a budget pays (chunk steps) or costs (decode).
    assert lines[1].endswith("; ms/step decode 9.0 vs 9.25, chunks 17.0 vs 17.25")
    assert summary_module.kinds_text(no_pad["kv_pressure"]["unpressured"]) == (
        "; decode 9.0 ms (80), chunks 17.0 ms (11)"
    )
    assert summary_module.kinds_text({}) == ""
    # Rows pair by (pool, mode, slice), whatever their order.
    assert "56% recompute slice  8: 700.0 vs 450.0 tok/s, lost 30% vs 50%" in lines[2]
    assert "56% swap      slice  8: 800.0 vs 600.0 tok/s, lost 20% vs 33%" in lines[3]
    assert pad_budget_lines(no_pad["kv_pressure"], None) == []
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "kv_pressure_pad.json").write_text(json.dumps(pad))
    args = [str(work), str(out), "cuda", "ouro-small", "float32"]
    script = str(REPO / "scripts" / "gpu_check_summary.py")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kv_pressure_pad_budget"] == pad["kv_pressure"]


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["work-only"], 2)])
def test_the_summary_states_its_usage(args, code):
    script = str(REPO / "scripts" / "gpu_check_summary.py")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    assert proc.returncode == code
    assert "Usage: gpu_check_summary.py WORK OUT DEVICE SMALL_PRESET SMALL_DTYPE" in proc.stderr
