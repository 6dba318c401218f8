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
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "PRESET": "ouro-tiny",
        "MODEL_DIR": str(tmp_path / "model"),
        "CONCURRENCY": "2",
        "ASYNC_CONCURRENCY": "2",
        "ASYNC_NUM_PROMPTS": "8",
        "INPUT_LEN": "8",
        "OUTPUT_LEN": "4",
        "KV_CACHE_GB": "0.25",
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
    assert (out / "summary.txt").read_text().startswith("native backend:")
