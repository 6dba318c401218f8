"""Scheduler: owns request progress; decides each step's work and applies its results.

Torch-free. Work is planned at loop granularity (continuous depth batching): every running
request contributes at most one work item per step, at whatever depth it has reached, and a
token that exits frees its row for new work in the very next step.

- refill (default): any step may start new items at depth 1 (new prompt chunks, new decode
  tokens, newly admitted requests) beside other requests' deeper loops;
- no_refill: a cohort of items runs in lockstep; new items start only when every item of the
  previous cohort has finished its loops (the static baseline).

Budgets per step: ``max_num_batched_tokens`` rows in all; ``max_num_seqs`` running requests.
Admission reserves a request's whole KV (every plane) so a running request never runs out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rltserve.config import SchedulerConfig
from rltserve.core.exit import delayed_wants_exit, exit_spec
from rltserve.core.kv_cache import KVManager
from rltserve.core.plan import RequestSetup, StepPlan, StepResult, WorkItem
from rltserve.core.request import FinishReason, InFlight, Request, RequestStatus


@dataclass
class RequestUpdate:
    """What one step (or an abort) changed for a request, for the engine to emit."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_exit_depths: list[int] = field(default_factory=list)
    new_logprobs: list[float | None] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    rejected: bool = False  # the request never started: its arguments were invalid


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        *,
        has_gate: bool,
        has_boundary: bool,
    ) -> None:
        self.config = config
        self.kv = kv
        self.has_gate = has_gate
        self.has_boundary = has_boundary
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._released: list[str] = []
        self._step_id = 0
        self.num_steps = 0

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r}: already in use")
        need = self.kv.blocks_needed(request.kv_tokens, request.num_loops)
        if need > self.kv.pool.num_total:
            raise ValueError(
                f"request {request.request_id!r} needs {need} KV blocks "
                f"({request.kv_tokens} tokens x {request.num_loops} loops) but the pool has "
                f"{self.kv.pool.num_total}; lower max_tokens or raise num_blocks"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> RequestUpdate | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self._finish(request, FinishReason.ABORT)
        return RequestUpdate(request_id, finish_reason=FinishReason.ABORT)

    def fail_all(self, error: str) -> list[RequestUpdate]:
        """Fails every unfinished request (a step raised); the engine keeps serving."""
        updates = []
        for request in list(self.running) + list(self.waiting):
            request.error = error
            self._finish(request, FinishReason.ERROR)
            updates.append(
                RequestUpdate(request.request_id, finish_reason=FinishReason.ERROR, error=error)
            )
        return updates

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---------------------------------------------------------------- planning

    def schedule(self) -> StepPlan | None:
        """Plans the next step, or returns None when there is nothing to run."""
        budget = self.config.max_num_batched_tokens
        items: list[WorkItem] = []
        new: list[RequestSetup] = []
        # Items already mid-loop continue first; they fit because they fitted last step.
        for request in self.running:
            if request.in_flight is not None:
                items.append(self._work_item(request))
                budget -= request.in_flight.num_tokens
        lockstep_busy = self.config.scheduling == "no_refill" and bool(items)
        if not lockstep_busy:
            budget = self._start_items(items, budget)
            self._admit(items, new, budget)
        if not items and not self._released:
            return None
        self._step_id += 1
        plan = StepPlan(self._step_id, items, new, self._released)
        self._released = []
        return plan

    def _start_items(self, items: list[WorkItem], budget: int) -> int:
        """New depth-1 items for running requests that have none in flight."""
        for request in self.running:
            if request.in_flight is not None or budget <= 0:
                continue
            if not request.prefill_done:
                item = self._next_chunk(request, budget)
            else:
                item = self._next_decode(request)
            request.in_flight = item
            items.append(self._work_item(request))
            budget -= item.num_tokens
        return budget

    def _admit(self, items: list[WorkItem], new: list[RequestSetup], budget: int) -> None:
        self.waiting.sort(key=lambda r: (r.params.priority, r.arrival_time))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.kv.can_allocate(request.kv_tokens, request.num_loops):
                break  # FIFO within priority: do not let later requests overtake
            self.waiting.pop(0)
            self.kv.allocate(request.request_id, request.kv_tokens, request.num_loops)
            request.status = RequestStatus.RUNNING
            request.admitted = True
            self.running.append(request)
            new.append(
                RequestSetup(request.request_id, request.params, request.num_loops, request.seed)
            )
            request.in_flight = self._next_chunk(request, budget)
            items.append(self._work_item(request))
            budget -= request.in_flight.num_tokens

    def _next_chunk(self, request: Request, budget: int) -> InFlight:
        start = request.num_prefilled
        n = min(self.config.prefill_chunk_size, request.num_prompt_tokens - start, budget)
        last = start + n == request.num_prompt_tokens
        return InFlight(
            start=start,
            num_tokens=n,
            depth=1,
            ends_at=request.num_loops,
            stop_at_exit=False,
            has_output=last and not request.output_token_ids,
        )

    def _next_decode(self, request: Request) -> InFlight:
        full = self.kv.policy.kind == "full"
        return InFlight(
            start=request.num_prompt_tokens + request.num_decoded,
            num_tokens=1,
            depth=1,
            ends_at=request.num_loops if full else request.max_loops,
            stop_at_exit=not full,
            has_output=True,
        )

    def _work_item(self, request: Request) -> WorkItem:
        item = request.in_flight
        assert item is not None
        rid = request.request_id
        exit = None
        copy_blocks: list[int] = []
        if item.has_output:
            exit = exit_spec(request, item, self.has_gate, self.config.exit_mode)
            if item.stop_at_exit and self.kv.policy.copies_on_exit:
                copy_blocks = self.kv.exit_copy_blocks(
                    rid, item.start, item.depth, request.num_loops
                )
        params = request.params
        penalties = None
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            penalties = (request.prompt_token_ids, request.output_token_ids)
        return WorkItem(
            request_id=rid,
            start=item.start,
            num_tokens=item.num_tokens,
            depth=item.depth,
            ends_at=item.ends_at,
            stop_at_exit=item.stop_at_exit,
            block_table=self.kv.table_for_depth(rid, item.depth),
            token_ids=(
                [request.token_at(p) for p in range(item.start, item.start + item.num_tokens)]
                if item.depth == 1
                else None
            ),
            boundary_table=self.kv.boundary_table(rid) if self.has_boundary else None,
            exit=exit,
            exit_copy_blocks=copy_blocks,
            penalty_tokens=penalties,
        )

    # ---------------------------------------------------------------- results

    def apply(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Applies a step's result to the requests it planned for."""
        self.num_steps += 1
        if result.error is not None:
            return self._fail_planned(plan, result.error)
        updates: dict[str, RequestUpdate] = {}
        for work, outcome in zip(plan.items, result.items):
            request = self.requests.get(work.request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            item = request.in_flight
            assert item is not None and item.depth == work.depth and item.start == work.start
            exited = False
            if outcome is not None and item.has_output:
                item.survival, item.cdf = outcome.survival, outcome.cdf
                if self.config.exit_mode == "delayed":
                    item.exit_pending = delayed_wants_exit(request, item.depth, outcome.cdf)
                if outcome.exited:
                    exited = True
                    item.has_output = False
                    update = updates.setdefault(request.request_id, RequestUpdate(work.request_id))
                    self._append_token(request, work.depth, outcome, update)
                    if request.is_finished:
                        continue
            if item.depth >= item.ends_at or (item.stop_at_exit and exited):
                self._complete_item(request, item)
            else:
                item.depth += 1
        return list(updates.values())

    def _append_token(self, request: Request, depth: int, outcome, update: RequestUpdate) -> None:
        token = outcome.token_id
        request.output_token_ids.append(token)
        request.exit_depths.append(depth)
        request.logprobs.append(outcome.logprob)
        request.top_logprobs.append(outcome.top_logprobs)
        update.new_token_ids.append(token)
        update.new_exit_depths.append(depth)
        update.new_logprobs.append(outcome.logprob)
        update.new_top_logprobs.append(outcome.top_logprobs)
        reason = self._stop_reason(request, token)
        if reason is not None:
            self._finish(request, reason)
            update.finish_reason = reason

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        n = len(request.output_token_ids)
        if n >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                return FinishReason.STOP
        if n >= params.max_tokens or request.num_prompt_tokens + n >= request.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _complete_item(self, request: Request, item: InFlight) -> None:
        request.in_flight = None
        if not request.prefill_done:
            request.num_prefilled += item.num_tokens
        else:
            request.num_decoded += 1

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.in_flight = None
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        if request.admitted:
            self.kv.free(request.request_id)
            self._released.append(request.request_id)
        del self.requests[request.request_id]

    def _fail_planned(self, plan: StepPlan, error: str) -> list[RequestUpdate]:
        updates = []
        for work in plan.items:
            request = self.requests.get(work.request_id)
            if request is None or request.is_finished:
                continue
            request.error = error
            self._finish(request, FinishReason.ERROR)
            updates.append(
                RequestUpdate(work.request_id, finish_reason=FinishReason.ERROR, error=error)
            )
        return updates
