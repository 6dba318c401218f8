"""``ReplicaSetClient``'s pure parts, without Ray: the replicas' stats summed into one, what a
failed deployment says, the logging the replicas get."""

from __future__ import annotations

import dataclasses

import pytest

from rltserve.core.engine_info import EngineStats, sum_stats
from rltserve.ray.client import _refusal


def _stats(**values) -> EngineStats:
    zeros = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{**zeros, "step_rows_counts": (), **values})


def test_counters_and_histograms_sum_gauges_of_dead_replicas_do_not():
    a = _stats(num_running=2, kv_usage=0.5, num_steps=3, step_rows_counts=(1, 2, 0))
    b = _stats(num_running=1, kv_usage=0.1, num_steps=1, step_rows_counts=(0, 0, 1))
    retired = _stats(num_running=7, num_steps=5, step_rows_counts=(5, 0, 0))
    total = sum_stats([a, b], retired)
    assert total.num_running == 3  # a gauge: the dead replica's is gone
    assert total.num_steps == 9 and total.step_rows_counts == (6, 2, 1)
    assert abs(total.kv_usage - 0.3) < 1e-9
    assert sum_stats([_stats()]).step_rows_counts == ()  # none reported yet
    assert sum_stats([]) is None


def test_a_failed_deployment_says_whether_the_engine_refused_its_config():
    # (the engine's message may hold "; " itself: it is taken whole)
    refused = "rltserve.core.stage.StageConfigError: max_model_len=9: too long; lower it"
    lines = ["Failed to update the deployments ['d'].", refused]
    assert _refusal(lines) == "max_model_len=9: too long; lower it"
    assert _refusal(["Failed to update the deployments ['d'].", "RuntimeError: boom"]) is None
    assert _refusal([]) is None


def test_replicas_get_the_callers_log_config_as_read(tmp_path, monkeypatch):
    """``caller_logging`` hands a replica the configuration itself (its node may not have the
    file) and the level without one; a file gone since the server loaded it is a ValueError."""
    import logging

    from rltserve.core.worker_process import LOG_CONFIG_ENV
    from rltserve.ray.logs import caller_logging

    path = tmp_path / "logging.json"
    path.write_text('{"version": 1, "root": {"level": "ERROR"}}')
    monkeypatch.setenv(LOG_CONFIG_ENV, str(path))
    assert caller_logging() == {"version": 1, "root": {"level": "ERROR"}}
    path.unlink()
    with pytest.raises(ValueError, match="--log-config-file"):
        caller_logging()
    monkeypatch.delenv(LOG_CONFIG_ENV)
    root = logging.getLogger()
    handler = logging.NullHandler()
    monkeypatch.setattr(root, "level", 15)
    root.addHandler(handler)
    try:
        assert caller_logging() == 15
    finally:
        root.removeHandler(handler)
