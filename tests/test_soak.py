"""A 30-second soak (scripts/soak.py) against a real ``rltserve serve`` on the tiny checkpoint:
mixed streaming and non-streaming completions and chats, cut streams, bursts beyond the
admission limit. Passing means no 5xx, nothing lost or stuck, the engine idle and its KV pool
empty at the end, RSS growth after warm-up under 10%, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.soak
def test_thirty_second_soak(tmp_path_factory):
    from test_http_harness import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path_factory)
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes", "0.5"]
    cmd += ["--concurrency", "12", "--max-concurrent", "8", "--max-queued", "4"]
    cmd += ["--model", str(ckpt)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    report = json.loads(done.stdout)
    assert report["passed"], (report, done.stderr[-3000:])
    assert done.returncode == 0
    assert report["errors"] == {} and report["requests_served"] > 0
    assert report["streams_cut"] > 0 and report["rejected_503"] > 0  # both paths were taken
    assert report["engine_at_end"] == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
    }
    assert report["rss_growth"] < 0.10 and report["server_exit_code"] == 0
