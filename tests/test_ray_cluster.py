"""``cluster_gone``: whether the Ray cluster's GCS has stopped accepting connections, now or
within a watch window (a stop signal sent to the whole process group reaches Ray's daemons a
moment after the server sees it). Checked against local sockets; skipped without Ray."""

from __future__ import annotations

import socket
import threading
import types
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rltserve.ray.cluster import (  # noqa: E402
    check_affinity,
    check_reachable,
    cluster_gone,
    connect,
    ray_address,
    require_ray,
)
from rltserve.ray.config import ReplicaConfig  # noqa: E402


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


def test_an_address_with_no_port_number_counts_as_answering(monkeypatch):
    context = types.SimpleNamespace(gcs_address="127.0.0.1:gcs")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    assert not cluster_gone()


# ---------------------------------------------------------------- the address to join


def test_a_listening_address_is_reachable_in_each_spelling(gcs):
    port = gcs.getsockname()[1]
    check_reachable(f"127.0.0.1:{port}")
    check_reachable(f"ray://127.0.0.1:{port}")
    check_reachable("auto")  # (Ray resolves it: nothing to check here)


def test_an_ipv6_address_is_checked_without_its_brackets():
    try:
        listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback")
    with listener:
        check_reachable(f"[::1]:{listener.getsockname()[1]}")


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:port", ":6379"])
def test_an_address_without_host_and_port_is_refused(address):
    with pytest.raises(ValueError, match="expected host:port, ray://host:port or auto"):
        check_reachable(address, flag="RAY_ADDRESS")


def test_an_unreachable_address_says_why(gcs):
    address = f"127.0.0.1:{gcs.getsockname()[1]}"
    gcs.close()
    with pytest.raises(ValueError) as info:
        check_reachable(address)
    assert str(info.value) == (
        f"--ray-address {address}: cannot reach {address} (Connection refused)"
    )


def test_the_flag_overrides_ray_address_and_a_blank_one_is_unset(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(ReplicaConfig(replicas=1)) == ("10.0.0.1:6379", "RAY_ADDRESS")
    given = ReplicaConfig(replicas=1, ray_address="auto")
    assert ray_address(given) == ("auto", "--ray-address")
    monkeypatch.setenv("RAY_ADDRESS", "  ")
    assert ray_address(ReplicaConfig(replicas=1)) == (None, "")


def test_session_affinity_needs_the_consistent_hash_router(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray.serve.experimental.consistent_hash_router", None)
    check_affinity(ReplicaConfig(replicas=1))  # 'none' does not need it
    with pytest.raises(ValueError, match="--replica-affinity session: this Ray Serve has no"):
        check_affinity(ReplicaConfig(replicas=1, replica_affinity="session"))


class FakeInit:
    """``ray.init`` and ``ray.is_initialized``: records the calls, raises ``error`` if given."""

    def __init__(self, monkeypatch, initialized=False, error: Exception | None = None) -> None:
        self.calls: list[dict] = []
        self.error = error
        monkeypatch.setattr(ray, "is_initialized", lambda: initialized)
        monkeypatch.setattr(ray, "init", self)

    def __call__(self, **kwargs) -> None:
        self.calls.append(kwargs)
        if self.error is not None:
            raise self.error


def test_connecting_when_connected_already_owns_nothing(monkeypatch):
    init = FakeInit(monkeypatch, initialized=True)
    assert connect(ReplicaConfig(replicas=2)) is False
    assert init.calls == []


def test_a_local_cluster_has_the_cpus_of_every_replica(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init = FakeInit(monkeypatch)
    assert connect(ReplicaConfig(replicas=3, replica_cpus=1.5)) is True  # started: owned
    assert [(c["address"], c["num_cpus"]) for c in init.calls] == [("local", 5)]  # 4.5 up
    assert connect(ReplicaConfig(replicas=2, replica_cpus=0.7)) is True
    assert init.calls[-1]["num_cpus"] == 2  # (1.4 rounded down would place one replica)
    assert connect(ReplicaConfig(replicas=3, replica_cpus=0.1)) is True
    assert init.calls[-1]["num_cpus"] == 1  # (0.30000000000000004: not 2)
    assert connect(ReplicaConfig(replicas=3), num_cpus=0.2) is True
    assert init.calls[-1]["num_cpus"] == 1  # (at least one)


def test_a_joined_cluster_is_not_owned(monkeypatch, gcs):
    address = f"127.0.0.1:{gcs.getsockname()[1]}"
    init = FakeInit(monkeypatch)
    assert connect(ReplicaConfig(replicas=2, ray_address=address)) is False
    assert [c["address"] for c in init.calls] == [address]


def test_a_cluster_that_refuses_to_be_joined_is_a_usage_error(monkeypatch, gcs, tmp_path):
    address = f"127.0.0.1:{gcs.getsockname()[1]}"
    FakeInit(monkeypatch, error=ConnectionError("auth failed\ndetails"))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(Path, "home", lambda: tmp_path)
    config = ReplicaConfig(replicas=1, ray_address=address)
    with pytest.raises(ValueError) as info:
        connect(config)
    assert str(info.value) == (
        f"--ray-address {address}: cannot join the Ray cluster (ConnectionError: auth failed)"
    )
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray/auth_token").write_text("secret")
    with pytest.raises(ValueError, match="needs RAY_AUTH_MODE=token in this process's env"):
        connect(config)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # set already: the hint would mislead
    with pytest.raises(ValueError) as info:
        connect(config)
    assert "RAY_AUTH_MODE" not in str(info.value)


def test_ray_without_its_serve_extra_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.delattr(ray, "serve", raising=False)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    with pytest.raises(ValueError) as info:
        require_ray("--replicas")
    assert str(info.value) == (
        "--replicas: Ray Serve is not installed (ray.serve); pip install 'rltserve[ray]'"
    )
