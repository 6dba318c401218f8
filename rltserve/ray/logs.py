"""The caller's logging, handed to Ray replicas (serve's and offline ``generate``'s).

A stage worker process gets its parent's logging on its command line (``worker_process``:
``--log-config-file`` or ``--log-level``); a replica is a Ray actor, started by Ray, perhaps on
another node, so it gets the same as a constructor argument instead: the configuration of the
``--log-config-file`` as read here (the replica's node may not have the file), else the level
of this process's logging when it set one up. Without it a replica's engine warnings came out
bare (Python's last-resort output) and a log config file's handlers and formats never applied.
"""

from __future__ import annotations

import json
import logging
import os

from rltserve.core.stage_worker import LOG_FORMAT, load_log_config
from rltserve.core.worker_process import LOG_CONFIG_ENV

LogSetup = dict | int | None  # a dictConfig configuration, a level, or nothing to set up


def caller_logging() -> LogSetup:
    """This process's logging as its replicas should set it up (see the module doc)."""
    if path := os.environ.get(LOG_CONFIG_ENV):
        try:
            with open(path) as file:
                return json.load(file)
        except (OSError, ValueError) as exc:  # (the server loaded it at start: moved since?)
            raise ValueError(f"--log-config-file {path}: {exc}") from exc
    root = logging.getLogger()
    return root.getEffectiveLevel() if root.handlers else None


def set_up_logging(setup: LogSetup) -> None:
    """In the replica's process: its logging as ``caller_logging`` described the caller's."""
    if isinstance(setup, dict):
        load_log_config(setup)
    elif setup is not None:
        logging.basicConfig(level=setup, format=LOG_FORMAT)
