"""scripts/bench_serve.sh with stand-ins for ``rltserve`` and ``curl``: what it runs against
its one server (no model, no server)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Logs each call's arguments; ``serve`` stays up until the script stops it, as the real one.
FAKE_RLTSERVE = """#!/usr/bin/env bash
echo "$*" >>"$CALLS"
[ "$1" = serve ] && exec sleep 60
echo '{}'
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_serving_run_sends_prompts_of_its_own_seed(tmp_path):
    bin_dir, model = tmp_path / "bin", tmp_path / "model"
    bin_dir.mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    for name, text in (("rltserve", FAKE_RLTSERVE), ("curl", "#!/usr/bin/env bash\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "MODEL": str(model),
        "CALLS": str(calls),
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "bench_serve.sh"), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    runs = [
        line.split() for line in calls.read_text().splitlines() if line.startswith("bench serve")
    ]
    assert len(runs) == 4  # concurrency 32, then rates 2, 4 and 8
    seeds = [argv[argv.index("--seed") + 1] for argv in runs]
    # One server holds every run's prompts in its prefix cache: a seed used twice would be warm.
    assert len(set(seeds)) == len(seeds)
    # The recorded figures are of fixed-length outputs: every run asks for them.
    assert all("--ignore-eos" in argv for argv in runs)
