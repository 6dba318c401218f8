"""Keeps the server's stage running: notices a dead or hung stage, fails its requests, restarts it.

``SupervisedStage`` is the stage client the server talks to. It owns the current stage client
(built by the app's ``client_factory``) and swaps in a new one after a failure, so the frontend
keeps one client for the server's lifetime. ``watch`` (a task of the server's event loop) checks
the stage every tick:

- dead: the client reports it is no longer alive (worker exit or ``kill -9``: channel EOF; a
  fatal error of the engine loop);
- hung: requests are open and neither an update nor fresh engine stats arrived for
  ``watchdog_s`` seconds (one engine step sends both), or a control call (sleep, a weight
  update...) went unanswered ``watchdog_s`` past its own timeout (``pending_controls``: an
  idle stage that stopped reading shows no other sign); the stage is then killed. A
  disaggregated engine names the stage waited for (``stalled_stage``, ``control_stage``): a
  hung prefill stage is killed alone (``kill_prefill``: the client serves on without it, a
  control goes on to the decode stage, and it starts the prefill stage again), nothing here
  fails or restarts.

Either way every request still open on that stage ends with an ERROR update whose message starts
with "stage died" (those the dying client ends itself are left to end here, so that the log line
names them all) (the frontend turns it into a 503 body, or an error event then ``[DONE]`` in a
stream), a control call left waiting on it fails with the same reason (a StageError, not the
"stage closed" of the client that ended it), and the stage is restarted after a backoff that
doubles per consecutive attempt; a new stage must load and take back the weight updates and
sleep of the old one within bounds (``stage_restore``) before it serves. While it restarts
``alive`` is False (the server answers 503 with Retry-After). The supervisor gives
up when the stage fails after ``max_restarts`` restart attempts in a row, each of which failed
to start a stage or started one that failed within ``stable_s`` seconds (a stage that ran that
long starts a fresh count): ``given_up`` is set and the server process exits non-zero so that
an outer supervisor (systemd, Kubernetes) acts.

Invariant: every request whose ``add_request`` returned gets exactly one final update, from the
client it was added to or from here, never both (``_open`` is the one record of which client
owns which request; updates of a request no longer there are dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from rltserve.config import EngineConfig
from rltserve.core.engine_info import EngineInfo, EngineStats, sum_stats
from rltserve.core.restart import RestartPolicy, stop_stage
from rltserve.core.stage import Sink, StageError
from rltserve.core.update_log import AppliedUpdate, Stamps, UpdateLog, UpdateLost, stamps
from rltserve.http.frontend import StageClientLike
from rltserve.http.pending_controls import PendingControls
from rltserve.http.request_log import id_list
from rltserve.http.sleep_state import SleepState
from rltserve.http.stage_restore import RestoreFailed, restore
from rltserve.sampling import SamplingParams
from rltserve.updates import FinishReason, RequestUpdate

log = logging.getLogger("rltserve.http")


class NotWithReplicas(ValueError):
    """A control a replica set lacks (each replica is its own deployment, and a Serve call
    reaches one of them): bad input that names no parameter."""


@dataclass
class _Open:
    client: StageClientLike
    sink: Sink


class SupervisedStage:
    """A stage client that survives its stage (see the module doc); the SessionRoutedClient
    API."""

    def __init__(
        self,
        factory: Callable[[EngineConfig], StageClientLike],
        engine_config: EngineConfig,
        policy: RestartPolicy,
        on_restart: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        request_names: Callable[[list[str]], list[str]] = sorted,
    ) -> None:
        """``request_names``: the names log lines give the requests of some stage ids (the
        server's: their HTTP request ids)."""
        self.policy = policy
        self._request_names = request_names
        self._factory = factory
        self._engine_config = engine_config
        self._on_restart = on_restart
        self._clock = clock
        self._lock = threading.Lock()  # guards _open, _client and _last_progress together
        self._open: dict[str, _Open] = {}
        self._client = factory(engine_config)
        self._started = clock()
        self._last_progress = clock()
        self._last_stats: EngineStats | None = None
        self._controls = PendingControls(clock)  # (of the current stage: the watchdog's)
        self._attempts = 0  # consecutive restarts without a stable stage between them
        self._failed_starts = 0  # of which failed to start a stage
        self.restarts = 0  # successful restarts
        self.restarting = False
        self.failure: str | None = None  # why the last stage stopped, while restarting or given up
        self.given_up = asyncio.Event()  # set on the server's loop, by watch()
        self._closing = False
        # Weight updates applied so far: a restarted stage loads --model's weights, so those
        # still needed are applied to it again before it serves (same weights, same version:
        # the updates it skips are counted in _version_offset).
        self._updates = UpdateLog()
        self._retired: EngineStats | None = None  # the counters of the stages replaced
        self._retired_prefill: EngineStats | None = None  # (their prefill stages', under PD)
        self._version_offset = 0
        self._sleep = SleepState()  # what a restarted stage is put back to
        # The stage last replaced (held weakly) and why: its control calls' errors say so.
        self._ended: tuple[weakref.ref, str] | None = None

    # ------------------------------------------------------------------ StageClientLike

    @property
    def info(self) -> EngineInfo | None:
        return self._client.info

    @property
    def stats(self) -> EngineStats | None:
        """The current stage's stats, its counters on top of those of the stages it replaced
        (they never go down); while it restarts (or after giving up) the gauges read idle."""
        return self._carried(self._client.stats, self._retired)

    @property
    def prefill_stats(self) -> EngineStats | None:
        """A disaggregated engine's prefill stage's stats, carried over restarts as ``stats``
        (None for one stage)."""
        return self._carried(getattr(self._client, "prefill_stats", None), self._retired_prefill)

    def _carried(self, current: EngineStats | None, retired: EngineStats | None):
        if self.restarting or self.gave_up:
            current = None
        if retired is None:
            return current
        return sum_stats([current] if current is not None else [], retired)

    @property
    def alive(self) -> bool:
        return not self.restarting and not self.gave_up and self._client.alive

    @property
    def gave_up(self) -> bool:
        return self.given_up.is_set()

    @property
    def error(self) -> str | None:
        return self.failure or getattr(self._client, "error", None)

    @property
    def unavailable_reason(self) -> str | None:
        """Why a running client cannot take requests now (a replica set with no live replica)."""
        return getattr(self._client, "unavailable_reason", None)

    @property
    def routes_by_session(self) -> bool:
        """Whether the current client places requests by session key (``add_request``'s
        ``session`` reaches it)."""
        return bool(getattr(self._client, "routes_by_session", False))

    @property
    def inner(self) -> StageClientLike:
        """The current stage client."""
        return self._client

    @property
    def pid(self) -> int | None:
        """The current stage worker's process id (None for an in-process stage)."""
        return getattr(self._client, "pid", None)

    @property
    def weight_version(self) -> int:
        return getattr(self._client, "weight_version", 0) + self._version_offset

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        return self._client.wait_ready(timeout)

    def _check_running(self) -> None:
        if self.restarting or self.gave_up:
            raise StageError(f"stage is not running: {self.failure}")

    def update_weights(self, paths: list[str], abort: bool, timeout_s: float) -> int:
        """The current stage's ``update_weights``, remembered so a restart applies it again."""
        update = self._control(
            "update_weights", ": restart them with the new checkpoint", timeout_s
        )
        try:
            before: Stamps | str = stamps(paths)
        except (OSError, ValueError) as exc:  # (the stage will say so, if it fails too)
            before = str(exc)
        version = update(paths, abort, timeout_s) + self._version_offset
        self._updates.add(list(paths), version, before)
        self._sleep.loaded()
        return version

    # Sleep mode and the prefix cache (``POST /sleep``, ...): the current stage's. A stage that
    # is restarted is put back to sleep as the failed one was (``SleepState``), its cache empty.

    def sleep(self, level: int, timeout_s: float) -> None:
        self._control("sleep", wait_s=timeout_s)(level, timeout_s)
        self._sleep.slept(level, self.sleeping)

    def wake_up(self, tags: list[str]) -> None:
        self._control("wake_up")(tags)
        self._sleep.woke(self.sleeping)

    def reset_prefix_cache(self) -> None:
        self._control("reset_prefix_cache")()

    @property
    def sleeping(self) -> set[str]:
        """What ``sleep`` freed and ``wake_up`` has not restored (nothing for a replica set)."""
        return set(getattr(self._client, "sleeping", ()))

    def check_control(self, name: str, advice: str = "") -> None:
        """NotWithReplicas where the stage has no ``name`` control (a replica set: each replica
        is its own deployment), before a caller says it runs it."""
        if getattr(self._client, name, None) is None:
            raise NotWithReplicas(f"{name}: not with engine replicas{advice}")

    def _control(self, name: str, advice: str = "", wait_s: float = 0.0) -> Callable:
        """The stage's control ``name``, watched (``wait_s``: its wait for running requests)."""
        self._check_running()
        self.check_control(name, advice)
        client = self._client
        method = getattr(client, name)

        def call(*args: object):
            with self._controls.waiting(name, wait_s):
                try:
                    return method(*args)
                except StageError as exc:
                    # The watchdog stopped the stage (hung): the call ended as the stage
                    # closed, and the caller is owed the reason, as its requests get it.
                    ended = self._ended
                    if ended is None or ended[0]() is not client:
                        raise
                    raise StageError(f"stage died: {ended[1]}") from exc

        return call

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        group: str | None = None,
        session: str | None = None,
    ) -> None:
        """Adds the request to the current client. ``session`` (the request's session key)
        reaches only a client that routes by it (``routes_by_session``); any other client is
        called without it, as its ``add_request`` has no such parameter."""
        with self._lock:
            self._check_running()
            client = self._client
            if request_id in self._open:
                raise ValueError(f"request_id={request_id!r}: already in use")
            if not self._open:  # the watchdog measures from the first open request
                self._last_progress = self._clock()
            self._open[request_id] = _Open(client, sink)
        try:
            relay = self._relay(client, sink)
            if session is not None and getattr(client, "routes_by_session", False):
                client.add_request(
                    request_id, prompt_token_ids, params, relay, group, session=session
                )
            else:
                client.add_request(request_id, prompt_token_ids, params, relay, group)
        except BaseException:
            with self._lock:
                entry = self._open.get(request_id)
                if entry is not None and entry.client is client:
                    del self._open[request_id]
            raise

    def abort(self, request_id: str) -> None:
        with self._lock:
            entry = self._open.get(request_id)
            # The frontend may abort a request whose final update already passed (a stop string
            # it found in an earlier update): the current stage gets it, where it is a no-op.
            client = entry.client if entry is not None else self._client
        with contextlib.suppress(StageError):
            client.abort(request_id)

    def close(self) -> None:
        self._closing = True
        self._client.close()
        self._fail_open(None, FinishReason.ABORT, "stage closed before the request finished")

    def kill(self) -> None:
        """Kills the current stage worker, as a crash would (tests)."""
        self._client.kill()

    # ------------------------------------------------------------------ supervision

    def _relay(self, client: StageClientLike, sink: Sink) -> Sink:
        def relay(update: RequestUpdate) -> None:  # the client's delivering thread
            rid = update.request_id
            with self._lock:
                entry = self._open.get(rid)
                if entry is None or entry.client is not client:
                    return  # already ended here (hung stage), or a stale update
                if _died_with(client, update):
                    return  # ended by _replace, which names the stage's requests in its log
                self._last_progress = self._clock()
                if update.finish_reason is not None:
                    del self._open[rid]
            update.weight_version += self._version_offset  # (a restart's skipped updates)
            sink(update)

        return relay

    def _fail_open(self, client: StageClientLike | None, finish: FinishReason, error: str) -> None:
        """Ends every open request (of ``client``, or all) with one final update."""
        with self._lock:
            ended = {
                rid: e for rid, e in self._open.items() if client is None or e.client is client
            }
            for rid in ended:
                del self._open[rid]
        for rid, entry in ended.items():
            try:
                entry.sink(RequestUpdate(rid, finish_reason=finish, error=error))
            except Exception:  # one sink's failure must not keep the others waiting
                log.exception("supervisor: the sink of request %s failed", rid)

    def _hung_for(self) -> float:
        """Seconds without progress while requests are open (0 when idle or progressing)."""
        stats = self._client.stats
        with self._lock:
            if stats is not self._last_stats:  # a new stats snapshot: the engine stepped
                self._last_stats = stats
                self._last_progress = self._clock()
            if not self._open:
                return 0.0
            return self._clock() - self._last_progress

    def check(self) -> str | None:
        """Why the current stage must be replaced, if it must: dead or hung."""
        client = self._client
        if not client.alive:
            return getattr(client, "error", None) or "the stage stopped"
        watchdog = self.policy.watchdog_s
        if getattr(client, "self_supervised", False):
            return None  # it replaces its own failed parts (Ray Serve replicas)
        if watchdog and (late := self._controls.overdue(watchdog)) is not None:
            # (a disaggregated engine names the stage its control waits for)
            return self._hung(client, f"{late}; killed it", "control_stage")
        if watchdog and self._hung_for() > watchdog:
            hung = f"no engine step finished within {watchdog:g} s (stage watchdog); killed it"
            return self._hung(client, hung, "stalled_stage")
        return None

    def _hung(self, client: StageClientLike, hung: str, blamed: str) -> str | None:
        """Why ``client`` must be replaced, hung as ``hung`` says; None for a disaggregated
        engine whose method ``blamed`` names its prefill stage, which is killed alone: its
        prefills, and a control waiting for it, move on to the decode stage, which serves
        alone until the client has started the prefill stage again."""
        stage = getattr(client, blamed, lambda: None)()
        if stage is None:
            return hung
        if stage != "prefill":
            return f"{stage} stage: {hung}"
        log.error("prefill stage: %s", hung)
        client.kill_prefill()
        self._controls.renew()  # (each measured afresh, as progress is)
        with self._lock:
            self._last_progress = self._clock()
        return None

    async def watch(self, tick_s: float = 0.1) -> None:
        """Supervises until closed or given up (run as a task on the server's loop)."""
        while not self._closing and not self.gave_up:
            await asyncio.sleep(tick_s)
            reason = self.check()
            if reason is not None and not self._closing:
                await self._replace(reason)

    async def _replace(self, reason: str) -> None:
        old = self._client
        # (Before restarting is set: counters must not dip.)
        if old.stats is not None:
            self._retired = sum_stats([old.stats], self._retired)
        if (prefill := getattr(old, "prefill_stats", None)) is not None:
            self._retired_prefill = sum_stats([prefill], self._retired_prefill)
        self.failure = reason
        self.restarting = True
        self._ended = (weakref.ref(old), reason)
        with self._lock:
            failing = [rid for rid, e in self._open.items() if e.client is old]
        if failing:
            names = self._request_names(failing)
            log.error(
                "stage failed: %s (failing %d request(s): %s)", reason, len(names), id_list(names)
            )
        else:
            log.error("stage failed: %s", reason)
        # Requests on the failed stage end now (a hung stage would never end them).
        self._fail_open(old, FinishReason.ERROR, f"stage died: {reason}")
        await asyncio.to_thread(stop_stage, old)
        if self._clock() - self._started >= self.policy.stable_s:
            self._attempts = self._failed_starts = 0
        while not self._closing:
            if self._attempts >= self.policy.max_restarts:
                log.error("giving up on the stage: %s: %s", self._spent(), self.failure)
                self.given_up.set()
                return
            self._attempts += 1
            delay = self.policy.backoff(self._attempts)
            log.info("restarting the stage in %.1f s (attempt %d)", delay, self._attempts)
            await asyncio.sleep(delay)
            try:
                needed, version = self._updates.replay()
            except UpdateLost as exc:  # (no attempt can get them back: a stage must not serve
                # other weights under the same version)
                self.failure = f"restart failed: cannot restore {exc}"
                log.error("giving up on the stage: %s", self.failure)
                self.given_up.set()
                return
            try:
                new = await asyncio.to_thread(self._factory, self._engine_config)
            except Exception as exc:  # noqa: BLE001 - a failed start is one failed attempt
                self.failure = f"restart failed: {type(exc).__name__}: {exc}"
                self._failed_starts += 1
                log.warning("restart attempt %d: %s", self._attempts, self.failure)
                continue
            try:
                restored = await self._restore(new, needed, version)
            except asyncio.CancelledError:  # (a shutdown: the new stage must not outlive it)
                await asyncio.to_thread(stop_stage, new)
                raise
            if restored:
                with self._lock:
                    self._client = new
                    self._last_stats = None
                    self._last_progress = self._clock()
                self._started = self._clock()
                self.restarts += 1
                self.failure = None
                self.restarting = False
                self._on_restart()
                log.info("stage restarted (%d restart(s) so far)", self.restarts)
                return
            await asyncio.to_thread(stop_stage, new)
            self._failed_starts += 1
            if not self._closing:
                log.warning("restart attempt %d: %s", self._attempts, self.failure)
        await asyncio.to_thread(stop_stage, self._client)

    def _spent(self) -> str:
        """How the restarts were used up, in the words of the rule (``RestartPolicy``)."""
        limit, stable = self.policy.max_restarts, self.policy.stable_s
        if not limit:
            return "no restart allowed (--stage-restarts 0)"
        died = self._attempts - self._failed_starts
        flags = f"--stage-restarts {limit}, --stage-stable-s {stable:g}"
        if not self._failed_starts:
            return f"it failed within {stable:g} s of each of its last {died} restart(s) ({flags})"
        if not died:
            return f"its last {self._attempts} restart attempt(s) failed to start it ({flags})"
        return (
            f"of its last {self._attempts} restart attempts, {self._failed_starts} failed to "
            f"start it and {died} started a stage that failed within {stable:g} s ({flags})"
        )

    async def _restore(
        self, client: StageClientLike, needed: list[AppliedUpdate], version: int
    ) -> bool:
        """Waits for the new stage, gives it ``needed`` and the failed one's sleep
        (``stage_restore``: bounded, a new stage that hangs there is killed); it then serves
        ``version``."""
        try:
            await restore(
                client, needed, self._sleep, self.policy, lambda: self._closing, self._clock
            )
        except RestoreFailed as exc:
            self.failure = f"restart failed: {exc}"
            return False
        self._version_offset = version - len(needed)
        return True


def _died_with(client: StageClientLike, update: RequestUpdate) -> bool:
    """Whether ``update`` is the final error a dying stage client gives its open requests."""
    failed = update.finish_reason is FinishReason.ERROR and not client.alive
    return failed and (update.error or "").startswith("stage died")
