"""Scheduler: owns request progress; decides each step's work and applies its results.

Torch-free. Work is planned at loop granularity (continuous depth batching): every running
request contributes at most one work item per step, at whatever depth it has reached, and a
token that exits frees its row for new work in the very next step.

- refill (default): any step may start new items at depth 1 (new prompt chunks, new decode
  tokens, newly admitted requests) beside other requests' deeper loops;
- no_refill: a cohort of items runs in lockstep; new items start only once every item of the
  previous cohort has planned its last loop (the static baseline).

Planning may run one step ahead of results (async scheduling): an item's next loop is planned
only once what it depends on is known, from the plan itself (fixed depths, the delayed exit rule)
or from applied results; a decode token's input (the last sampled token) stays on the runner.

Budgets per step: ``max_num_batched_tokens`` rows in all; ``max_num_seqs`` running requests.

Carried decode tokens (``carry_decode``, ``plan.Carry``): a decode token whose request has no
drafts and no explicitly planned item in flight is planned once; the runner runs one loop of it
every step until it ends. The scheduler skips such a request until something about the token
can be known: an event in a result (exit, delayed decision, end) or a loop count (a carried
token's loops planned = steps since its first, so its cap, fixed exit and last loop are known
without a result, as for a planned item). Its row counts against every budget meanwhile.
With synchronous scheduling most ended tokens continue where their end is applied: the applier
advances them in place (``standing.py``); the planner continues the rest (block starts).

KV (DESIGN §8). ``kv_reservation="full"``: admission reserves a request's whole context on every
plane, so a running request never runs out. ``"ondemand"`` (default): a new item takes the
blocks of its positions on every plane when it is planned; admission checks the first item plus
a watermark. When an item cannot get its blocks, requests are preempted (``preemption.py``):
the worst by (priority, arrival) among the running requests the step being built does not use
(possibly the asking request itself). A preempted request goes back to waiting; on resume its
positions are recomputed depth-faithfully, or its complete positions come back from swap space.
Steps execute in submission order, so KV freed while a submitted step still uses it is only
reused by later steps, and a result of a preempted incarnation (``InFlight.life``) is dropped.

Prefix caching and groups (``prompt_sharing.py``): admission starts a request after its cached
prefix; a prompt item's applied last loop caches full blocks; followers wait for their leader.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from operator import attrgetter

from rltserve.config import SchedulerConfig
from rltserve.core.admission import Admission
from rltserve.core.applier import Applier
from rltserve.core.exit import choose_exit_mode, exit_known
from rltserve.core.kv_cache import KVManager
from rltserve.core.plan import RequestSetup, StepPlan, StepResult, WorkItem
from rltserve.core.preemption import Preemptor
from rltserve.core.prompt_sharing import PromptSharing, final_positions
from rltserve.core.request import FinishReason, InFlight, Request, RequestStatus, Resume
from rltserve.core.request_checks import POOL_ADVICE
from rltserve.core.standing import Standing
from rltserve.core.swap import SwapSpace
from rltserve.core.wavefront import CARRIED, OVER, PLAN, WAIT, Wavefront
from rltserve.core.work_items import ItemMaker
from rltserve.updates import RequestUpdate, StepUpdates

_SEQ = attrgetter("seq")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        *,
        has_gate: bool,
        has_boundary: bool,
        reservation: str = "full",
        watermark: float = 0.0,
        swap: SwapSpace | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``reservation``: "full" or "ondemand" (``CacheConfig.kv_reservation``);
        ``watermark``: fraction of the pool on-demand admission leaves free; ``swap``: host
        swap space (None: preemption recomputes); ``clock``: what stamps a request's first
        scheduling (``Request.arrival_time``'s clock)."""
        self.config = config
        self.clock = clock
        self.kv = kv
        self.has_gate = has_gate
        self.has_boundary = has_boundary
        self.ondemand = reservation == "ondemand"
        self.watermark_blocks = int(watermark * kv.pool.num_total)
        self.priority = config.scheduling_policy == "priority"
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.item_maker = ItemMaker(config, kv, has_boundary)
        self.preemptor = Preemptor(self, swap)
        self.wavefront = Wavefront(self)
        self.sharing = PromptSharing(self)
        self.admission = Admission(self)
        self.applier = Applier(self)
        self._released: list[str] = []
        self._continued: list[tuple[str, int, int]] = []  # ``StepPlan.continued`` being built
        self._moved: list[tuple] = []  # ... and ``StepPlan.moved``
        self.new_setups: list[RequestSetup] = []
        self._step_id = 0
        self._seq = 0
        # Requests with a planned item in the step being built (``in_step`` finds those whose
        # carried token runs in it through ``_carried``).
        self._in_step: set[str] = set()
        # step id -> the InFlight record behind each planned WorkItem, until its result is applied
        self._planned: dict[int, list[InFlight]] = {}
        # Carried decode tokens the runner may still run (``Carry.key`` -> owner), until a
        # result says they ended or their request stops running. Each is one row of every step
        # planned meanwhile: known exactly once the previous step's result is applied, an
        # upper bound while it is in flight (async scheduling).
        self._carried: dict[int, tuple[Request, InFlight]] = {}
        self._carry_key = 0
        # Synchronous scheduling: ended tokens advanced in place by the applier (``standing``).
        sync = not (config.async_scheduling or config.scheduling == "no_refill")
        self.standing = Standing(self) if config.carry_decode and sync else None
        # Requests finished since the last ``apply`` began (for a failed apply's caller).
        self.finished_ids: list[str] = []

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r}: already in use")
        need = self.kv.blocks_needed(request.kv_tokens, request.num_loops)
        if need > self.kv.pool.num_total:
            # (No request id: the caller knows its request, an HTTP client not our id for it.)
            planes = len(self.kv.planes_of(request.num_loops))
            raise ValueError(
                f"the request needs {need} KV blocks ({request.kv_tokens} tokens of prompt and "
                f"output on {planes} KV planes, for {request.num_loops} loops) but the pool has "
                f"{self.kv.pool.num_total}{POOL_ADVICE}"
            )
        request.exit_mode = choose_exit_mode(request, self.has_gate, self.config.exit_mode)
        if request.exit_mode != "fixed" and not self.has_gate:
            request.criterion = request.params.exit_criterion or "kl"
        request.seq = self.next_seq()
        self.requests[request.request_id] = request
        self.admission.enqueue(request)
        self.sharing.on_add(request)

    def abort(self, request_id: str) -> RequestUpdate | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, FinishReason.ABORT)
        return RequestUpdate(request_id, finish_reason=FinishReason.ABORT)

    def next_seq(self) -> int:
        """The next place in arrival order (a time-sliced request queues again as if it came
        in now)."""
        self._seq += 1
        return self._seq - 1

    @property
    def next_step_id(self) -> int:
        """The id of the step being built (or the next one)."""
        return self._step_id + 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def order_key(self, request: Request) -> tuple[int, int]:
        """Admission order (lower first) and preemption order (higher first): priority, then
        arrival, under ``scheduling_policy="priority"``; arrival alone under ``"fcfs"``."""
        return request.sort_key if self.priority else (0, request.seq)

    # ---------------------------------------------------------------- planning

    def schedule(self) -> StepPlan | None:
        """Plans the next step, or returns None when nothing can run until a result arrives."""
        budget = self.config.max_num_batched_tokens
        items: list[WorkItem] = []
        owners: list[InFlight] = []
        busy = False  # some item still has loops to plan
        self._in_step = set()
        self.preemptor.begin_step()
        self.preemptor.admit_by_priority()
        self.preemptor.rotate()
        starters = []
        ended: set[Request] = set()  # starters whose only item is a carried token that ended
        carried = self._carried
        fresh = self.standing.fresh_ids if self.standing is not None else ()
        # Rows the runner carries into this step (at most); fresh tokens take theirs among
        # the starters, as the planner's continuations do (``Standing.seat``).
        budget -= len(carried) - len(fresh)
        busy = bool(carried)
        step = self._step_id + 1
        for request in self.running:
            request_items = request.items
            if not request_items:
                starters.append(request)  # nothing in flight: its next item may start
                continue
            last = request_items[-1]
            if last.wake > step:
                continue  # its token runs on the runner, its exit not known before ``wake``
            if (
                len(request_items) == 1
                and last.carry_key in carried
                and self._next_loop(request, last) == OVER
            ):
                # (What ``_continue_items`` finds, sooner: the token's last loop is planned,
                # its end not yet applied (async scheduling), so its next token may start.)
                starters.append(request)
                ended.add(request)
                continue
            budget, request_busy, may_start = self._continue_items(request, items, owners, budget)
            busy = busy or request_busy
            if may_start:
                starters.append(request)
        if not (self.config.scheduling == "no_refill" and busy):
            if fresh:
                budget, fresh = self.standing.seat(starters, budget)
            # The best get blocks first (fcfs: arrival order, which a C-speed key gives).
            starters.sort(key=self.order_key if self.priority else _SEQ)
            budget = self._start_items(starters, items, owners, budget, ended, fresh)
            self.admission.admit(items, owners, budget)
        changes = self.preemptor.take_changes()
        copies = self.sharing.take_copies()
        continued = self._continued
        if self.standing is not None and self.standing._fresh:
            continued = self.standing.take(continued)  # (in the runner's row order)
        if not (items or self._released or any(changes) or continued or self._carries_on()):
            return None
        self._step_id += 1
        plan = StepPlan(
            self._step_id,
            items,
            self.new_setups,
            self._released,
            *changes,
            copies,
            continued,
            self._moved,
        )
        self.new_setups, self._released, self._continued, self._moved = [], [], [], []
        self._planned[plan.step_id] = owners
        return plan

    def _continue_items(
        self, request: Request, items: list[WorkItem], owners: list[InFlight], budget: int
    ) -> tuple[int, bool, bool]:
        """Plans the next loop of each of the request's items that is ready. Returns the budget
        left, whether an item still has loops to plan, and whether a new item may enter loop 1
        in this step (``Wavefront.may_start``, judged on the state before this step's planning).

        Wavefront rule: an item's loop d also needs the previous item's loop d planned in an
        earlier step (it writes the plane-d KV the item attends to). Items are visited last to
        first, so the previous item's progress (and state) is still the one from earlier
        steps.
        """
        request_items = request.items
        next_loop = self._next_loop
        states = [next_loop(request, it) for it in request_items]
        may_start = self.wavefront.may_start(request, states)
        if request.lockstep:
            budget, busy = self.wavefront.continue_lockstep(request, states, items, owners, budget)
            return budget, busy, may_start
        busy = False
        over = []
        for k in range(len(states) - 1, -1, -1):
            item = request_items[k]
            state = states[k]
            if state == OVER:
                over.append(item)
                continue
            busy = True
            if state in (WAIT, CARRIED) or budget < item.num_tokens:
                continue
            # (A carried predecessor runs a loop every step from an earlier start: always ahead.)
            if (
                k > 0
                and request_items[k - 1].planned <= item.planned
                and states[k - 1] not in (OVER, CARRIED)
            ):
                continue
            budget -= self._plan_loop(request, item, items, owners)
        for item in over:
            if not item.carry_key or item.carry_key not in self._carried:
                request_items.remove(item)  # (a carried one once its last result is applied)
        return budget, busy, may_start

    def _next_loop(self, request: Request, item: InFlight) -> str:
        done = self._planned_loops(item)
        if item.carry_key:
            if item.carry_key not in self._carried or done >= item.ends_at:
                return OVER
            return OVER if item.stop_at_exit and exit_known(request, item, done) else CARRIED
        if done >= item.ends_at:
            return OVER
        if not item.stop_at_exit:
            return PLAN
        known = exit_known(request, item, done)
        if known is None:
            return WAIT
        return OVER if known else PLAN

    def _carries_on(self) -> bool:
        """Whether a carried token may run a loop in the step being built (the runner runs it
        even in a plan without items)."""
        return any(self._next_loop(r, item) == CARRIED for r, item in self._carried.values())

    def _planned_loops(self, item: InFlight) -> int:
        """Loops of ``item`` planned before the step being built: a carried token runs one in
        every step from its first."""
        if item.carry_key:
            return min(self._step_id + 1 - item.carry_step, item.ends_at)
        return item.planned

    def _plan_loop(
        self, request: Request, item: InFlight, items: list[WorkItem], owners: list[InFlight]
    ) -> int:
        self._in_step.add(request.request_id)
        item.planned += 1
        items.append(self.item_maker.work_item(request, item, item.planned))
        owners.append(item)
        return item.num_tokens

    def _start_items(
        self,
        starters: list[Request],
        items: list[WorkItem],
        owners: list[InFlight],
        budget: int,
        ended: set[Request],
        fresh: Collection[str] = (),
    ) -> int:
        """New depth-1 items: next prompt chunks and next decode tokens (``ended``: starters
        known to have only ended carried tokens, ``_ended``; ``fresh``: starters with a fresh
        token, which takes a row, ``Standing.seat``)."""
        maker = self.item_maker
        # (Bound once: most decode tokens of a step come through the first branch.)
        running, continuation, extend = RequestStatus.RUNNING, maker.continuation, self.kv.extend
        for k, request in enumerate(starters):
            if budget <= 0:
                if fresh:  # (those left without a row wait, as planner continuations would)
                    self.standing.undo([r for r in starters[k:] if r.request_id in fresh])
                break
            if request.status is not running:
                continue  # preempted for an earlier starter of this step
            if fresh and request.request_id in fresh:
                budget -= 1
                continue
            if request.carry_prev is not None and (
                not request.items or request in ended or self._ended(request)
            ):
                # A decode token the runner continues from the request's previous one (under
                # synchronous scheduling mostly at block starts: the others stand in place).
                item = continuation(request)
                if item is not None:
                    end = item.start + 1
                    # (A new block every block_size tokens.)
                    if extend(request.request_id, end) and not self._grow(request, end):
                        continue
                    self._continues(request, item)
                    budget -= 1
                    continue
            item = maker.next_item(request, budget)
            if item is None:  # every output is planned (the request ends with its last
                continue  # result), or what its next position is waits for a result
            rid = request.request_id
            # (Most decode tokens' blocks are there already: no room to make.)
            if self.kv.extend(rid, item.end) and not self._grow(request, item.end):
                continue
            budget -= self.start(request, item, items, owners)
            if request.num_scheduled < request.replay_until:
                budget = self.wavefront.start_runs(request, item, items, owners, budget)
        return budget

    def _grow(self, request: Request, end: int) -> bool:
        """Takes the blocks that cover the request's positions ``[0, end)`` (``KVManager.extend``
        said some are needed), preempting for them; False when it waits for blocks or was
        preempted itself."""
        if not self.preemptor.make_room(request, end):
            return False
        self.kv.grow(request.request_id, end)
        return True

    def start(
        self, request: Request, item: InFlight, items: list[WorkItem], owners: list[InFlight]
    ) -> int:
        """Commits ``item`` (the request's next, its blocks taken) and plans its first loop;
        a decode token the runner will carry gets its key. Returns the item's tokens."""
        maker = self.item_maker
        carried = item.has_output and maker.carries_next(request)  # (before it moves on)
        self._commit(request, item)
        if not carried:
            return self._plan_loop(request, item, items, owners)
        item.exit_by = maker.exit_known_by(request, item)
        self._carry(request, item)
        items.append(maker.carried_item(request, item))
        owners.append(item)
        return 1

    def _continues(self, request: Request, item: InFlight) -> None:
        """Commits ``item`` (``ItemMaker.continuation``, its blocks taken), the continuation
        of the request's carried token: its first loop reports as a carried event, so it has
        no owner to apply; in a new KV block its new tables go in ``StepPlan.moved``."""
        self._commit(request, item)
        key = self._carry(request, item)
        last, tables, exit_at, boundary, life = request.carry_prev
        if item.start % self.kv.block_size == 0:  # the first position of a KV block
            moved = self.item_maker.moved(request, item)
            self._moved.append(moved)
            tables, boundary = self.kv.depth_tables(request.request_id), moved[2]
        request.carry_prev = (item, tables, exit_at, boundary, life)
        self._continued.append((request.request_id, last.carry_key, key))

    def _commit(self, request: Request, item: InFlight) -> None:
        """Makes ``item`` (its blocks taken) the request's newest. (``Standing.apply_ends``
        writes this and ``_carry`` out for a decode batch: a change here goes there too.)"""
        request.num_scheduled = item.end
        if item.start < request.num_prompt_tokens:
            request.chunk_starts.append(item.start)
        if request.resume is Resume.RECOMPUTE and item.end > request.replay_until:
            request.resume = Resume.NONE  # back where it was preempted
        request.items.append(item)

    def _carry(self, request: Request, item: InFlight) -> int:
        """Gives ``item`` (committed, a decode token, its ``exit_by`` set) to the runner to
        carry, its first loop in the step being built; returns its key."""
        key = self._carry_key = self._carry_key + 1
        item.carry_key = key
        item.carry_step = self._step_id + 1
        item.planned = 1
        item.wake = item.carry_step + item.exit_by
        self._carried[key] = (request, item)  # (which ``in_step`` reads)
        return key

    def _ended(self, request: Request) -> bool:
        """Whether every item of the request is a carried token that has ended (its last loop
        was planned in an earlier step): the runner can continue the newest."""
        return all(it.carry_key and self._next_loop(request, it) == OVER for it in request.items)

    # ---------------------------------------------------------------- results

    def apply(self, plan: StepPlan, result: StepResult) -> StepUpdates:
        """Applies a step's result to the requests it planned for (in submission order;
        ``applier.py``). ``finished_ids`` then lists the requests it finished, also when it
        raises."""
        self.finished_ids = []
        return self.applier.apply(plan, self._planned.pop(plan.step_id), result)

    def drop_carried(self, request: Request) -> None:
        """Forgets the request's carried tokens (it stops running: the runner drops them)."""
        for item in request.items:
            if item.carry_key:
                self._carried.pop(item.carry_key, None)
        if self.standing is not None:
            self.standing.fresh_ids.discard(request.request_id)  # (and left out of the plan)

    def in_step(self, request: Request) -> bool:
        """Whether the step being built uses the request's blocks: it has an item planned in
        it, or a carried token the runner runs in it."""
        rid = request.request_id
        if rid in self._in_step:
            return True
        if self.standing is not None and rid in self.standing.fresh_ids:
            return False  # advanced in place, as if between tokens (``standing.py``)
        carried = self._carried
        return any(item.carry_key in carried for item in request.items if item.carry_key)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends the request: out of the queues, its KV freed, the runner told to drop it."""
        was_waiting = request.status is RequestStatus.WAITING
        request.finish_reason = reason
        self.finished_ids.append(request.request_id)
        final = final_positions(request)  # (before its items go)
        self.drop_carried(request)
        request.items.clear()
        if request in self.running:
            self.running.remove(request)
        if was_waiting and request in self.waiting:  # (no scan per running one: quadratic)
            self.waiting.remove(request)
        # (Only now: a finish that raised before this is repeated by the engine's recovery,
        # which must still find the request waiting.)
        request.status = RequestStatus.FINISHED
        self.sharing.forget(request)
        if request.admitted:
            self.sharing.release(request)
            if reason is not FinishReason.ERROR:  # (an abort too: stop strings end with one)
                self.sharing.on_finished(request, final)
            self.kv.free(request.request_id)
            self._released.append(request.request_id)
        elif self.preemptor.forget(request):
            self._released.append(request.request_id)  # the runner drops what it kept
        del self.requests[request.request_id]
