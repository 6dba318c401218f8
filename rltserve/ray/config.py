"""Frozen configuration of a replica set on Ray Serve, validated on construction.

Imports neither Ray nor torch: ``rltserve serve`` derives its ``--replicas``, ``--ray-address``,
``--replica-cpus``, ``--replica-gpus`` and ``--replica-affinity`` flags from this dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

AFFINITIES = ("none", "session")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class ReplicaConfig:
    replicas: int | None = field(
        default=None,
        metadata=_help(
            "serve N engine replicas as a Ray Serve deployment (needs the 'ray' extra); "
            "without it the server runs one stage process"
        ),
    )
    ray_address: str | None = field(
        default=None,
        metadata=_help(
            "Ray cluster to join ('auto': the one started with 'ray start' on this node); "
            "default: RAY_ADDRESS when set, else start a local cluster and stop it on shutdown"
        ),
    )
    replica_cpus: float = field(
        default=1.0, metadata=_help("CPUs per replica (also its torch threads)")
    )
    replica_gpus: float = field(default=0.0, metadata=_help("GPUs per replica"))
    ray_app: str = field(
        default="rltserve",
        metadata=_help(
            "the Ray Serve application's name: give each server that joins one cluster its own "
            "(a server replaces an app of its name)"
        ),
    )
    replica_affinity: str = field(
        default="none",
        metadata=_help(
            "'session': requests with the same X-Session-Id header (or 'user' field) go to the "
            "same replica (consistent hashing); 'none': Ray Serve's load-aware choice"
        ),
    )

    def __post_init__(self) -> None:
        n = self.replicas
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"--replicas {n}: must be an int >= 1")
        for name in ("replica_cpus", "replica_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be a number >= 0")
        if self.replica_affinity not in AFFINITIES:
            raise ValueError(
                f"--replica-affinity {self.replica_affinity}: must be one of {AFFINITIES}"
            )
        if not isinstance(self.ray_app, str) or not self.ray_app.strip():
            raise ValueError(f"--ray-app {self.ray_app!r}: must not be empty")
        if self.ray_address is not None and not self.ray_address.strip():
            raise ValueError(f"--ray-address {self.ray_address!r}: must not be empty")
        if n is None:  # (they would be ignored: say so instead)
            given = [
                "--" + f.name.replace("_", "-")
                for f in fields(self)
                if f.name != "replicas" and getattr(self, f.name) != f.default
            ]
            if given:
                raise ValueError(f"{', '.join(given)}: only with --replicas N")

    @property
    def enabled(self) -> bool:
        return self.replicas is not None

    @property
    def threads(self) -> int:
        """torch threads of one replica."""
        return max(1, int(self.replica_cpus))
