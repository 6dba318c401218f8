"""Standing decode tokens: with synchronous scheduling, a carried decode token that ends is
advanced in place to its request's next position when the runner can continue it there.

Torch-free; part of the scheduler (it reads and writes ``Scheduler._carried``). A decode batch
ends a token per request every few steps, and each used to come back to the planner as a
starter: a new ``InFlight``, the continuation checks (``ItemMaker.continuation``), its blocks
and its commit (``Scheduler._continues``), about 3.5 us per token, a quarter of a 256-row
decode cycle's host work. The applier touches the request at the token's end anyway, so there
(``apply_ends``, given a result's ends) the token's ``InFlight`` becomes its successor's (same
object, next position, a new key) and the next plan lists it in ``StepPlan.continued``, in the
runner's row order with the planner's own continuations (``take``): the runner's side is
unchanged.

The planner's decisions stay what they were: a token stands only where its next position lies
in its KV block (a block start takes blocks, maybe preempting, in the planner's order:
``_start_items``), the request has no other item, and everything ``ItemMaker.continuation``
asks holds; and fresh tokens take their rows of the step in the planner's order (``seat``).
Only with synchronous scheduling (each result applied before the next plan: under async the
planner continues a token whose last loop is planned before its end is applied) and under
``refill`` (``no_refill`` starts nothing while a cohort runs).

Semantics kept: a token advanced here (*fresh*) is not in the step being built until that step
is emitted, so preemption may still take its request (``Scheduler.in_step``), exactly as a
request between two tokens; a preempted or finished request's fresh token is left out of the
plan (its key is gone from ``_carried``), and preempting it needs no roll-back: its position is
the next output's, where a preemption between tokens leaves the request too (its blocks all go).
Budget: a fresh token takes a row of the step as a planner continuation does, among the
starters in (priority, arrival) order, while rows are left (``seat``); one left without (a
budget too short for every starter) goes back to its ended state for the planner (``undo``).
When the budget holds every starter's most, the order cannot matter and nothing is walked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rltserve.core.exit import fixed_exit_depth
from rltserve.core.request import InFlight, Request, Resume

if TYPE_CHECKING:
    from rltserve.core.scheduler import Scheduler


class Standing:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.kv = scheduler.kv
        self.carried = scheduler._carried  # (the scheduler's, never replaced)
        self.has_boundary = scheduler.has_boundary
        self.block_size = scheduler.kv.block_size
        # Tokens that ended since the last plan, in the runner's row order (its events'): (request
        # id, the ended token's key, the item advanced in place, or None: left to the planner).
        self._fresh: list[tuple[str, int, InFlight | None]] = []
        self.fresh_ids: set[str] = set()  # their requests (``Scheduler.in_step``)

    def apply_ends(self, ends: list[tuple[Request, InFlight]]) -> None:
        """The ends of carried tokens in one result, in the runner's order, their exits applied:
        each token whose request still runs becomes its request's next decode token in place
        when it can continue there; any other is forgotten and out of its request's items,
        left to the planner (its place kept for ``take``). (One loop for a decode batch's
        ends, its names bound once: a call per token would cost a tenth more.)"""
        kv, carried, block_size = self.kv, self.carried, self.block_size
        depth_tables, extend = kv.depth_tables, kv.extend
        has_boundary = self.has_boundary
        fresh, fresh_ids = self._fresh, self.fresh_ids
        s = self.s
        key = s._carry_key
        step = s._step_id + 1
        for request, item in ends:
            previous = item.carry_key
            if previous not in carried:
                continue  # its request finished or was aborted by a later event
            at = item.start + 1
            prev = request.carry_prev  # (``Request.carry_prev``: this item's, when it may stand)
            produces = item.output_index + 1
            rid = request.request_id
            # What ``ItemMaker.continuation`` asks, and the next position in the same KV block.
            if (
                at % block_size == 0  # (a new KV block: the planner takes it)
                or len(request.items) != 1
                or item.exit_depth is None
                or at != request.num_scheduled  # (no rollback: never, without drafts)
                or at <= request.replay_until  # (recorded inputs: forced thinking tokens)
                or prev is None
                or prev[0] is not item
                or produces >= request.max_outputs  # (``decode_item``'s two limits)
                or prev[1] is not depth_tables(rid)
                or (has_boundary and prev[3] is not kv.boundary_table(rid))
                or (request.exit_mode == "fixed" and fixed_exit_depth(request, produces) != prev[2])
                or extend(rid, at + 1)  # (0: covered, now recorded; else nothing changed)
            ):
                del carried[previous]
                request.items.remove(item)
                fresh.append((rid, previous, None))
                continue
            request.num_scheduled = at + 1
            if request.resume is Resume.RECOMPUTE:
                request.resume = Resume.NONE  # (past ``replay_until``: back where it was)
            del carried[previous]
            key += 1
            carried[key] = (request, item)
            # What ``ItemMaker.decode_item``, ``Scheduler._commit`` and ``_carry`` give a new
            # item, written out (every token of a decode batch comes here); the rest is the
            # same (cap, exit rule, epoch, life, copy-on-exit blocks of the block, and
            # ``planned``, 1 for a carried token, whose loops count from ``carry_step``). Its
            # request's ``carry_prev`` holds it, and so moves on with it.
            item.start = at
            item.output_index = produces
            item.applied = 0
            item.exit_depth = None
            item.delayed_exit_at = None
            item.carry_key = key
            item.carry_step = step
            item.wake = step + item.exit_by
            fresh.append((rid, previous, item))
            fresh_ids.add(rid)
        s._carry_key = key

    def seat(self, starters: list[Request], budget: int) -> tuple[int, set[str]]:
        """The fresh tokens' rows in the step being built (``budget``: what is left before the
        starters, fresh tokens' rows not yet taken), taken as the planner's continuations take
        theirs: in the starters' order, each while rows are left. When the budget holds every
        starter's most (a prompt or replay chunk, else a row) and the fresh tokens', the order
        cannot matter: returns the budget less their rows and no fresh request. Else they join
        ``starters`` and ``Scheduler._start_items`` seats them in turn (``undo`` for those it
        does not reach); returns the budget and their requests."""
        fresh = self.fresh_ids
        chunk = self.s.config.prefill_chunk_size
        need = len(fresh)
        for r in starters:
            decoding = r.num_scheduled >= r.num_prompt_tokens and r.num_scheduled >= r.replay_until
            need += 1 if decoding else chunk
        if need <= budget:
            return budget - len(fresh), set()
        requests = self.s.requests
        starters += [requests[rid] for rid in fresh]
        return budget, set(fresh)

    def undo(self, requests: list[Request]) -> None:
        """Fresh tokens left without a row (``seat``) go back to their ended state, for the
        planner to continue when rows are free, in its order (a request preempted meanwhile
        has dropped its token)."""
        where = {entry[0]: k for k, entry in enumerate(self._fresh) if entry[2] is not None}
        for request in requests:
            rid = request.request_id
            if rid not in self.fresh_ids:
                continue
            k = where[rid]
            _, previous, item = self._fresh[k]
            del self.carried[item.carry_key]
            item.carry_key = previous
            item.start -= 1
            item.output_index -= 1
            request.num_scheduled -= 1  # (the block stays covered: it is the request's)
            request.items.remove(item)
            self._fresh[k] = (rid, previous, None)  # (its place, were the planner to continue it)
            self.fresh_ids.discard(rid)

    def take(self, planned: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """``StepPlan.continued`` for the plan being emitted: the fresh tokens' entries (those
        of requests preempted or finished meanwhile left out) and the planner's own
        (``planned``), in the order their predecessors ended, which is the runner's row order:
        a decode batch keeps its rows' order from cycle to cycle, which the runner's fast paths
        rely on (a refilled batch takes the ended rows' columns as they are, and its inputs are
        the sampling step's rows in order). None is fresh after."""
        carried = self.carried
        by_request = {entry[0]: entry for entry in planned} if planned else {}
        continued = []
        for rid, previous, item in self._fresh:
            if item is not None:
                if item.carry_key in carried:
                    continued.append((rid, previous, item.carry_key))
            elif by_request:
                entry = by_request.get(rid)
                if entry is not None and entry[1] == previous:  # (it continues this one)
                    continued.append(by_request.pop(rid))
        if by_request:  # (continuing tokens that ended earlier: after the others)
            continued += by_request.values()
        self._fresh = []
        self.fresh_ids = set()
        return continued
