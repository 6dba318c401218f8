"""What an RL trainer drives on an ``AsyncLLM`` between rollouts (``AsyncTrainerControls``, a base
of ``AsyncLLM``): ``LLM``'s trainer controls as the ``async def`` methods vLLM's ``AsyncLLM`` has,
each running ``LLM``'s call off the event loop (a weight update waits for running requests, whose
outputs reach their consumers through that loop), and ``PauseGate``, ``generate``'s wait while
generation is paused; and ``check_vllm_keywords``, ``generate``'s check of vLLM's keywords.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rltserve.caller_values import plain_number
from rltserve.core.stage import StageError
from rltserve.metrics_reader import Metric
from rltserve.weights import WeightsArg

if TYPE_CHECKING:
    from rltserve.llm import LLM

SHUT_DOWN = "this AsyncLLM is shut down (shutdown() was called)"
_T = TypeVar("_T")


class PauseGate:
    """Holds new ``generate`` calls while ``LLM``'s generation is paused, however it was paused
    (``AsyncLLM.pause_generation`` or the ``LLM``'s own), without holding the event loop: one
    watcher thread, however many calls wait, waits on ``LLM``'s condition and wakes them through
    their loops. (A thread per waiting call would exhaust the loop's executor.)"""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._watching = False  # guarded, like _waiters, by the LLM's condition

    async def wait(self) -> None:
        """Returns once generation is not paused (at once if it is not), or the LLM closed."""
        llm = self._llm
        with llm._running:  # (held briefly: the watcher's wait releases it)
            if not llm._paused or llm._closed:
                return
            loop = asyncio.get_running_loop()
            waiter = (loop, loop.create_future())
            self._waiters.append(waiter)
            if not self._watching:
                self._watching = True
                # A daemon: a pause never resumed must not keep the interpreter from exiting
                # (the loop's executor would be joined at asyncio.run's end).
                threading.Thread(target=self._watch, name="rltserve-pause", daemon=True).start()
        try:
            await waiter[1]
        finally:
            with llm._running:
                if waiter in self._waiters:  # (cancelled while waiting)
                    self._waiters.remove(waiter)

    def wake(self) -> None:
        """Lets the watcher see a change it is not notified of (the LLM closing)."""
        with self._llm._running:
            self._llm._running.notify_all()

    def _watch(self) -> None:
        llm = self._llm
        with llm._running:
            llm._running.wait_for(lambda: not llm._paused or llm._closed)
            waiters, self._waiters = self._waiters, []
            self._watching = False
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits there
                loop.call_soon_threadsafe(_release, future)


def _release(future: asyncio.Future[None]) -> None:
    if not future.done():  # (cancelled meanwhile)
        future.set_result(None)


class AsyncTrainerControls:
    """vLLM ``AsyncLLM``'s trainer methods over the ``LLM`` it holds: the same arguments, checks
    and errors as ``LLM``'s (``llm_controls.TrainerControls``), awaited."""

    _llm: LLM
    _closed: bool

    async def update_weights(
        self, weights: WeightsArg, *, abort: bool = False, timeout: float = 300.0
    ) -> int:
        """``LLM.update_weights``: replaces the weights in place once no request runs (running
        ones finish first, or are aborted with ``abort=True``; ``UpdateTimeout`` after
        ``timeout`` seconds) and returns the new ``weight_version``. (vLLM's takes a
        ``WeightTransferUpdateRequest`` of its transfer engines; here LLM's arguments: a
        checkpoint, or ``(name, tensor)`` pairs such as ``model.state_dict().items()``.)"""
        return await self._off_loop(self._llm.update_weights, weights, abort=abort, timeout=timeout)

    @property
    def weight_version(self) -> int:
        """Weight updates applied so far (0: the checkpoint as loaded); ``LLM.weight_version``."""
        return self._llm.weight_version

    async def sleep(self, level: int = 1, timeout: float = 300.0) -> None:
        """``LLM.sleep``: frees the KV cache (and, on CUDA, the weights) once running requests
        end (``UpdateTimeout`` after ``timeout`` seconds); ``generate`` raises ValueError until
        ``wake_up``. (vLLM's default aborts running requests instead of waiting for them.)"""
        await self._off_loop(self._llm.sleep, level, timeout)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``LLM.wake_up``: restores what ``sleep`` freed (``tags``: "weights", "kv_cache";
        None: both)."""
        await self._off_loop(self._llm.wake_up, tags)

    async def is_sleeping(self) -> bool:
        """vLLM's (async there too): whether any part is asleep."""
        return self._llm.is_sleeping()

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """``LLM.reset_prefix_cache``: forgets every cached prefix; True. (vLLM's
        ``reset_connector``: there is no KV connector, nothing to reset.)"""
        del reset_connector
        return await self._off_loop(self._llm.reset_prefix_cache, reset_running_requests)

    async def pause_generation(self) -> None:
        """``LLM.pause_generation``: new ``generate`` calls wait (without holding the loop) and
        start on ``resume_generation``; requests already running continue. (vLLM's aborts them
        by default, or waits for them with ``mode="wait"``: for the first, ``abort`` their ids;
        ``update_weights`` itself waits for running requests.)"""
        self._llm.pause_generation()  # (a flag under a lock: nothing to take off the loop)

    async def resume_generation(self) -> None:
        """Lets the ``generate`` calls held by ``pause_generation`` start."""
        self._llm.resume_generation()

    async def is_paused(self) -> bool:
        """vLLM's (async there too): whether generation is paused."""
        return bool(self._llm._paused)

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        """``LLM.collective_rpc``: a ValueError (there are no workers to call)."""
        return self._llm.collective_rpc(method, timeout, args, kwargs)

    def get_metrics(self) -> list[Metric]:
        """``LLM.get_metrics``: the engine's vLLM metrics (a read of its latest counters,
        so synchronous, as ``LLM``'s)."""
        return self._llm.get_metrics()

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        """``LLM.start_profile``: a ValueError (no built-in profiler)."""
        self._llm.start_profile()

    async def stop_profile(self) -> None:
        self._llm.stop_profile()

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        """``LLM.encode``: a ValueError (no pooling head)."""
        return self._llm.encode(*args, **kwargs)

    async def _off_loop(self, method: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``method`` (an ``LLM`` one that blocks until the stage answers) on a thread."""
        with self._controls():
            return await asyncio.to_thread(method, *args, **kwargs)

    @contextlib.contextmanager
    def _controls(self) -> Iterator[None]:
        """After ``shutdown()``, the StageError says so in this class's terms."""
        if self._closed:
            raise StageError(SHUT_DOWN)
        try:
            yield
        except StageError as exc:
            if self._closed:
                raise StageError(SHUT_DOWN) from exc
            raise


def check_vllm_keywords(
    lora_request: object,
    tokenization_kwargs: object,
    trace_headers: object,
    data_parallel_rank: object,
    prompt_text: object,
) -> None:
    """vLLM's ``generate`` keywords: a ValueError for a value that asks for what rltserve lacks
    (None, or an empty mapping, asks for nothing)."""
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported")
    if tokenization_kwargs:
        raise ValueError(
            f"tokenization_kwargs={tokenization_kwargs!r:.80}: not supported; pass token ids "
            "or SamplingParams(truncate_prompt_tokens=k)"
        )
    if trace_headers:
        raise ValueError(f"trace_headers={trace_headers!r:.80}: tracing is not supported")
    rank = plain_number(data_parallel_rank)
    if rank is not None and (isinstance(rank, bool) or rank != 0):
        raise ValueError(
            f"data_parallel_rank={data_parallel_rank!r}: there is one engine (rank 0 or None)"
        )
    if prompt_text is not None and not isinstance(prompt_text, str):
        raise ValueError(f"prompt_text={prompt_text!r:.80}: must be a string or None")
