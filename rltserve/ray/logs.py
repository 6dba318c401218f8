"""The caller's logging, handed to Ray replicas (serve's and offline ``generate``'s).

A stage worker process gets its parent's logging on its command line (``worker_process``:
``--log-config-file`` or ``--log-level``); a replica is a Ray actor, started by Ray, perhaps on
another node, so it gets the same as a constructor argument instead: the configuration of the
``--log-config-file`` as read here (the replica's node may not have the file), else the level
of this process's logging when it set one up. Without it a replica's engine warnings came out
bare (Python's last-resort output) and a log config file's handlers and formats never applied.
The replica sets it up with ``set_up_logging``, as a worker does.
"""

from __future__ import annotations

import json

from rltserve.core.stage_worker import set_up_logging
from rltserve.core.worker_process import handed_logging

LogSetup = dict | int | None  # a dictConfig configuration, a level, or nothing to set up

__all__ = ["LogSetup", "caller_logging", "set_up_logging"]


def caller_logging() -> LogSetup:
    """This process's logging as its replicas should set it up (see the module doc)."""
    setup = handed_logging()
    if not isinstance(setup, str):
        return setup
    try:
        with open(setup) as file:
            return json.load(file)
    except (OSError, ValueError) as exc:  # (the server loaded it at start: moved since?)
        raise ValueError(f"--log-config-file {setup}: {exc}") from exc
