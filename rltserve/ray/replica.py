"""One engine replica inside a Ray Serve deployment (this module runs in Ray's worker process).

A replica runs the stage loop on a thread of its own actor process (``InProcessStageClient``:
the actor already is the separate process). ``generate`` streams a request's updates in
batches; each batch carries the replica's identity and its latest ``EngineStats`` so the front
end can label metrics per replica without polling replicas one by one. Cancelling the stream
(the client went away, or aborted) aborts the request in the engine. A guided request's
compiled index comes as a ref to Ray's object store, fetched once per replica
(``rltserve.ray.guides``). ``check_health`` is Ray Serve's health check: a replica whose stage
died raises there and Serve replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
from dataclasses import dataclass

from rltserve.config import EngineConfig
from rltserve.core.engine_info import EngineInfo, EngineStats
from rltserve.ray.guides import GuideStore
from rltserve.ray.logs import LogSetup, set_up_logging
from rltserve.sampling import SamplingParams
from rltserve.updates import RequestUpdate


@dataclass(frozen=True)
class ReplicaBatch:
    """Updates of one request from one replica, as streamed to the front end."""

    replica: str  # Ray Serve's replica id
    pid: int  # the replica's process (tests kill it)
    updates: list[RequestUpdate]
    stats: EngineStats | None
    prefill_stats: EngineStats | None = None  # (a disaggregated replica's prefill stage's)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (unit use): the process is the identity
        return f"pid-{os.getpid()}"


def replica_config(engine_config: EngineConfig, replica_id: str) -> EngineConfig:
    """The replica's engine config: its engine seed mixes the configured one with the replica's
    id, so that unseeded requests on different replicas sample different streams (every replica
    has the same config: one seed would repeat the same samples on each)."""
    digest = hashlib.blake2b(replica_id.encode(), digest_size=4).digest()
    model = engine_config.model
    seed = model.seed + int.from_bytes(digest, "big")
    return dataclasses.replace(engine_config, model=dataclasses.replace(model, seed=seed))


class EngineReplica:
    def __init__(
        self, engine_config: EngineConfig, threads: int, log_setup: LogSetup = None
    ) -> None:
        """``log_setup``: the server's logging (``rltserve.ray.logs.caller_logging``)."""
        import torch

        from rltserve.core.pd import stage_client
        from rltserve.core.stage import InProcessStageClient

        set_up_logging(log_setup)  # (before the engine loads: its start-up warnings too)
        torch.set_num_threads(threads)
        self._id = _replica_id()
        self._guides = GuideStore()
        self._client = stage_client(replica_config(engine_config, self._id), InProcessStageClient)
        self._info = self._client.wait_ready(600.0)

    def info(self) -> EngineInfo:
        return self._info

    def identity(self) -> tuple[str, int]:
        return self._id, os.getpid()

    def check_health(self) -> None:
        if not self._client.alive:
            raise RuntimeError(f"the replica's stage is not running: {self._client.error}")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        group: str | None = None,
    ):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()

        def sink(update: RequestUpdate) -> None:  # the stage client's delivering thread
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(queue.put_nowait, update)

        params = await self._guides.attach(params)  # (a constraint the front end put: its index)
        # Samples of one prompt (``group``) share its prefill when they land on this replica;
        # one whose group's leader runs elsewhere computes its own prompt (same outputs).
        self._client.add_request(request_id, prompt_token_ids, params, sink, group)
        finished = False
        try:
            while not finished:
                updates = [await queue.get()]
                while not queue.empty():
                    updates.append(queue.get_nowait())
                finished = any(u.finish_reason is not None for u in updates)
                prefill = getattr(self._client, "prefill_stats", None)
                yield ReplicaBatch(self._id, os.getpid(), updates, self._client.stats, prefill)
        finally:
            if not finished:  # cancelled by the caller: free the engine's work at once
                self._client.abort(request_id)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close(timeout=5.0)
