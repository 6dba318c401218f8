"""The server's side of a replica set on Ray Serve: ``ReplicaSetClient``.

It speaks the stage client interface the HTTP frontend uses (``add_request`` with a sink,
``abort``, ``info``, ``stats``), so the API and SSE are those of the single-process server.
Each request becomes one streaming call through a Serve ``DeploymentHandle``
(``handle.options(stream=True)``); Serve picks the replica (load-aware by default; with
``--replica-affinity session`` by consistent hashing of the session key that ``add_request``
gets as ``session``). A task on the server's loop relays the replica's batches to the
request's sink; aborting the request cancels that call, which Serve turns into a cancellation
of the replica's generator (it aborts the request in its engine).

Failures: a replica that dies mid-request ends the call with an exception; the request then gets
one ERROR update "stage died: replica ... failed: ..." (an error event then ``[DONE]`` on a
stream). Serve's health checks replace the replica. A poller (one thread) counts live replicas
from ``serve.status()``; with none live, ``unavailable_reason`` says so and the server answers
503 with Retry-After instead of queueing into a deployment that cannot serve.

One app per name: the app (``--ray-app``) belongs to the server that deployed it, known by its
deployment's name, which carries a tag drawn at deploy time. A server refuses to start while an
app of its name runs (unless ``--ray-replace-app``), deletes the app on stop only while that
deployment is still its own, and when the poller finds its deployment gone (the app deleted, or
replaced by another server's) it logs that once and answers 503 with the reason from then on:
the replicas it knew are gone, and another server's would run another model.

Invariant: every request whose ``add_request`` returned gets exactly one final update.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable

from rltserve.config import EngineConfig
from rltserve.core.engine_info import IDLE_GAUGES, EngineInfo, EngineStats, sum_stats
from rltserve.core.stage import Sink, StageConfigError, StageError
from rltserve.ray.cluster import cluster_gone, connect, replica_needs, require_ray
from rltserve.ray.config import ReplicaConfig
from rltserve.ray.guides import GuideShipper
from rltserve.ray.logs import caller_logging
from rltserve.ray.roster import ReplicaState, Retired, serve_replica_ids
from rltserve.sampling import SamplingParams
from rltserve.updates import FinishReason, RequestUpdate

log = logging.getLogger("rltserve.ray")
APP = "rltserve"  # (the default --ray-app)
DEPLOYMENT = "rltserve-engine"
_POLL_S = 0.5
_HEALTH_PERIOD_S = 2.0
_HEALTH_TIMEOUT_S = 30.0
_SERVE_LOGGING = {"log_level": "WARNING", "enable_access_log": False}
_CONSISTENT_HASH = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


def deployment_name(config: ReplicaConfig, tag: str) -> str:
    """The deployment's name: ``tag`` (drawn per deploy) tells this server's deployment from
    another's under the same app name, which Serve's status shows by name only. (Its router is
    in it too: a process's handles keep the router they were first built with for a deployment
    name, even after it is redeployed.)"""
    router = "" if config.replica_affinity == "none" else "-session"
    return f"{DEPLOYMENT}{router}-{tag}"


def deployment_options(
    config: ReplicaConfig, max_ongoing: int, drain_timeout_s: float, name: str
) -> dict:
    """``drain_timeout_s``: how long a stopping replica (``ray drain-node``, a node's
    replacement, the app's deletion) gives its requests in flight before Serve kills it; the
    server's ``--drain-timeout-s``, so that a replica drains as the server does."""
    options = {
        "name": name,
        "num_replicas": config.replicas,
        "ray_actor_options": {"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus},
        "max_ongoing_requests": max_ongoing,
        "health_check_period_s": _HEALTH_PERIOD_S,
        "health_check_timeout_s": _HEALTH_TIMEOUT_S,
        "graceful_shutdown_timeout_s": drain_timeout_s,
    }
    if config.replica_affinity == "session":
        options["request_router_config"] = {"request_router_class": _CONSISTENT_HASH}
    return options


def _refusal(lines: list[str]) -> str | None:
    """What the replicas' engine said when it refused its config, from Serve's words on the
    failed deployment (a line naming the error's class: the rest of it is the engine's whole
    message); None for another failure."""
    name = f"{StageConfigError.__module__}.{StageConfigError.__qualname__}: "
    for line in lines:
        if line.startswith(name):
            return line[len(name) :]
    return None


def engine_devices(engine_config: EngineConfig) -> tuple[str, str | None]:
    """The devices a replica's engine runs on (its prefill stage's: None when it has none of
    its own)."""
    return engine_config.model.device, engine_config.execution.prefill_device


def app_taken(config: ReplicaConfig) -> str:
    """The refusal to deploy over a running app of this server's name."""
    return (
        f"--ray-app {config.ray_app}: a Ray Serve app of that name is already running on the "
        "cluster (another server's, or one a killed server left); give this server its own "
        "--ray-app NAME, stop the other server, or pass --ray-replace-app to replace it"
    )


class ReplicaSetClient:
    """N engine replicas behind one Ray Serve deployment (see the module doc)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        config: ReplicaConfig,
        max_ongoing: int = 256,
        owns_cluster: bool = False,
        drain_timeout_s: float = 10.0,
    ) -> None:
        """``drain_timeout_s``: the server's ``--drain-timeout-s`` (``deployment_options``)."""
        require_ray()
        from ray import serve

        from rltserve.ray.replica import EngineReplica

        self.config = config = config.for_devices(engine_devices(engine_config))
        self._deployment = deployment_name(config, uuid.uuid4().hex[:8])
        self._deployed = False  # run_many was called (the app may be this server's)
        self._seen = False  # Serve has shown this server's deployment in the app
        self._lost: str | None = None  # why the app is no longer this server's
        # Owned: started here or by the caller (the CLI connects first, to fail fast on a bad
        # address); then it stops with this client.
        self._owns_cluster = connect(config) or owns_cluster
        self._lock = threading.Lock()  # guards _tasks, _replicas, _closed and _lost
        self._tasks: dict[str, asyncio.Task] = {}
        self._replicas: dict[str, ReplicaState] = {}
        self._retired = Retired()  # counters of replicas that are gone
        self._closed = False
        self._fatal: str | None = None
        self._guides = GuideShipper()  # (compiled constraints: once per replica, not per call)
        self.info: EngineInfo | None = None
        self.live_replicas = 0
        try:
            serve.start(proxy_location="Disabled", logging_config=_SERVE_LOGGING)
            options = deployment_options(config, max_ongoing, drain_timeout_s, self._deployment)
            app = serve.deployment(EngineReplica, **options)
            target = app.bind(engine_config, config.threads, caller_logging())
            # Serve replaces an app of the same name: that app's server would go on answering
            # with its model's name and tokenizer while this one's replicas generate. (Checked,
            # then deployed: two servers starting within the same moment can both pass; the
            # one deployed last keeps the app and the other finds its deployment gone.)
            if config.ray_app in serve.status().applications:
                if not config.ray_replace_app:
                    raise ValueError(app_taken(config))
                log.warning(
                    "--ray-replace-app: replacing the Serve app %r running on the cluster; "
                    "its server (if any) answers 503 from now on",
                    config.ray_app,
                )
            # Not waiting for the replicas here: ``wait_ready`` does, so that the server's
            # startup timeout and shutdown apply (replicas that can never be scheduled leave
            # the app deploying forever) and a failure says why.
            self._deployed = True
            (self._handle,) = serve.run_many(
                [serve.RunTarget(target, config.ray_app, None, _SERVE_LOGGING)],
                wait_for_applications_running=False,
            )
        except BaseException:
            self._stop_ray()
            raise
        self._stream = self._handle.options(method_name="generate", stream=True)
        self._count_live()
        self._poller = threading.Thread(target=self._poll, name="rltserve-ray-replicas")
        self._poller.daemon = True
        self._poller.start()

    @classmethod
    def factory(
        cls,
        config: ReplicaConfig,
        max_ongoing: int = 256,
        owns_cluster: bool = False,
        drain_timeout_s: float = 10.0,
    ) -> Callable[[EngineConfig], ReplicaSetClient]:
        return lambda engine_config: cls(
            engine_config, config, max_ongoing, owns_cluster, drain_timeout_s
        )

    # ------------------------------------------------------------------ stage client API

    @property
    def alive(self) -> bool:
        return not self._closed and self._fatal is None

    @property
    def error(self) -> str | None:
        return self._fatal or ("closed" if self._closed else None)

    @property
    def self_supervised(self) -> bool:
        """Ray Serve health-checks and replaces replicas; the server's watchdog stays out."""
        return True

    @property
    def routes_by_session(self) -> bool:
        """Whether ``add_request``'s ``session`` picks the replica (``--replica-affinity
        session``); the supervisor hands the key on only then."""
        return self.config.replica_affinity == "session"

    @property
    def unavailable_reason(self) -> str | None:
        if self._lost is not None:  # (for good: restarting here would take the app back)
            return self._lost
        if self.live_replicas == 0:
            return f"no engine replica is alive (0 of {self.config.replicas}); retry later"
        return None

    @property
    def stats(self) -> EngineStats | None:
        with self._lock:
            live = [r.stats for r in self._replicas.values() if r.stats is not None]
            return sum_stats(live, self._retired.stats)

    @property
    def prefill_stats(self) -> EngineStats | None:
        """Disaggregated replicas' prefill stages' stats, summed as ``stats`` (None when no
        replica has one)."""
        with self._lock:
            live = [r.prefill_stats for r in self._replicas.values() if r.prefill_stats is not None]
            return sum_stats(live, self._retired.prefill_stats)

    def replicas(self) -> dict[str, ReplicaState]:
        with self._lock:
            return {k: dataclasses.replace(v) for k, v in self._replicas.items()}

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        """The engine's info once the app runs; StageError while it is deploying after
        ``timeout`` (the caller polls: its startup deadline and shutdown apply), and a fatal
        one with Serve's reason when the deployment failed."""
        if self.info is not None:
            return self.info
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed or self._fatal is not None:
                raise StageError(f"stage is not running: {self.error}")
            status, lines = self._app_state()
            why = "; ".join(lines)
            if status == "RUNNING":
                break
            if status == "LOST":
                self._fatal = self._lost
                raise StageError(self._fatal)
            if status == "DEPLOY_FAILED":
                self._fatal = f"the replicas failed to start: {why}"
                refused = _refusal(lines)
                # A config the engine refuses is bad input, as with one stage (exit code 2).
                raise StageError(self._fatal) if refused is None else StageConfigError(refused)
            if deadline is not None and time.monotonic() >= deadline:
                needs = f"starting; {replica_needs(self.config)}"
                raise StageError(f"replicas not ready ({status.lower()}): {why or needs}")
            time.sleep(_POLL_S if deadline is None else min(_POLL_S, timeout or _POLL_S))
        try:
            self.info = self._handle.info.remote().result(timeout_s=timeout)
        except Exception as exc:
            raise StageError(f"no replica answered: {type(exc).__name__}: {exc}") from exc
        self._count_live()  # (ready: the first request must not find "none alive")
        return self.info

    def _serve_app(self) -> tuple:
        """Serve's status of this server's app and of its deployment (None where absent)."""
        from ray import serve

        app = serve.status().applications.get(self.config.ray_app)
        deployment = app.deployments.get(self._deployment) if app is not None else None
        return app, deployment

    def _app_state(self) -> tuple[str, list[str]]:
        """The app's status (Serve's ``ApplicationStatus`` value) and what Serve says of it
        and of its deployment, a line each: for a replica whose engine raised, the error's
        last line. "LOST": the deployment Serve showed is gone (``_check_owner``)."""
        app, deployment = self._serve_app()
        self._check_owner(app, deployment)
        if self._lost is not None:
            return "LOST", [self._lost]
        if app is None:
            return "NOT_STARTED", []
        words = [app.message, deployment.message if deployment is not None else ""]
        lines = [w.strip().splitlines()[-1] for w in words if w and w.strip()]
        status = str(getattr(app.status, "value", app.status))
        if deployment is None and status == "RUNNING":  # (Serve shows it within a moment)
            status = "DEPLOYING"
        return status, list(dict.fromkeys(lines))

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        group: str | None = None,
        session: str | None = None,
    ) -> None:
        """Starts the request's streaming call. ``session``: its session key; with session
        affinity, requests with the same key go to the same replica (None: any replica)."""
        with self._lock:
            if not self.alive:
                raise StageError(f"stage is not running: {self.error}")
            if request_id in self._tasks:
                raise ValueError(f"request_id={request_id!r}: already in use")
            stream = self._stream
            if session is not None and self.routes_by_session:
                stream = stream.options(session_id=session)
            params = self._guides.detach(params)
            call = stream.remote(request_id, list(prompt_token_ids), params, group)
            task = asyncio.get_running_loop().create_task(self._relay(request_id, call, sink))
            self._tasks[request_id] = task

    def abort(self, request_id: str) -> None:
        with self._lock:
            task = self._tasks.get(request_id)
        if task is not None:
            # After the relay's first step, which call_soon queued at its creation (FIFO): a
            # task cancelled before it ran never runs its body, so the sink would get no final
            # update, the id would stay in use and the replica would keep generating.
            with contextlib.suppress(RuntimeError):  # its loop is closed already
                task.get_loop().call_soon_threadsafe(task.cancel)

    async def _relay(self, request_id: str, call, sink: Sink) -> None:
        replica = None
        finished = False
        try:
            async for batch in call:
                self._record(batch, first=replica is None)
                replica = batch.replica
                for update in batch.updates:
                    finished = finished or update.finish_reason is not None
                    sink(update)
                if finished:
                    return
            if not finished:
                error = "stage died: the replica ended the request without finishing it"
                sink(RequestUpdate(request_id, finish_reason=FinishReason.ERROR, error=error))
        except asyncio.CancelledError:
            call.cancel()
            sink(RequestUpdate(request_id, finish_reason=FinishReason.ABORT))
        except Exception as exc:  # noqa: BLE001 - a dead replica, a lost node: this request ends
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            where = f"replica {replica}" if replica else "the replica"
            error = f"stage died: {where} failed: {type(exc).__name__}: {first}"
            log.warning("request %s: %s", request_id, error)
            if replica is not None:
                with self._lock:  # a replacement reports anew; its counters stay in the sums
                    self._forget(replica)
                replica = None
            sink(RequestUpdate(request_id, finish_reason=FinishReason.ERROR, error=error))
        finally:
            with self._lock:
                self._tasks.pop(request_id, None)
                state = self._replicas.get(replica) if replica is not None else None
                if state is not None:
                    state.in_flight -= 1
                    if state.in_flight == 0 and state.stats is not None:
                        state.stats = dataclasses.replace(state.stats, **IDLE_GAUGES)
                    if state.in_flight == 0 and state.prefill_stats is not None:
                        state.prefill_stats = dataclasses.replace(
                            state.prefill_stats, **IDLE_GAUGES
                        )

    def _record(self, batch, first: bool) -> None:
        with self._lock:
            state = self._replicas.get(batch.replica)
            if state is None:
                state = self._replicas[batch.replica] = ReplicaState(batch.pid)
            state.requests += first
            state.in_flight += first
            state.stats = batch.stats
            state.prefill_stats = batch.prefill_stats

    # ------------------------------------------------------------------ replicas

    def _count_live(self) -> None:
        app, deployment = self._serve_app()
        self._check_owner(app, deployment)
        states = deployment.replica_states if deployment is not None else {}
        self.live_replicas = int(states.get("RUNNING", 0))
        if deployment is not None and len(self._replicas) > self.live_replicas:
            self._forget_gone()

    def _forget(self, replica: str) -> None:
        """Drops a replica that is gone from the roster, its counters kept (under the lock)."""
        dead = self._replicas.pop(replica, None)
        if dead is not None:
            self._retired.add(dead)

    def _forget_gone(self) -> None:
        """Drops the replicas Serve no longer lists that run nothing here (``roster``'s doc;
        one with requests in flight goes when they fail)."""
        listed = serve_replica_ids(self.config.ray_app, self._deployment)
        if listed is None:
            return
        with self._lock:
            gone = [r for r, s in self._replicas.items() if r not in listed and not s.in_flight]
            for replica in gone:
                self._forget(replica)

    def _check_owner(self, app, deployment) -> None:
        """Notes (and logs, once) that the app is no longer this server's: it shows another
        deployment (Serve shows a deploy's deployments from the moment it is taken, so one
        deployed before this server's cannot be there), or it is gone after Serve showed this
        server's deployment. (Between the deploy and Serve's first showing of its deployment,
        a moment, the app shows none.)"""
        if deployment is not None:
            self._seen = True
            return
        if not self._deployed or self._lost is not None or self._closed:
            return
        name = self.config.ray_app
        if app is not None and app.deployments:
            lost = (
                f"the Ray Serve app {name!r} was replaced by another deployment (a server "
                f"started with --ray-app {name} --ray-replace-app?): this server's replicas are "
                "gone and it cannot serve again; stop it, or restart it with its own --ray-app"
            )
        elif app is None and self._seen:
            lost = (
                f"the Ray Serve app {name!r} was deleted from the cluster (`serve shutdown`, or "
                "an older server's stop?): this server's replicas are gone; restart it to "
                "deploy them again"
            )
        else:
            return
        with self._lock:  # (the poller and wait_ready both look: logged once)
            if self._lost is not None:
                return
            self._lost = lost
        log.error("%s", lost)

    def _owns_app(self) -> bool:
        """Whether the app is this server's to delete: Serve shows its deployment in it, or
        shows none in it yet and never showed it (deployed a moment ago; once shown, an app
        showing none is being replaced)."""
        app, deployment = self._serve_app()
        if deployment is not None:
            return True
        return app is not None and not self._seen and not app.deployments

    def _poll(self) -> None:
        while not self._closed:
            time.sleep(_POLL_S)
            try:
                self._count_live()
            except Exception as exc:  # noqa: BLE001 - the cluster went away
                if not self._closed:
                    self._fatal = f"Ray Serve is not answering: {type(exc).__name__}: {exc}"
                return

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            tasks = list(self._tasks.values())
        for task in tasks:
            with contextlib.suppress(RuntimeError):  # its loop is closed already
                task.get_loop().call_soon_threadsafe(task.cancel)
        # A cluster this process owns stops with it; when the stop signal reached Ray's
        # daemons as well (sent to the whole group or cgroup) they go within a moment.
        if cluster_gone(watch_s=1.0 if self._owns_cluster else 0.0):
            log.warning("the Ray cluster has stopped (with this process?): nothing to stop")
            return
        self._poller.join(5.0)
        self._stop_ray()

    def _stop_ray(self) -> None:
        from ray import serve

        try:
            # Only this server's deployment: the app may be another server's by now (it
            # replaced this one's, or this one was refused); deleting it would stop that
            # server's replicas under it. (Read, then deleted: another server replacing the
            # app within that moment loses it.)
            if self._deployed and not self._owns_cluster and self._owns_app():
                serve.delete(self.config.ray_app)
            if self._owns_cluster:
                serve.shutdown()
        except Exception:  # noqa: BLE001 - best effort: the cluster may be gone already
            log.exception("stopping the replicas failed")
        if self._owns_cluster:
            import ray

            ray.shutdown()
