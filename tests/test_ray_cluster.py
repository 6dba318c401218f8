"""``cluster_gone``: whether the Ray cluster's GCS has stopped accepting connections, now or
within a watch window (a stop signal sent to the whole process group reaches Ray's daemons a
moment after the server sees it). Checked against local sockets; skipped without Ray."""

from __future__ import annotations

import socket
import threading
import types

import pytest

ray = pytest.importorskip("ray")

from rltserve.ray.cluster import cluster_gone  # noqa: E402


@pytest.fixture
def gcs(monkeypatch):
    """A listening socket posing as the GCS; ``ray.get_runtime_context()`` reports it."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    context = types.SimpleNamespace(gcs_address=address)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    yield listener
    listener.close()


def test_a_listening_gcs_is_not_gone(gcs):
    assert not cluster_gone()
    assert not cluster_gone(watch_s=0.3)  # watched, and it kept answering


def test_a_closed_gcs_is_gone(gcs):
    gcs.close()
    assert cluster_gone()


def test_a_gcs_that_closes_within_the_watch_is_gone(gcs):
    threading.Timer(0.3, gcs.close).start()
    assert not cluster_gone()  # not yet
    assert cluster_gone(watch_s=5.0)


def test_an_address_it_cannot_check_counts_as_answering(monkeypatch):
    def no_context():
        raise RuntimeError("Ray Client mode")

    monkeypatch.setattr(ray, "get_runtime_context", no_context)
    assert not cluster_gone(watch_s=0.2)
    context = types.SimpleNamespace(gcs_address=None)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    assert not cluster_gone()


def test_a_local_cluster_starts_even_beside_one_started_with_ray_start(tmp_path):
    # ray.init() would join a cluster `ray start` runs on this host (and then refuse the
    # num_cpus it is given): `serve --replicas N` without an address must start its own.
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    ray_cli = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    # --block, in its own process group: stopped below without `ray stop`, which would stop
    # every Ray cluster on the host.
    head = subprocess.Popen(
        [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=1", "--block"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    current = Path("/tmp/ray/ray_current_cluster")  # where ray.init looks for a cluster
    deadline = time.monotonic() + 120
    while f":{port}" not in (current.read_text() if current.is_file() else ""):
        assert head.poll() is None and time.monotonic() < deadline, "ray start failed"
        time.sleep(0.2)
    try:
        script = (
            "import ray\n"
            "from rltserve.ray.cluster import connect\n"
            "from rltserve.ray.config import ReplicaConfig\n"
            "owned = connect(ReplicaConfig(replicas=1))\n"
            "print(owned, ray.get_runtime_context().gcs_address)\n"
            "ray.shutdown()\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        owned, address = out.stdout.split()[-2:]
        assert owned == "True" and not address.endswith(f":{port}"), out.stdout
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # (its daemons share its group)
        head.wait(60)
        if current.is_file() and f":{port}" in current.read_text():
            current.unlink()  # (as `ray stop` does: later ray.init calls must not look for it)
