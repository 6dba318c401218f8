"""The server's state and the engine's lifecycle inside the app.

The engine loads in the background once the app starts, so ``/health`` can answer 503 "Loading
model" meanwhile (as llama.cpp does) and 200 once ready. Shutdown runs in two phases: ``drain``
(aiohttp's on_shutdown, before it waits for handlers) refuses new work and gives in-flight
requests ``drain_timeout_s`` to finish, then aborts the rest; ``stop`` (cleanup) closes the stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

from rltserve.config import EngineConfig
from rltserve.core.engine_info import EngineInfo, EngineStats
from rltserve.core.request_checks import model_field_problem
from rltserve.core.restart import RestartPolicy
from rltserve.core.stage import StageError
from rltserve.generation_config import generation_config_defaults
from rltserve.http.admission import AdmissionGate
from rltserve.http.config import ServerConfig
from rltserve.http.encoding import max_token_chars
from rltserve.http.errors import HTTPError, unavailable
from rltserve.http.frontend import Frontend, StageClientLike
from rltserve.http.heap_trim import IdleTrim, heap_trimmer
from rltserve.http.hidden_metrics import shown_hidden_metrics
from rltserve.http.metrics import ServingMetrics
from rltserve.http.request_log import RequestLog, id_list
from rltserve.http.stats_log import StatsLog, kv_capacity_lines, log_stats_interval
from rltserve.http.supervisor import SupervisedStage
from rltserve.models.chat_template import read_chat_template
from rltserve.models.tokenizer import Tokenizer, load_tokenizer
from rltserve.preflight import snapshot_repo_id
from rltserve.vllm_args import generation_config_folder

_MAX_WARNED_FIELDS = 64  # distinct unknown field names warned about, per app
log = logging.getLogger("rltserve.http")

ClientFactory = Callable[[EngineConfig], StageClientLike]
IdFactory = Callable[[str], str]  # prefix ("cmpl", "chatcmpl") -> response id
Clock = Callable[[], float]  # unix seconds, for "created"
_POLL_S = 0.25  # how often a loading engine is checked (lets shutdown interrupt loading)
_TOKENIZER_THREADS = 2  # long prompts encode here, never on the event loop
REQUEST_ID_HEADER = "X-Request-Id"
# (a fresh request id, once made, in the request's own storage)
_FRESH_ID = web.RequestKey("rltserve.request_id", str)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _load_tokenizer(path: str) -> tuple[Tokenizer | None, int | None]:
    """The checkpoint's tokenizer and the most characters one of its tokens covers."""
    tokenizer = load_tokenizer(path)
    return tokenizer, max_token_chars(tokenizer) if tokenizer is not None else None


def default_model_name(engine_config: EngineConfig) -> str:
    """The served name of a model given no --served-model-name: its directory's name, or for
    a Hugging Face cache snapshot its repo id (the directory's name is a commit hash). A
    relative path counts from the working directory, so ``--model .`` is named for the folder
    it is run in (its own name is "", and ``..``'s is ".."); links are not followed."""
    path = os.path.abspath(engine_config.model.model)
    return snapshot_repo_id(path) or Path(path).name


class ServingState:
    def __init__(
        self,
        config: ServerConfig,
        engine_config: EngineConfig,
        client_factory: ClientFactory,
        *,
        ids: IdFactory = random_id,
        clock: Clock = time.time,
    ) -> None:
        self.config = config
        self.engine_config = engine_config
        self.ids = ids
        self.clock = clock
        self.gate = AdmissionGate(config.max_concurrent, config.max_queued)
        # The first served name is the model's in /metrics and in responses to requests that
        # name none; requests may name any (vLLM's), and /v1/models lists them all.
        self.served_names = config.served_model_names or (default_model_name(engine_config),)
        self.model_name = self.served_names[0]
        # Requests may also name the checkpoint as --model gave it, vLLM's default served name
        # (scripts send `model=args.model_path`); /v1/models lists the served names alone.
        self.model_names = set(self.served_names)
        if config.served_model_name is None:
            self.model_names.add(str(engine_config.model.model))
        self.request_log = RequestLog(
            config.enable_log_requests, config.enable_log_outputs, config.max_log_len
        )
        hidden = shown_hidden_metrics(config.show_hidden_metrics_for_version)
        self.metrics = ServingMetrics(self.model_name, config.metrics_prefix, hidden)
        self.created = int(clock())
        self.closing = False
        # /sleep calls the stage has not answered (their callers may have gone): meanwhile
        # completions and chat are refused at once (``delivery``), not held by the engine
        # until the sleep ends only to be refused then.
        self.sleeps_pending = 0
        self.sleep_lock = asyncio.Lock()  # held by the sleep the stage has now (``admin``)
        # Completion and chat requests in flight, for GET /load (only with
        # enable_server_load_tracking: ``handlers.load_aware``).
        self.server_load = 0
        self._drain_cut = False  # a second shutdown signal: abort in-flight requests now
        self.load_error: str | None = None
        self.load_exception: Exception | None = None  # what load_error says
        self.ready = asyncio.Event()  # set once loading ended, successfully or not
        self._client_factory = client_factory
        self._client: SupervisedStage | None = None
        self._watch: asyncio.Task | None = None
        self._stats_log: asyncio.Task | None = None  # (``disable_log_stats``: none)
        self._frontend: Frontend | None = None
        self._ignored_fields: set[str] = set()  # names already warned about
        # What a request leaves out of temperature, top_p, top_k, min_p, repetition_penalty,
        # (chat) max_tokens, max_loops, exit_criterion and init_state: the generation
        # config's, read at start, under --override-generation-config's (vLLM's).
        self.sampling_defaults: dict[str, object] = {}
        # Owned here, shut down in stop(): long bodies and texts are parsed and encoded on it.
        self.executor = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="rltserve-tok")
        # What the requests freed, given back to the kernel once they stop (on the pool above).
        self.idle_trim = IdleTrim(heap_trimmer(), self.executor)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Starts the stage and loads the tokenizer (meanwhile); records a failure instead of
        raising."""
        path = str(self.engine_config.model.model)
        tokenizer_path = self.engine_config.model.tokenizer or path
        tokenizer_job = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, tokenizer_path))
        try:
            folder = generation_config_folder(self.config.generation_config, path)
            self.sampling_defaults = {
                **generation_config_defaults(folder),
                **self.config.generation_overrides,
            }
            self._client = await asyncio.to_thread(
                SupervisedStage,
                self._client_factory,
                self.engine_config,
                self.restart_policy(),
                self.metrics.stage_restarts.inc,
                request_names=self._request_names,
            )
            info = await self._wait_ready(self._client)
            defaults = self.sampling_defaults
            loops = defaults.get("max_loops")
            if loops is not None and loops > info.max_loops:
                raise ValueError(
                    f"--override-generation-config: max_loops={loops}: this model allows at "
                    f"most {info.max_loops}"
                )
            fields = (defaults.get("exit_criterion"), defaults.get("init_state"))
            if problem := model_field_problem(*fields, info):
                raise ValueError(f"--override-generation-config: {problem}")
            tokenizer, token_chars = await tokenizer_job
            if tokenizer is not None and self.config.chat_template is not None:
                tokenizer.use_chat_template(read_chat_template(self.config.chat_template))
            client = self._client

            def stats() -> tuple[EngineStats | None, int, int]:  # (a StatsSource)
                return client.stats, self.gate.num_queued, client.weight_version

            self.metrics.configure(
                info.max_loops,
                stats,
                lambda: client.prefill_stats,
                self.cache_info(info),
                lambda: bool(client.sleeping),
                max_model_len=info.max_model_len,
                disaggregated=self.engine_config.execution.disaggregate,
            )
            self._frontend = Frontend(
                self._client,
                info,
                tokenizer,
                self.metrics,
                self.executor,
                token_chars,
                self.config.template_defaults,
                self.config.return_tokens_as_token_ids,
                self.config.response_role,
            )
            if hasattr(client.inner, "replicas"):
                from rltserve.ray.metrics import ReplicaCollector

                prefix = self.config.metrics_prefix
                collector = ReplicaCollector(self.model_name, lambda: client.inner, prefix)
                self.metrics.registry.register(collector)
            self._watch = asyncio.create_task(client.watch(), name="rltserve-stage-supervisor")
            log.info(
                "engine ready: %s (%s, %d loops; context %d tokens, %d KV blocks of %d)",
                self.model_name,
                info.family,
                info.num_loops,
                info.max_model_len,
                info.num_blocks,
                info.block_size,
            )
            for line in kv_capacity_lines(info, self.engine_config.execution.disaggregate):
                log.info("%s", line)
            if not self.config.disable_log_stats:
                stats_log = StatsLog(self.metrics, stats, time.monotonic())
                self._stats_log = asyncio.create_task(
                    self._log_stats(stats_log, log_stats_interval()), name="rltserve-stats-log"
                )
        except Exception as exc:  # noqa: BLE001 - any startup failure is reported by /health
            self.load_error = f"{type(exc).__name__}: {exc}"
            self.load_exception = exc
            if self.closing:  # (stopped while loading: the shutdown's effect, not a failure)
                log.info("loading stopped: the server is shutting down")
            else:
                log.error("engine failed to start: %s", self.load_error)
        finally:
            if tokenizer_job.done() and not tokenizer_job.cancelled():
                tokenizer_job.exception()  # retrieved: a failure was reported above, if any
            else:
                tokenizer_job.cancel()
            self.ready.set()

    def cache_info(self, info: EngineInfo) -> dict[str, str]:
        """``cache_config_info``'s labels: vLLM's names (``num_gpu_blocks``: the pool's
        blocks, on whatever device) and rltserve's facts that turn blocks into tokens."""
        engine = self.engine_config
        return {
            "block_size": str(info.block_size),
            "num_gpu_blocks": str(info.num_blocks),
            "cache_dtype": str(engine.model.dtype),
            "enable_prefix_caching": str(engine.cache.prefix_caching),
            "swap_space": str(engine.cache.swap_space_gb),
            "kv_policy": info.kv_policy,
            "kv_planes": str(info.kv_planes),
            "kv_capacity_tokens": str(info.kv_capacity_tokens),
        }

    async def _log_stats(self, stats_log: StatsLog, interval_s: float) -> None:
        """vLLM's periodic stats line (``stats_log``), every ``interval_s`` until stopped."""
        while True:
            await asyncio.sleep(interval_s)
            line = stats_log.line(time.monotonic())
            if line is not None:
                log.info("%s", line)

    def restart_policy(self) -> RestartPolicy:
        config = self.config
        return RestartPolicy(
            watchdog_s=config.stage_watchdog_s,
            max_restarts=config.stage_restarts,
            backoff_s=config.stage_restart_backoff_s,
            stable_s=config.stage_stable_s,
            startup_timeout_s=config.startup_timeout_s,
        )

    async def gave_up(self) -> None:
        """Returns once the stage failed for good (restarts exhausted); never if it did not."""
        await self.ready.wait()
        if self._client is None or self.load_error is not None:
            await asyncio.Event().wait()  # nothing to supervise: only shutdown ends this
        await self._client.given_up.wait()

    async def _wait_ready(self, client: StageClientLike):
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            try:
                return await asyncio.to_thread(client.wait_ready, _POLL_S)
            except StageError as exc:
                if not client.alive:
                    raise
                if time.monotonic() > deadline:
                    limit = self.config.startup_timeout_s
                    raise StageError(
                        f"{exc} (the engine did not load within --startup-timeout-s {limit:g})"
                    ) from exc
                if self.closing:
                    raise StageError("shutdown while the engine was loading") from None

    async def drain(self) -> None:
        self.closing = True
        self.gate.close("the server is shutting down")  # (queued requests: refused at once)
        frontend = self._frontend
        if frontend is None:
            return
        deadline = time.monotonic() + self.config.drain_timeout_s
        while frontend.num_open and time.monotonic() < deadline and not self._drain_cut:
            await asyncio.sleep(0.05)
        if frontend.num_open:
            ids = frontend.open_request_ids()
            log.info("aborting %d in-flight request(s): %s", len(ids), id_list(ids))
            frontend.interrupt_all()

    def _request_names(self, stage_ids: list[str]) -> list[str]:
        """The HTTP request ids of requests in the stage (``SupervisedStage``'s log lines)."""
        frontend = self._frontend
        return frontend.request_ids(stage_ids) if frontend is not None else sorted(stage_ids)

    def cut_drain(self) -> None:
        """Ends a drain now (a second Ctrl-C): its in-flight requests are aborted."""
        self._drain_cut = True

    async def stop(self) -> None:
        self.closing = True
        self.idle_trim.close()
        for task in (self._watch, self._stats_log):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._frontend is not None:
            self._frontend.interrupt_all()
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ for handlers

    def require_frontend(self) -> Frontend:
        """The frontend of a ready engine, or a 503 saying why there is none."""
        retry = self.config.retry_after_s
        if self.closing:
            raise unavailable("the server is shutting down", retry)
        if self.load_error is not None:
            raise unavailable(f"the engine failed to start: {self.load_error}")
        if self._frontend is None:
            raise unavailable("Loading model", retry)
        stage = self._client
        if stage.gave_up:
            raise unavailable(f"the engine is not running (no restarts left): {stage.failure}")
        if not stage.alive:
            why = stage.failure or stage.error or "it stopped"
            raise unavailable(f"the engine is not running; restarting it ({why})", retry)
        if (why := stage.unavailable_reason) is not None:
            raise unavailable(why, retry)
        return self._frontend

    def health(self) -> dict:
        """The body of a 200 /health: replica counts when serving a replica set; why the
        prefill stage of a disaggregated engine is down (the decode stage serves alone)."""
        inner = self._client.inner if self._client is not None else None
        live = getattr(inner, "live_replicas", None)
        if live is None:
            down = getattr(inner, "prefill_down", None)
            return {"status": "ok", "prefill_stage": f"down: {down}"} if down else {"status": "ok"}
        return {"status": "ok", "replicas": {"live": live, "configured": inner.config.replicas}}

    def ignore_field(self, path: str, request_id: str | None = None) -> None:
        """An unknown request field (``strict_fields`` off): dropped, with one warning per field
        name for the app's lifetime (``messages[3].x`` counts as ``messages[].x``) naming the
        request that sent it first (``request_id``, where it has one)."""
        name = re.sub(r"\[\d+\]", "[]", path)
        if name in self._ignored_fields or len(self._ignored_fields) > _MAX_WARNED_FIELDS:
            return
        self._ignored_fields.add(name)
        if len(self._ignored_fields) > _MAX_WARNED_FIELDS:  # clients choose the names: bounded
            log.warning("ignoring further unknown request fields without naming them")
        else:
            shown = name if len(name) <= 80 else name[:80] + "..."
            sent = f" (request {request_id})" if request_id else ""
            log.warning(
                "ignoring unknown request field %r%s (--strict-fields rejects it)", shown, sent
            )

    def check_model(self, name: str | None) -> None:
        """An absent or empty ``model`` means the served one (as vLLM takes it)."""
        if name and name not in self.model_names:
            raise HTTPError(404, f"The model `{name}` does not exist.", param="model")

    def request_id(self, request: web.Request) -> str | None:
        """The client's ``X-Request-Id``; without one, with ``enable_request_id_headers``, a
        fresh id kept on the request (its response header, response id and log lines agree);
        else None."""
        rid = request.headers.get(REQUEST_ID_HEADER)
        if not rid and self.config.enable_request_id_headers:  # (an empty header: none sent)
            rid = request.get(_FRESH_ID) or request.setdefault(_FRESH_ID, uuid.uuid4().hex)
        return rid

    def passthrough_headers(self, request: web.Request) -> dict[str, str]:
        """The headers every response to ``request`` carries: its ``X-Request-Id``."""
        rid = self.request_id(request)
        return {} if rid is None else {REQUEST_ID_HEADER: rid}

    @property
    def client(self) -> SupervisedStage | None:
        return self._client


STATE = web.AppKey("rltserve.state", ServingState)
