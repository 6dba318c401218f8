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
