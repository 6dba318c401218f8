"""Joining or starting the Ray cluster the replicas run on.

Every failure here is the user's to fix (Ray missing, an address nobody answers), so it is a
``ValueError`` naming the flag: the CLI prints one line and exits with code 2.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from pathlib import Path

from rltserve.ray.config import ReplicaConfig

log = logging.getLogger("rltserve.ray")
INSTALL_HINT = "pip install 'rltserve[ray]'"


def require_ray(flag: str = "--replicas"):
    """The ``ray`` module, or a ValueError saying how to install it."""
    try:
        import ray
        from ray import serve  # noqa: F401 - the serve extra is what the replicas need
    except ImportError as exc:
        raise ValueError(
            f"{flag}: Ray Serve is not installed ({exc.name}); {INSTALL_HINT}"
        ) from exc
    return ray


def check_affinity(config: ReplicaConfig) -> None:
    """Session affinity needs Serve's consistent-hash router (Ray 2.60 has it)."""
    if config.replica_affinity != "session":
        return
    try:
        import ray.serve.experimental.consistent_hash_router  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            "--replica-affinity session: this Ray Serve has no consistent-hash router "
            "(ray.serve.experimental.consistent_hash_router); upgrade Ray or use 'none'"
        ) from exc


def check_reachable(address: str, timeout_s: float = 5.0, flag: str = "--ray-address") -> None:
    """A ``host:port`` (or ``ray://host:port``) address accepts TCP connections: Ray itself
    retries an unreachable address for minutes. ``auto`` is Ray's to resolve."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{flag} {address}: expected host:port, ray://host:port or auto")
    why = _refused(host, int(port), timeout_s)
    if why is not None:
        raise ValueError(f"{flag} {address}: cannot reach {host}:{port} ({why})")


def _refused(host: str, port: int, timeout_s: float) -> str | None:
    """Why ``host:port`` does not accept a TCP connection, or None when it does."""
    try:
        socket.create_connection((host.strip("[]"), port), timeout=timeout_s).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def cluster_gone(watch_s: float = 0.0) -> bool:
    """Whether the Ray cluster this process is connected to has stopped answering: its GCS
    refuses connections now or, with ``watch_s``, at some point within that many seconds.

    A stop signal sent to the whole process group or cgroup (``kill -- -PGID``, systemd's
    stop) reaches a local cluster's daemons along with the server, and they stop within a
    moment of the server seeing it; any Serve call then waits for them until Ray aborts the
    process (60 s), so callers that find the cluster gone leave Serve alone."""
    import ray

    try:
        host, _, port = str(ray.get_runtime_context().gcs_address).rpartition(":")
    except Exception:  # noqa: BLE001 - e.g. Ray Client mode: no address to check
        host, port = "", ""
    if not host or not port.isdigit():
        return False  # nothing this can check: assume it answers, as before
    deadline = time.monotonic() + watch_s
    while _refused(host, int(port), timeout_s=1.0) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def ray_address(config: ReplicaConfig) -> tuple[str | None, str]:
    """The cluster to join and what named it: ``--ray-address``, else Ray's own ``RAY_ADDRESS``
    environment variable; (None, "") to start a local cluster."""
    if config.ray_address is not None:
        return config.ray_address, "--ray-address"
    env = os.environ.get("RAY_ADDRESS", "").strip()
    return (env, "RAY_ADDRESS") if env else (None, "")


def replica_needs(config: ReplicaConfig) -> str:
    """What the replicas ask of the cluster and what it has (for replicas not started yet)."""
    ray = require_ray()
    have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    return (
        f"{config.replicas} replica(s) of {config.replica_cpus:g} CPU and "
        f"{config.replica_gpus:g} GPU each, on a cluster of {have or 'no CPUs or GPUs'}"
    )


def connect(config: ReplicaConfig, num_cpus: float | None = None) -> bool:
    """Connects this process to Ray (no-op when connected already). Returns True when it
    started a local cluster, which the caller then owns and shuts down."""
    ray = require_ray()
    check_affinity(config)
    if ray.is_initialized():
        return False
    quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    address, flag = ray_address(config)
    if address is None:
        cpus = num_cpus if num_cpus is not None else config.replicas * config.replica_cpus
        # "local": a new cluster even where one runs on this host already (``ray start``),
        # which ray.init would otherwise join (and then refuse num_cpus); joining one takes
        # --ray-address (or RAY_ADDRESS).
        # (rounded up: 2 replicas of 0.7 CPU need 2, which 1.4 rounded down would starve)
        ray.init(address="local", num_cpus=max(1, math.ceil(cpus - 1e-9)), **quiet)
        return True
    check_reachable(address, flag=flag)
    try:
        ray.init(address=address, **quiet)
    except Exception as exc:  # ConnectionError, or Ray's own errors for a bad address
        hint = ""
        if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray/auth_token").is_file():
            hint = (
                "; a cluster started here with token authentication (~/.ray/auth_token) "
                "needs RAY_AUTH_MODE=token in this process's environment"
            )
        raise ValueError(
            f"{flag} {address}: cannot join the Ray cluster "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}){hint}"
        ) from exc
    return False
