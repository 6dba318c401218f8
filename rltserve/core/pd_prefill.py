"""The prefill stage of a ``PDClient``, started again when it dies (DESIGN §8).

The prefill stage only saves the decode stage work: while it is down the decode stage computes
every prompt (as it does for a prefill that failed), so its death fails no request. Its
prefills in flight move on to the decode stage without a file, and new requests go there
directly. ``PrefillStage`` owns the current prefill stage client; a thread notices that it died
(worker exit, ``kill -9``, a watchdog's kill: the client is no longer alive) and starts another
under ``RESTARTS`` (a backoff that doubles per attempt, at most 3 attempts in a row; a stage
that served 60 s starts a fresh count). A new stage serves only with the decode stage's
weights (the updates applied since start, applied again from the owner's ``UpdateLog``, under
the decode stage's weight version: block hashes name it) and only while the decode stage is
awake: it starts awake, so while the decode stage sleeps it is not started (wake-up brings it
back). When it cannot come back the decode stage serves alone;
``down`` says why (the server's /health shows it) and the log says so. Also here: the prefill
stage's request for a prompt (``prefill_params``), and both stages' configs
(``stage_configs``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace

from rltserve.config import EngineConfig
from rltserve.core.engine_info import EngineInfo, EngineStats, sum_stats
from rltserve.core.restart import RestartPolicy, stop_stage
from rltserve.core.stage import StageError
from rltserve.core.update_log import UpdateLost
from rltserve.sampling import SamplingParams

logger = logging.getLogger(__name__)

# (the attempts, backoff and stable time; not the server's --stage-* flags: those decide when
# the server gives up and exits for an outer supervisor, while a prefill stage that runs out of
# attempts only leaves the decode stage serving alone; --stage-restarts 0, asking for a dead
# engine to be handed on, would here quietly end disaggregation at the first prefill crash)
RESTARTS = RestartPolicy(max_restarts=3, backoff_s=1.0, backoff_max_s=30.0, stable_s=60.0)
POLL_S = 0.2
READY_TIMEOUT_S = 600.0  # (a model load: the server's --startup-timeout-s default)


class PrefillStage:
    """The current prefill stage client (``client``) and whether one serves (``down``)."""

    def __init__(self, start: Callable[[], object]) -> None:
        self._start = start
        # (client, why no stage serves now or None, the counters of the stages that died),
        # swapped whole by the keeper thread: readers see one consistent state, never a
        # dead stage's counters both retired and still current.
        self._view: tuple[object, str | None, EngineStats | None] = (start(), None, None)
        self.restarts = 0
        self._attempts = 0
        self._since = time.monotonic()
        self._stop = threading.Event()
        # Starting or publishing a client and closing exclude each other: once _stop is set
        # no client is started or published, and close() stops those that were.
        self._swap = threading.Lock()
        self._starting = None  # the client a restart starts and gives weights to
        self._thread: threading.Thread | None = None
        # A command (or a restart's weight updates) waits for a prefill stage's answer: the
        # server's watchdog kills only the prefill stage when such a wait is overdue.
        self.commanding = False

    @property
    def client(self):
        return self._view[0]

    @property
    def down(self) -> str | None:
        """Why no prefill stage serves now (None while one does)."""
        return self._view[1]

    @property
    def serving(self):
        """The client while it serves, else None."""
        client, down, _ = self._view
        return client if down is None and client.alive else None

    @property
    def sleeping(self) -> set[str]:
        """What is asleep in the serving stage (nothing while none serves: a restarted one
        starts awake)."""
        client = self.serving
        return set() if client is None else client.sleeping

    @property
    def stats(self) -> EngineStats | None:
        """The current stage's stats, its counters on top of those of the stages that died
        (they never go down); while it is down the gauges read idle."""
        client, down, retired = self._view
        current = client.stats if down is None else None
        if retired is None:
            return current
        return sum_stats([current] if current is not None else [], retired)

    def command(self, name: str, *args) -> None:
        """Runs the client's command ``name`` unless the stage is down or dies meanwhile (a
        restarted one gets the decode stage's weights, and starts only while it is awake)."""
        stage = self.serving
        if stage is None:
            return
        try:
            with self._commanding():
                getattr(stage, name)(*args)
        except StageError:
            if stage.alive:
                raise

    @contextlib.contextmanager
    def _commanding(self) -> Iterator[None]:
        """Around a command on a prefill stage (under the owner's command lock, so one at a
        time): ``commanding`` is True meanwhile."""
        self.commanding = True
        try:
            yield
        finally:
            self.commanding = False

    def kill(self) -> None:
        """Kills the stage's worker, and that of one a restart is starting (a hung one: the
        server's watchdog); the keeper then starts another."""
        for stage in (self.client, self._starting):
            kill = getattr(stage, "kill", None)
            if kill is not None:
                kill()

    def watch(self, owner) -> None:
        """Starts the thread that restarts the stage for ``owner`` (a PDClient, held weakly),
        once (``wait_ready`` may be called again)."""
        with self._swap:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, args=(weakref.ref(owner),), name="rltserve-prefill-keeper"
            )
            self._thread.daemon = True
            self._thread.start()

    def close(self, timeout: float) -> None:
        with self._swap:
            self._stop.set()
            starting = self._starting
        if starting is not None:  # (its start or replay then fails at once)
            starting.close(timeout)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.client.close(timeout)

    def _set_down(self, why: str) -> None:
        client, _, retired = self._view
        self._view = (client, why, retired)

    def _run(self, ref: weakref.ref) -> None:
        while not self._stop.wait(POLL_S):
            owner = ref()
            if owner is None:
                return
            old, _, retired = self._view
            if old.alive or owner.closed:
                del owner
                continue
            owner._prefill_died(old)
            del owner
            if (last := old.stats) is not None:
                retired = sum_stats([last], retired)
            self._view = (old, f"died: {old.error}", retired)
            logger.error(
                "prefill stage died: %s; its prefills in flight continue on the decode stage, "
                "which computes every prompt until the prefill stage is back",
                old.error,
            )
            stop_stage(old, timeout=5.0)
            if not self._revive(ref):
                return

    def _revive(self, ref: weakref.ref) -> bool:
        """Starts stages until one serves (True), or the attempts run out or the owner closed."""
        if time.monotonic() - self._since >= RESTARTS.stable_s:
            self._attempts = 0
        while not self._stop.is_set():
            if self._attempts >= RESTARTS.max_restarts:
                self._set_down(f"not restarted after {self._attempts} attempt(s): {self.down}")
                logger.error(
                    "giving up on the prefill stage (%s); the decode stage serves alone, "
                    "computing every prompt",
                    self.down,
                )
                return False
            self._attempts += 1
            delay = RESTARTS.backoff(self._attempts)
            logger.info(
                "restarting the prefill stage in %.1f s (attempt %d)", delay, self._attempts
            )
            if self._stop.wait(delay) or not self._awake(ref):
                return False
            new = None
            try:
                new = self._start()
                with self._swap:
                    self._starting = new
                    if self._stop.is_set():
                        raise StageError("closed while starting")
                self._ready(new)
                adopted = self._adopt(ref, new)
            except Exception as exc:  # noqa: BLE001 - a failed start is one failed attempt
                failure = f"{type(exc).__name__}: {exc}"
                if new is not None:
                    self._drop(new)
                if self._stop.is_set():  # (closed: close() failed it, no attempt failed)
                    return False
                if isinstance(exc, UpdateLost):  # (no attempt can get those weights back)
                    self._set_down(f"not restarted: cannot restore {exc}")
                    logger.error("giving up on the prefill stage: %s", self.down)
                    return False
                self._set_down(f"restart failed: {failure}")
                logger.warning("prefill stage restart attempt %d: %s", self._attempts, failure)
                continue
            if not adopted:  # the decode stage fell asleep meanwhile, or the owner closed
                self._drop(new)
                self._attempts -= 1
                continue
            self._since = time.monotonic()
            self.restarts += 1
            logger.info("prefill stage restarted (%d restart(s) so far)", self.restarts)
            return True
        return False

    def _drop(self, new) -> None:
        """Stops a client a restart started that will not serve."""
        stop_stage(new, timeout=5.0)
        with self._swap:
            self._starting = None

    def _awake(self, ref: weakref.ref) -> bool:
        """Waits while the decode stage sleeps; False once the owner is closed or gone."""
        while not self._stop.is_set():
            owner = ref()
            if owner is None or owner.closed:
                return False
            if not owner.decode.sleeping:
                return True
            del owner
            self._stop.wait(POLL_S)
        return False

    def _ready(self, new) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self._stop.is_set():
                raise StageError("closed while starting")
            try:
                new.wait_ready(POLL_S)
                return
            except StageError:
                if not new.alive or time.monotonic() > deadline:
                    raise

    def _adopt(self, ref: weakref.ref, new) -> bool:
        """Gives ``new`` the decode stage's weights, under the decode stage's version (the
        replay skips superseded updates: the engine's own count would salt its block hashes
        apart from the decode stage's), and makes it the stage, unless the owner closed or its
        decode stage sleeps; under the owner's command lock, so no update, sleep or wake-up
        runs meanwhile."""
        owner = ref()
        if owner is None:
            return False
        with owner._commands:
            if owner.closed or owner.decode.sleeping:
                return False
            needed, version = owner._updates.replay()
            with self._commanding():
                for update in needed:
                    new.update_weights(list(update.paths), True, READY_TIMEOUT_S)
                if new.weight_version != version:
                    new.set_weight_version(version)
            with self._swap:
                if self._stop.is_set():  # (closed meanwhile: the caller stops new)
                    return False
                self._view, self._starting = (new, None, self._view[2]), None
            # The stages hold the same weights again: transfers resume.
            owner._in_sync = True
        return True


def prefill_params(params: SamplingParams, info: EngineInfo) -> SamplingParams:
    """The prefill stage's request: greedy, one token, with what the prompt's KV and its
    hashes depend on, its token at the request's full depth (one that exited earlier
    would end the request before the prompt's last loops ran)."""
    cap = params.max_loops
    if cap is not None and info.has_gate:  # a gated request runs max(loops, cap) loops
        cap = max(cap, info.num_loops)
    traced = params.trace_depths is not None  # (the engine runs exit_mode='trace')
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        seed=params.seed,
        max_loops=cap,
        trace_depths=(cap or info.num_loops,) if traced else None,
        init_state=params.init_state,
        kv_policy=params.kv_policy,
        priority=params.priority,
        cache_salt=params.cache_salt,
    )


def stage_configs(config: EngineConfig) -> tuple[EngineConfig, EngineConfig]:
    """The prefill stage's config and the decode stage's: one stage each, prefix caching on
    (the decode stage finds transferred blocks in its cache); the prefill stage on
    ``prefill_device`` and without CUDA graphs (they serve decode steps only)."""
    execution = replace(
        config.execution, disaggregate=False, prefill_device=None, kv_transfer_gb=None
    )
    decode = replace(
        config, execution=execution, cache=replace(config.cache, enable_prefix_caching=True)
    )
    device = config.execution.prefill_device or config.model.device
    prefill = replace(
        decode,
        model=replace(config.model, device=device),
        execution=replace(execution, cuda_graphs=False),
    )
    return prefill, decode
