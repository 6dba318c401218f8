"""Prefill/decode disaggregation on one host (DESIGN §8): two stages behind one stage client.

``PDClient`` has a stage client's interface and runs two stages: a *prefill* stage computes each
prompt (as a one-token request) and, as that request finishes, writes the KV of the prompt's
full blocks to a file in shared memory (``kv_transfer``); the *decode* stage then adds the
request with that file, caches the prompt's blocks from it and computes only the rest of the
prompt (at least its last token) before decoding. Prompts with no full block before their last
token, requests that score their prompt (``prompt_logprobs``: every position runs anyway) and
unseeded Huginn requests with a random initial state (their KV depends on a seed the decode
stage draws) go to the decode stage directly.

Output equals one stage's: the transfer only replaces computation the decode stage would do
otherwise, and ``kv_transfer`` matches blocks by hashes that name everything their KV depends
on. After a weight update that failed on one stage only, the stages may hold different weights
under one version number, so transfers stop until an update succeeds on both.

A request's updates reach its sink from the decode stage (also when its prefill failed: the
decode stage then computes the prompt itself), or one final update from here when it was
aborted before it got there. Invariant:
a request id is in ``_open`` exactly while its prefill runs; ``_lock`` covers the hand-over, so
an ``abort`` reaches whichever stage holds the request.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

from rltserve.config import EngineConfig
from rltserve.core.engine_info import EngineInfo, EngineStats
from rltserve.core.stage import Sink, StageClient, StageError
from rltserve.sampling import SamplingParams
from rltserve.updates import FinishReason, RequestUpdate

_SHM = "/dev/shm"  # where the host has it: the files never touch a disk
_CLOSED = "stage closed before the request finished"


def stage_client(config: EngineConfig, client_cls: Callable = StageClient):
    """The stage client ``config`` asks for: ``client_cls(config)``, or a ``PDClient`` over two
    of them with ``disaggregate``."""
    if config.execution.disaggregate:
        return PDClient(config, client_cls)
    return client_cls(config)


def stage_configs(config: EngineConfig) -> tuple[EngineConfig, EngineConfig]:
    """The prefill stage's config and the decode stage's: one stage each, prefix caching on
    (the decode stage finds transferred blocks in its cache); the prefill stage on
    ``prefill_device`` and without CUDA graphs (they serve decode steps only)."""
    execution = replace(config.execution, disaggregate=False, prefill_device=None)
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


@dataclass
class _Handoff:
    """A request while its prompt runs on the prefill stage."""

    prompt: list[int]
    params: SamplingParams
    sink: Sink
    group: str | None
    path: str
    aborted: bool = False


class PDClient:
    """A prefill stage and a decode stage (each ``client_cls(config)``) as one stage client."""

    def __init__(self, config: EngineConfig, client_cls: Callable = StageClient) -> None:
        prefill_config, decode_config = stage_configs(config)
        self.prefill = client_cls(prefill_config)
        try:
            self.decode = client_cls(decode_config)
        except BaseException:
            self.prefill.close(timeout=2.0)
            raise
        self._dir = tempfile.mkdtemp(
            prefix="rltserve-pd-", dir=_SHM if os.path.isdir(_SHM) else None
        )
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._lock = threading.Lock()  # guards _open, _closed and the hand-over to decode
        self._open: dict[str, _Handoff] = {}
        self._closed = False
        self._files = itertools.count()
        self._in_sync = True  # both stages hold the same weights
        self.block_size = config.cache.block_size
        self.info: EngineInfo | None = None
        self._stats_of: tuple = (None, None)
        self._stats: EngineStats | None = None

    # ---------------------------------------------------------------- lifecycle

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        prefill = self.prefill.wait_ready(timeout)
        decode = self.decode.wait_ready(timeout)
        length = min(prefill.max_model_len, decode.max_model_len)
        self.info = replace(decode, max_model_len=length)
        return self.info

    @property
    def alive(self) -> bool:
        return self.prefill.alive and self.decode.alive and not self._closed

    @property
    def error(self) -> str | None:
        for name, stage in (("prefill", self.prefill), ("decode", self.decode)):
            if stage.error is not None:
                return f"{name} stage: {stage.error}"
        return "closed" if self._closed else None

    def close(self, timeout: float = 10.0) -> None:
        """Closes both stages; a request still in its prefill ends as aborted."""
        with self._lock:
            self._closed = True
        self.prefill.close(timeout)
        self.decode.close(timeout)
        self._finalizer()

    def kill(self) -> None:
        self.prefill.kill()
        self.decode.kill()

    # ---------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        group: str | None = None,
    ) -> None:
        """``StageClient.add_request``: through the prefill stage when the prompt has KV to
        move, else to the decode stage directly."""
        if not self._transfers(prompt_token_ids, params):
            self.decode.add_request(request_id, prompt_token_ids, params, sink, group)
            return
        path = os.path.join(self._dir, f"{next(self._files)}.safetensors")
        handoff = _Handoff(list(prompt_token_ids), params, sink, group, path)
        with self._lock:
            if self._closed:
                raise StageError("stage is not running: closed")
            if request_id in self._open:
                raise ValueError(f"request_id={request_id!r}: already in use")
            self._open[request_id] = handoff
        # What the prompt's KV and its hashes depend on, at a fixed full depth: a token that
        # exited early would end the request before the prompt's last loops ran.
        one_token = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            seed=params.seed,
            max_loops=params.max_loops,
            init_state=params.init_state,
            priority=params.priority,
        )
        ref = weakref.ref(self)

        def on_prefill(update: RequestUpdate) -> None:  # (holds the client weakly)
            client = ref()
            if client is not None and update.finish_reason is not None:
                client._prefilled(request_id, update)

        try:
            self.prefill.add_request(
                request_id, handoff.prompt, one_token, on_prefill, transfer=("export", path)
            )
        except BaseException:
            with self._lock:
                self._open.pop(request_id, None)
            raise

    def _transfers(self, prompt: list[int], params: SamplingParams) -> bool:
        if not self._in_sync or len(prompt) - 1 < self.block_size:
            return False
        if params.prompt_logprobs is not None:
            return False
        family = self.info.family if self.info is not None else None
        return not (
            family == "huginn_raven" and params.init_state == "random" and params.seed is None
        )

    def _prefilled(self, request_id: str, update: RequestUpdate) -> None:
        """The prefill stage's final update: the request moves to the decode stage with its
        file, or ends here (failed or aborted)."""
        with self._lock:
            handoff = self._open.pop(request_id, None)
            if handoff is None:
                return
            final: RequestUpdate | None = None
            if handoff.aborted or self._closed:
                final = RequestUpdate(request_id, finish_reason=FinishReason.ABORT)
                if self._closed and not handoff.aborted:
                    final.error = _CLOSED
            else:
                # A failed prefill costs only the transfer: the decode stage computes the
                # prompt (and refuses the request itself if it is bad).
                done = update.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                path, sink = handoff.path, handoff.sink

                def on_decode(update: RequestUpdate) -> None:
                    if update.finish_reason is not None:  # (the stage removes it when read)
                        _remove(path)
                    sink(update)

                try:
                    self.decode.add_request(
                        request_id,
                        handoff.prompt,
                        handoff.params,
                        on_decode,
                        handoff.group,
                        transfer=("import", path) if done else None,
                    )
                except (StageError, ValueError) as exc:
                    error = f"decode stage: {exc}"
                    final = RequestUpdate(request_id, finish_reason=FinishReason.ERROR, error=error)
        if final is not None:
            _remove(handoff.path)
            handoff.sink(final)

    def abort(self, request_id: str) -> None:
        with self._lock:
            handoff = self._open.get(request_id)
            if handoff is not None:
                handoff.aborted = True
        (self.prefill if handoff is not None else self.decode).abort(request_id)

    # ---------------------------------------------------------------- both stages

    def _both(self, call: Callable[[object], int | None]) -> int | None:
        """``call(stage)`` on the prefill stage, then on the decode stage even if the first
        raised (that error is raised); the decode stage's result."""
        try:
            call(self.prefill)
        except BaseException:
            with contextlib.suppress(Exception):
                call(self.decode)
            raise
        return call(self.decode)

    def update_weights(self, paths: list[str], abort: bool, timeout_s: float) -> int:
        self._in_sync = False  # until both stages hold the new weights
        version = self._both(lambda stage: stage.update_weights(paths, abort, timeout_s))
        self._in_sync = True
        return version

    def sleep(self, level: int, timeout_s: float) -> None:
        self._both(lambda stage: stage.sleep(level, timeout_s))

    def wake_up(self, tags: list[str]) -> None:
        self._both(lambda stage: stage.wake_up(tags))

    def reset_prefix_cache(self) -> None:
        self._both(lambda stage: stage.reset_prefix_cache())

    @property
    def weight_version(self) -> int:
        return self.decode.weight_version

    @property
    def sleeping(self) -> set[str]:
        return self.prefill.sleeping | self.decode.sleeping

    @property
    def stats(self) -> EngineStats | None:
        """The decode stage's stats, its requests waiting counting those in their prefill.
        A new object only when either stage sent new stats (the server's watchdog reads a
        new object as progress)."""
        key = (self.prefill.stats, self.decode.stats)
        if key[0] is not self._stats_of[0] or key[1] is not self._stats_of[1]:
            prefill, decode = key
            self._stats_of = key
            self._stats = decode
            if decode is not None and prefill is not None:
                waiting = decode.num_waiting + prefill.num_running + prefill.num_waiting
                self._stats = replace(decode, num_waiting=waiting)
        return self._stats


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
