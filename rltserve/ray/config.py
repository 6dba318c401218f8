"""Frozen configuration of a replica set on Ray Serve, validated on construction.

Imports neither Ray nor torch: ``rltserve serve`` derives its replica flags (``--replicas``,
``--ray-address``, ``--replica-cpus``, ``--replica-gpus``, ``--ray-app``, ``--ray-replace-app``,
``--replica-affinity``) from this dataclass, and ``bench offline --replicas`` its
``--replica-cpus`` and ``--replica-gpus`` (``add_resource_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from rltserve.vllm_args import device_key

AFFINITIES = ("none", "session")
RESOURCE_FIELDS = ("replica_cpus", "replica_gpus")  # (the flags ``bench offline`` shares)


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
    # None: as the engine's devices need (``for_devices``), so that ``--device cuda`` alone gives
    # each replica a GPU of its own instead of 0 (Ray would then place them all on any node and
    # leave every replica's process seeing every GPU: they would all use GPU 0).
    replica_gpus: float | None = field(
        default=None,
        metadata=_help(
            "GPUs per replica (fractions share one); default: one per CUDA device of the "
            "engine (--device, --prefill-device), 0 on CPU"
        ),
    )
    ray_app: str = field(
        default="rltserve",
        metadata=_help(
            "the Ray Serve application's name: give each server that joins one cluster its own "
            "(a server refuses to start while an app of its name runs, see --ray-replace-app)"
        ),
    )
    ray_replace_app: bool = field(
        default=False,
        metadata=_help(
            "start even when a Serve app of --ray-app's name runs on the cluster, replacing it "
            "(one left by a server that was killed); the server whose app it was then answers "
            "503 saying so and leaves this one in place when it stops"
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
        for name in RESOURCE_FIELDS:
            value = getattr(self, name)
            if value is None and name == "replica_gpus":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be a number >= 0")
        if self.replica_affinity not in AFFINITIES:
            raise ValueError(
                f"--replica-affinity {self.replica_affinity}: must be one of {AFFINITIES}"
            )
        if not isinstance(self.ray_app, str) or not self.ray_app.strip():
            raise ValueError(f"--ray-app {self.ray_app!r}: must not be empty")
        if not isinstance(self.ray_replace_app, bool):
            raise ValueError(f"--ray-replace-app {self.ray_replace_app!r}: must be a bool")
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

    def for_devices(self, devices: Iterable[str | None]) -> ReplicaConfig:
        """This config with ``replica_gpus`` set for an engine on ``devices`` (its ``--device``
        and ``--prefill-device``; None: not used): when not given, one GPU per distinct CUDA
        device (``cuda`` is ``cuda:0``: Ray shows a replica its own GPUs only, from index 0),
        else 0. A replica on CUDA with 0 GPUs is refused: Ray would place it without a GPU
        and leave it every GPU of its node to pick from, so replicas pile up on GPU 0."""
        cuda = {"{}:{}".format(*device_key(d)) for d in devices if d and d.startswith("cuda")}
        if self.replica_gpus is None:
            return dataclasses.replace(self, replica_gpus=float(len(cuda)))
        if cuda and self.replica_gpus == 0:
            raise ValueError(
                f"--replica-gpus 0: the engine runs on CUDA ({', '.join(sorted(cuda))}), so each "
                "replica needs GPUs from Ray; leave --replica-gpus out (one per CUDA device) "
                "or give a share (0.5: two replicas per GPU)"
            )
        return self


def add_resource_args(parser: argparse.ArgumentParser) -> None:
    """``--replica-cpus`` and ``--replica-gpus`` as ``ReplicaConfig`` defines them, for
    ``bench offline --replicas`` (whose other replica flags are its own); None when not given,
    so that ``resource_kwargs`` passes only what was set (and ``ReplicaConfig`` refuses them
    without ``--replicas``)."""
    for f in fields(ReplicaConfig):
        if f.name in RESOURCE_FIELDS:
            default = "" if f.default is None else f" (default: {f.default:g})"
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                type=float,
                default=None,
                help=f.metadata["help"] + default,
            )


def resource_kwargs(args: argparse.Namespace) -> dict:
    """The ``add_resource_args`` flags that were given."""
    return {n: getattr(args, n) for n in RESOURCE_FIELDS if getattr(args, n, None) is not None}
