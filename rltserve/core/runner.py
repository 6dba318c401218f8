"""ModelRunner: StepPlan -> tensors -> one model pass -> sampling -> StepResult.

With ``step.py`` (one step's work) it runs the model; it never mutates a request. Between steps
it keeps per-request execution state (``LiveRequest``): the hidden states of in-flight work
items, the exit-gate state of their output positions, the last sampled token (the next decode
token's input) and the sampling generator. Because the runner owns these, the scheduler can plan
a step before it has read the previous step's result.

One step: the prelude runs for items entering loop 1; every item runs one loop at its own depth
(each reads and writes the KV plane of that depth); the exit rule runs for output positions; the
coda, logits and sampler run for rows that finished.

Launching and delivering are separate (``launch`` -> ``StepHandle``). Everything the device
decides stays on the device until the result is delivered: sampled tokens feed the next prelude
as tensors, the gate state lives in tensors, and the host reads one staged buffer per step.
With ``defer_results`` (CUDA with async scheduling) a step's result is delivered inside the
*next* step, right after that step's loop is queued, so the host waits only on a step the device
has already moved past; otherwise it is delivered at the end of its own launch. A step whose
result decides the next step's inputs (a draft check that may roll back) is always delivered at
once. Invariant: results are delivered in launch order, and a step's host copies (delayed-exit
decisions, drafts, penalty history) are delivered before any later decision reads them.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import numpy as np
import torch

from rltserve.core.attention import allocate_kv_cache, copy_slots
from rltserve.core.block_tables import BlockTables
from rltserve.core.carried import CarriedRows
from rltserve.core.cuda_graphs import DecodeGraphs
from rltserve.core.executor import ExecutionFuture, StepThread
from rltserve.core.host_swap import HostSwap
from rltserve.core.live import LiveRequest, PendingRows
from rltserve.core.metadata import Spans
from rltserve.core.plan import ItemResult, StepPlan, StepResult, WorkItem
from rltserve.core.sampler import Sampler, SeededGenerator
from rltserve.core.sleep import DeviceMemory
from rltserve.core.staging import StepOutputs, to_device
from rltserve.core.step import Step
from rltserve.core.step_attention import StepAttention
from rltserve.models.base import AttentionFn, LoopedModel

logger = logging.getLogger(__name__)
T = TypeVar("T")


class StepHandle:
    """A launched step. ``future`` completes with its StepResult once that is on the host."""

    def __init__(
        self, runner: ModelRunner, plan: StepPlan, future: Future[StepResult] | None = None
    ) -> None:
        self.step_id = plan.step_id
        self.item_ids = [it.request_id for it in plan.items]  # to fail them on an error
        self.carried: list[WorkItem] = []  # carried tokens it runs (their requests fail likewise)
        self.continued_ids = [rid for rid, _, _ in plan.continued]  # (and these)
        self.future: Future[StepResult] = future or Future()
        self.outputs: StepOutputs | None = None
        self.finish: Callable[[], StepResult] | None = None  # builds the result on the host
        self._runner = runner

    def ready(self) -> bool:
        return self.outputs is None or self.outputs.ready()

    def result(self) -> StepResult:
        """Delivers this step (and every earlier one) if needed; call on the runner's thread."""
        if not self.future.done():
            self._runner.deliver(upto=self)
        return self.future.result()


class ModelRunner:
    def __init__(
        self,
        model: LoopedModel,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        executor: StepThread | None = None,
        defer_results: bool = False,
        decode_graphs: str | None = None,
        graph_max_rows: int = 256,
        graph_max_context: int = 4096,
        max_model_len: int | None = None,
        swap_space_bytes: int = 0,
        pad_budget: int = 0,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        """``decode_graphs``: None (eager), "cuda" (replay the loop of decode-only steps from
        CUDA graphs, all captured here) or "emulate" (the same padded static buffers run
        eagerly: CPU tests). Graphs cover decode steps of up to ``graph_max_rows`` rows whose
        contexts fit ``min(max_model_len, graph_max_context)`` tokens. ``swap_space_bytes``:
        the host memory swapped KV may take (``HostSwap``; 0: unbounded). ``pad_budget``:
        attention groups within it are one padded batch (``group_indices``)."""
        self.model = model
        self.spec = model.spec
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        num_layers = max(self.spec.num_core_layers, self.spec.num_boundary_layers)
        # Core and boundary planes draw blocks from one pool, so they share one slot space.
        # With decode graphs one extra block, never handed out, takes the padding rows' K/V.
        self.kv = allocate_kv_cache(
            num_layers,
            num_blocks + (decode_graphs is not None),
            block_size,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.dtype,
            self.device,
        )
        self.sampler = Sampler(logprobs_mode)
        self.live: dict[str, LiveRequest] = {}
        self.pending_rows: PendingRows | None = None  # see live.py
        self.block_tables = BlockTables()  # host copies of the tables steps use
        self._attention = StepAttention(
            self.kv, self.block_tables, block_size, self.device, pad_budget
        )
        self.carried = CarriedRows(self.block_tables)  # decode tokens whose loops it runs by itself
        # Width of the sampled logits (the model's possibly padded vocabulary), known once a
        # step has sampled: a resumed request repeats its generator draws at this width.
        self.logits_width = self.spec.vocab_size
        # Swap space: KV of preempted requests on the host (pinned, non-blocking on CUDA).
        self.host_swap = HostSwap(self.kv, self.device, swap_space_bytes)
        # Sampling generators of preempted requests, until they resume or are released: a
        # resume continues from one instead of replaying every draw from the seed.
        self.kept_generators: dict[str, SeededGenerator] = {}
        self.keeps_e = self.spec.needs_noise  # only Huginn re-injects e every loop
        self.gate_init = torch.tensor([1.0, 0.0], dtype=torch.float32, device=self.device)
        self._scalars: dict[float, torch.Tensor] = {}  # (``scalar``)
        # Steps run on a dedicated stream on CUDA; everything allocated so far (weights, KV)
        # was made on the default stream, which the step stream waits for once.
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.graphs: DecodeGraphs | None = None
        self._new_graphs: Callable[[], DecodeGraphs] | None = None
        if decode_graphs is not None:
            context = min(max_model_len or self.spec.max_position, graph_max_context)
            self._new_graphs = lambda: DecodeGraphs(
                model,
                self.kv,
                block_size=block_size,
                scratch_block=num_blocks,
                max_rows=graph_max_rows,
                max_cols=-(-context // block_size),
                backend=decode_graphs,
                pad_budget=pad_budget,
            )
            self._build_graphs()
        self.memory = DeviceMemory(self.kv, model.parameters())  # sleep mode
        self.defer_results = defer_results
        self._undelivered: deque[StepHandle] = deque()
        self._launching = False
        self._dropped: set[str] = set()  # requests a failed step dropped, until released
        self._executor = executor  # the thread steps run on when submitted
        if executor is not None:
            executor.set_idle(self.poll)
        self.model_seconds = 0.0  # wall time inside model calls, for overhead measurements
        # The same calls' CPU time on the thread that ran them, counted only when
        # ``count_model_cpu`` (benchmarks: ``time.thread_time`` is a system call, ~2 us here).
        self.model_cpu_seconds = 0.0
        self.count_model_cpu = False
        self.busy_seconds = 0.0  # wall time launching steps and delivering their results
        self.drafts_checked = 0  # token pipelining: drafts compared with the committed token
        self.drafts_rejected = 0

    # ---------------------------------------------------------------- execution

    def submit(self, plan: StepPlan) -> ExecutionFuture:
        """Launches the step on the step thread (torch releases the GIL while it computes).
        Steps launch one at a time in submission order; the future completes on delivery."""
        if self._executor is None:
            self._executor = StepThread()
            self._executor.set_idle(self.poll)
        future: Future[StepResult] = Future()
        self._executor.submit(self.launch, plan, future)
        return ExecutionFuture(future)

    def execute(self, plan: StepPlan) -> StepResult:
        """Launches the step and returns its result (synchronous execution), on the step
        thread when there is one: the runner's state and torch stay on one thread."""
        return self._on_step_thread(lambda: self.launch(plan).result())

    def shutdown(self) -> None:
        if self._executor is not None:
            if self._executor.alive:
                self._executor.call(self.deliver)
            self._executor.shutdown()
            self._executor = None
        self.deliver()

    def _build_graphs(self) -> None:
        self.graphs = self._new_graphs()
        if self.graphs.backend == "cuda":  # capture up front, not mid-serving
            with self._on_stream():
                self.graphs.capture_all()

    def sleep(self, level: int) -> None:
        """Frees the KV pool (and on CUDA the weights: ``DeviceMemory``); no request is live."""

        def sleep(*_) -> None:
            if self.graphs is not None and self.graphs.backend == "cuda":
                self.graphs = None  # captured on addresses that go; its memory pool goes too
            self.memory.sleep(level)

        self.with_kv(sleep)  # (ordered with the steps)

    def wake_up(self, tags: list[str]) -> None:
        def wake() -> None:
            with self._on_stream():  # the KV is zeroed before any later step writes it
                self.memory.wake_up(tags)
            if self.graphs is None and self._new_graphs is not None and not self.memory.asleep:
                self._build_graphs()

        self._on_step_thread(wake)

    def _on_step_thread(self, fn: Callable[[], T]) -> T:
        """``fn()``, run on the step thread when there is one: the runner's state and torch stay
        on one thread."""
        return self._executor.call(fn) if self._executor is not None else fn()

    def with_kv(self, fn: Callable[..., T]) -> T:
        """``fn(kv pool, self._slots)`` on the step thread and stream, after earlier steps."""

        def call() -> T:
            with self._on_stream():
                return fn(self.kv, self._slots)

        return self._on_step_thread(call)

    def forget_all(self) -> None:
        """Drops every request's state (the scheduler started over), after every step already
        submitted has run, on the step thread when there is one."""

        def forget() -> None:
            self.deliver()
            self.live.clear()
            self.pending_rows = None
            self.carried.clear()
            self.block_tables.clear()
            self.host_swap.clear()
            self.kept_generators.clear()
            self._dropped.clear()

        self._on_step_thread(forget)

    def poll(self) -> bool:
        """Delivers launched steps whose device work is done; True while one is still running.
        The step thread calls this when it has nothing else to do."""
        while self._undelivered:
            try:
                ready = self._undelivered[0].ready()
            except Exception:  # a device error: delivering turns it into a failed result
                ready = True
            if not ready:
                return True
            self._deliver_one()
        return False

    def deliver(self, upto: StepHandle | None = None) -> None:
        """Delivers launched steps in order: all of them, or up to and including ``upto``."""
        while self._undelivered:
            handle = self._deliver_one()
            if handle is upto:
                return

    def _deliver_one(self) -> StepHandle:
        handle = self._undelivered.popleft()
        start = time.perf_counter()
        try:
            assert handle.finish is not None
            result = handle.finish()
        except Exception as exc:  # e.g. a device error surfacing at the copy
            result = self._fail_step(handle, exc)
        finally:
            if not self._launching:  # a launch times its deliveries itself
                self.busy_seconds += time.perf_counter() - start
        handle.future.set_result(result)
        return handle

    def launch(self, plan: StepPlan, future: Future[StepResult] | None = None) -> StepHandle:
        """Queues the step's work. The result is delivered now, or (``defer_results``) during
        the next launch or when the step thread is idle."""
        handle = StepHandle(self, plan, future)
        start = time.perf_counter()
        eager = not self.defer_results
        self._launching = True
        try:
            with torch.inference_mode(), self._on_stream():
                eager |= self._launch(plan, handle)
        except Exception as exc:  # a failed step fails its requests, not the engine
            self.deliver()
            # A request preempted by this step whose KV had not reached swap space yet has
            # lost it: it fails too (its resume would find nothing to swap in).
            lost = [rid for rid, _ in plan.swap_out if not self.host_swap.holds(rid)]
            result = self._fail_step(handle, exc, lost)
            handle.finish = lambda: result
        finally:
            self._launching = False
            self.busy_seconds += time.perf_counter() - start
        self._undelivered.append(handle)
        if eager:
            self.deliver()
        return handle

    def _fail_step(
        self, handle: StepHandle, exc: Exception, lost: list[str] | None = None
    ) -> StepResult:
        """A failed step: the requests of its items and of its carried tokens fail, and
        ``lost``, those it lost outside them (preempted before their KV reached swap space)."""
        # (A continued token is among the carried ones once ``advance`` took it, a plan's new
        # one once ``CarriedRows.start`` did: its request is among the items' too.)
        carried = list(dict.fromkeys([w.request_id for w in handle.carried] + handle.continued_ids))
        items = set(handle.item_ids)
        carried = [rid for rid in carried if rid not in items]
        request_ids = handle.item_ids + carried
        lost = [*(lost or ()), *carried]
        # Clients get the exception's type and message; the traceback goes to the log.
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        logger.error(
            "step %d failed; its requests fail: %s",
            handle.step_id,
            sorted(set(request_ids) | set(lost)),
            exc_info=exc,
        )
        for rid in request_ids:  # their device state is unknown now
            self.live.pop(rid, None)
            self.block_tables.release(rid)
        for rid in lost:
            self.kept_generators.pop(rid, None)
        # Steps planned before the scheduler learns of the failure skip these requests' items
        # (instead of failing on the missing state) until the scheduler releases them.
        self._dropped.update(request_ids)
        self._dropped.update(lost)
        return StepResult(handle.step_id, [None] * len(request_ids), error=detail, lost=lost)

    def _on_stream(self):
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def attention(
        self,
        spans: list[tuple[int, int, list[int]]],
        keys: list[tuple[str, int]] | None = None,
        carried: tuple[Spans, np.ndarray] | None = None,
        one_row: bool = False,
    ) -> AttentionFn:
        """``StepAttention.build``: attention over ``(start, num_tokens, block_table)`` spans."""
        return self._attention.build(spans, keys, carried, one_row)

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks) * block_size] int64 on the device: every slot of ``blocks``, block by
        block (pinned and non-blocking on CUDA: a pageable copy would wait for the stream)."""
        bs = self.block_size
        return to_device([b * bs + i for b in blocks for i in range(bs)], self.device)

    def timed(self, fn, *args):
        start = time.perf_counter()
        if self.count_model_cpu:
            cpu = time.thread_time()
            out = fn(*args)
            self.model_cpu_seconds += time.thread_time() - cpu
        else:
            out = fn(*args)
        self.model_seconds += time.perf_counter() - start
        return out

    def tensor(self, values, dtype: torch.dtype | None = None) -> torch.Tensor:
        return to_device(values, self.device, dtype)

    def scalar(self, value: float) -> torch.Tensor:
        """``value`` as a 0-dim fp32 tensor, which an op takes as a scalar operand, as it
        would the number, in fp32: a number is wrapped in a new tensor by every call (on CPU,
        half of a small op's time). On the CPU for CPU and CUDA steps (CUDA ops read a CPU
        0-dim operand on the host: no copy), on the device elsewhere. Kept per value (a few:
        the exit rule's constants and thresholds; cleared should clients send many)."""
        known = self._scalars.get(value)
        if known is None:
            if len(self._scalars) >= 256:
                self._scalars.clear()
            device = "cpu" if self.device.type in ("cpu", "cuda") else self.device
            known = torch.tensor(value, dtype=torch.float32, device=device)
            self._scalars[value] = known
        return known

    def _launch(self, plan: StepPlan, handle: StepHandle) -> bool:
        """Queues the step's work and sets ``handle.finish``; True when the result must be
        delivered at once."""
        # Host bookkeeping first: whatever fails later in this launch, the carried rows (and
        # ``handle.carried``, which a failure fails) agree with the loops the scheduler counts
        # for this step, and no released request's row is left to write into freed blocks.
        for rid in plan.preempted:
            live = self.live.pop(rid, None)
            self.block_tables.release(rid)
            if live is not None and live.generator is not None:
                self.kept_generators[rid] = live.generator
            self._dropped.discard(rid)
        for rid in plan.released:
            self.live.pop(rid, None)
            self.block_tables.release(rid)
            self.kept_generators.pop(rid, None)
            self._dropped.discard(rid)
        if plan.preempted or plan.released or self._dropped:
            self.carried.drop({*plan.preempted, *plan.released, *self._dropped})
        continued = plan.continued
        if continued and self._dropped:  # (their requests fail with the step that dropped them)
            continued = [c for c in continued if c[0] not in self._dropped]
        # (Should ``advance`` refuse a continuation, changing nothing, the step fails every
        # carried token's request with the continued ones: the scheduler counts a loop for each.)
        handle.carried = self.carried.items
        carried = self.carried.advance(continued, plan.moved)  # their next loops run first
        handle.carried = carried
        swap = self.host_swap
        for rid, blocks in plan.swap_out:  # before any later item can overwrite the blocks
            swap.put(rid, self._slots(blocks))
        for rid in plan.released:  # swap space after the swap-outs, in the plan's order
            swap.drop(rid)
        for rid, blocks in plan.swap_in:
            if rid in self._dropped:  # its swap-out failed; the scheduler fails it
                continue
            swap.take(rid, self._slots(blocks))
        if plan.block_copies:
            sources, targets = zip(*plan.block_copies)
            copy_slots(self.kv, self._slots(list(sources)), self._slots(list(targets)))
        for setup in plan.new_requests:
            kept = self.kept_generators.pop(setup.request_id, None)
            self.live[setup.request_id] = LiveRequest.create(
                setup, self.device, self.logits_width, kept
            )
        # Items planned before a rollback this runner already did are stale: skip them.
        # (Steps that can roll back are delivered before the next launch, so epochs are
        # current here.) So are items of requests a failed step dropped.
        if self._dropped or self.drafts_rejected:  # epochs are 0 until a draft is rejected
            active = [
                k
                for k, it in enumerate(plan.items)
                if it.request_id not in self._dropped and it.epoch >= self.live[it.request_id].epoch
            ]
        else:
            active = range(len(plan.items))
        # A new carried token whose input is on the runner (its request's last sampled token)
        # runs among the carried rows from its first loop, as a continued one does: a decode
        # batch whose tokens start as new items (the first after a prompt, or one that cannot
        # continue) stays one batch of carried rows. (Its result is None either way: a carried
        # token reports events.)
        given = plan.items
        fresh = [k for k in active if given[k].carry is not None and given[k].token_ids is None]
        if fresh:
            starting = [given[k] for k in fresh]
            lives = [self.live[w.request_id] for w in starting]
            carried = handle.carried = self.carried.start(starting, lives)
            taken = set(fresh)
            active = [k for k in active if k not in taken]
        nc = len(carried)
        if not active and not nc:
            handle.finish = lambda: StepResult(plan.step_id, [None] * len(plan.items))
            return False
        every = len(active) == len(plan.items)
        planned = plan.items if every else [plan.items[k] for k in active]
        items = carried + planned if nc else planned
        step = Step(self, items, nc)  # (nc rows from self.carried)
        eager = step.run()
        self.carried.keep(items, nc, step.ending, step.lives, step.held)
        handle.outputs = step.outputs

        def finish() -> StepResult:
            outcomes, events = step.results()
            if every:
                results: list[ItemResult | None] = outcomes[nc:] if nc else outcomes
            else:
                results = [None] * len(plan.items)
                for k, result in zip(active, outcomes[nc:]):
                    results[k] = result
            scored = step.prompt_results()
            return StepResult(
                plan.step_id,
                results,
                events,
                num_rows=step.num_rows,
                num_coda_rows=step.num_coda_rows,
                prompt_logprobs={active[i - nc]: v for i, v in scored.items()} if scored else None,
            )

        handle.finish = finish
        return eager
