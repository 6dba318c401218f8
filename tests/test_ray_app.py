"""Who owns the Serve app (``--ray-app``), without Ray: a fake ``ray.serve`` stands for the
cluster's Serve. A server refuses to start over a running app of its name unless told to replace
it; it deletes the app on stop only while the app holds its own deployment; one whose deployment
is gone (replaced, deleted) logs that once and answers 503 with the reason. Replicas get the
server's drain timeout and, on a CUDA engine, a GPU each."""

from __future__ import annotations

import logging
import sys
import types

import pytest

import rltserve.ray.client as client_module
from rltserve.config import EngineConfig
from rltserve.core.stage import StageError
from rltserve.ray.client import ReplicaSetClient, app_taken
from rltserve.ray.config import ReplicaConfig


def _deployment(running: int = 1):
    return types.SimpleNamespace(replica_states={"RUNNING": running}, message="")


def _app(*names: str, status: str = "RUNNING"):
    deployments = {name: _deployment() for name in names}
    return types.SimpleNamespace(status=status, message="", deployments=deployments)


class FakeServe:
    """Serve's calls the client makes, on a dict of apps (name -> status) it shares."""

    def __init__(self, apps: dict) -> None:
        self.apps, self.deployed, self.deleted, self.options = apps, [], [], None

    def start(self, **kwargs) -> None:
        pass

    def deployment(self, cls, **options):
        self.options = options
        return types.SimpleNamespace(bind=lambda *args: options["name"])

    def RunTarget(self, target, name, route_prefix, logging_config):  # noqa: N802 - Serve's
        return target, name

    def run_many(self, targets, wait_for_applications_running):
        assert wait_for_applications_running is False
        ((deployment, name),) = targets
        self.deployed.append(name)
        self.apps[name] = _app(deployment)  # (Serve replaces an app of the name)
        handle = types.SimpleNamespace(options=lambda **kwargs: "stream")
        return [handle]

    def status(self):
        return types.SimpleNamespace(applications=dict(self.apps))

    def delete(self, name: str) -> None:
        self.deleted.append(name)
        self.apps.pop(name, None)


@pytest.fixture
def serve(monkeypatch):
    """A fake ``ray.serve`` (Ray itself need not be installed) with no app running."""
    fake = FakeServe({})
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(serve=fake))
    monkeypatch.setattr(client_module, "require_ray", lambda: None)
    monkeypatch.setattr(client_module, "connect", lambda config: False)  # a joined cluster
    monkeypatch.setattr(client_module, "cluster_gone", lambda watch_s: False)
    monkeypatch.setattr(client_module, "_POLL_S", 0.001)
    return fake


def _start(device: str = "cpu", drain_timeout_s: float = 10.0, **replica) -> ReplicaSetClient:
    config = ReplicaConfig(replicas=2, **replica)
    engine = EngineConfig.from_flat(model="/m", device=device)
    return ReplicaSetClient(engine, config, drain_timeout_s=drain_timeout_s)


def _other_server(serve: FakeServe, name: str = "rltserve") -> None:
    serve.apps[name] = _app("rltserve-engine-0th3r5vr")


def test_a_server_refuses_to_start_over_a_running_app_of_its_name(serve):
    _other_server(serve)
    with pytest.raises(ValueError) as info:
        _start()
    assert (
        str(info.value)
        == app_taken(ReplicaConfig(replicas=2))
        == (
            "--ray-app rltserve: a Ray Serve app of that name is already running on the cluster "
            "(another server's, or one a killed server left); give this server its own --ray-app "
            "NAME, stop the other server, or pass --ray-replace-app to replace it"
        )
    )
    assert serve.deployed == [] and serve.deleted == []  # the other server's app is untouched
    client = _start(ray_app="second")  # (its own name: no conflict)
    client.close()
    assert serve.deleted == ["second"] and "rltserve" in serve.apps


def test_a_server_deletes_its_own_app_when_it_stops(serve):
    client = _start()
    assert serve.deployed == ["rltserve"] and client.live_replicas == 1
    client.close()
    assert serve.deleted == ["rltserve"]


def test_a_replaced_server_answers_503_saying_why_and_leaves_the_new_app(serve, caplog):
    first = _start()
    second = _start(ray_replace_app=True)  # (a restart that started the new server first)
    assert serve.deployed == ["rltserve", "rltserve"]
    for _ in range(3):  # (and the poller, meanwhile)
        first._count_live()
    reason = (
        "the Ray Serve app 'rltserve' was replaced by another deployment (a server started with "
        "--ray-app rltserve --ray-replace-app?): this server's replicas are gone and it cannot "
        "serve again; stop it, or restart it with its own --ray-app"
    )
    assert first.unavailable_reason == reason
    assert first.alive  # (not a failure to restart from: a restart would take the app back)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [reason]  # once
    assert second.unavailable_reason is None
    first.close()
    assert serve.deleted == [] and "rltserve" in serve.apps  # the second server's, kept
    second.close()
    assert serve.deleted == ["rltserve"]


def test_a_server_whose_app_was_deleted_answers_503_saying_why(serve):
    client = _start()
    del serve.apps["rltserve"]  # (`serve shutdown`, an older server's stop)
    client._count_live()
    assert client.unavailable_reason == (
        "the Ray Serve app 'rltserve' was deleted from the cluster (`serve shutdown`, or an "
        "older server's stop?): this server's replicas are gone; restart it to deploy them again"
    )
    client.close()
    assert serve.deleted == []


def test_an_app_taken_over_before_the_replicas_were_ready_fails_the_start(serve):
    client = _start()
    serve.apps["rltserve"] = _app("rltserve-engine-0th3r5vr", status="DEPLOYING")
    with pytest.raises(StageError, match="was replaced by another deployment"):
        client.wait_ready(timeout=0)
    client.close()
    assert serve.deleted == []


def test_a_deployment_serve_does_not_show_yet_is_still_the_servers_own(serve):
    client = _start()
    serve.apps["rltserve"] = _app(status="DEPLOYING")  # (deployed a moment ago)
    client._seen = False
    client._count_live()
    assert client.unavailable_reason == "no engine replica is alive (0 of 2); retry later"
    client.close()
    assert serve.deleted == ["rltserve"]  # (not left deploying on the cluster)


def test_replicas_drain_as_the_server_does_and_a_cuda_engines_get_a_gpu_each(serve):
    client = _start(device="cuda", drain_timeout_s=42.0)
    options = serve.options
    assert options["graceful_shutdown_timeout_s"] == 42.0
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert client.config.replica_gpus == 1.0
    name = options["name"]
    assert name.startswith("rltserve-engine-") and len(name) == len("rltserve-engine-") + 8
    client.close()
    other = _start()  # (each deploy its own tag)
    assert serve.options["name"] != name
    assert serve.options["ray_actor_options"]["num_gpus"] == 0.0
    other.close()
