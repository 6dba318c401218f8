"""Admission (DESIGN §8): which waiting requests join the step being built, and the blocks
admitting one takes.

Torch-free; works on the scheduler's queues. Requests are admitted in (priority, arrival)
order (arrival alone under fcfs) while seats (``max_num_seqs``), KV and the step's token budget
allow, never past one that does not fit (no overtaking). ``kv_reservation="full"`` reserves a
request's whole context; on-demand admission checks its first item plus the watermark, and a
resumed request the positions it had (``preemption.resume_tokens``), one that preempted itself
those it was growing to (``Request.resume_need``). A request with a cached
prefix starts after it (``prompt_sharing.py``); a group's follower waits for its leader. On a
PD decode stage a request's moved prompt KV (``Request.transfer``) is read when the request is
next in line and the pool has room for its prompt (DESIGN §8's admission contract), so its
blocks are hit in that admission rather than evicted while it waits; not in a plan that swaps a
victim out (the read runs before the plan's swap-out copies the victim's blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rltserve.core.plan import RequestSetup, WorkItem
from rltserve.core.preemption import resume_tokens
from rltserve.core.prompt_sharing import NO_HIT, Hit
from rltserve.core.request import InFlight, Request, RequestStatus

if TYPE_CHECKING:
    from rltserve.core.scheduler import Scheduler


class Admission:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        # Reads a request's transfer file into the prefix cache (the engine's: it needs the
        # device pool); None drops the file's KV unread.
        self.importer: Callable[[Request, str], None] | None = None
        # ``waiting`` may be out of order: ``admit`` sorts it only then (a sort on every step
        # calls ``order_key`` per waiting request per step: quadratic in a batch of thousands).
        self.unsorted = False

    def enqueue(self, request: Request) -> None:
        """Queues a new or preempted request last (its ``order_key`` fixed while it waits),
        noting when that breaks the queue's order."""
        s = self.s
        if s.waiting and s.order_key(request) < s.order_key(s.waiting[-1]):
            self.unsorted = True
        s.waiting.append(request)

    def head(self) -> Request:
        """The first of the (non-empty) waiting queue in admission order."""
        self._sort()
        return self.s.waiting[0]

    def _sort(self) -> None:
        if self.unsorted:  # (in order otherwise: ``enqueue``)
            self.s.waiting.sort(key=self.s.order_key)
            self.unsorted = False

    def blocks(self, request: Request, item: InFlight, hit: Hit = NO_HIT) -> int:
        """Free blocks admitting ``request`` with first item ``item`` needs (watermark
        included: on-demand admission keeps it free for running requests to grow into), less
        the cached blocks ``hit`` shares."""
        s = self.s
        loops = request.num_loops
        shared = s.sharing.admission_blocks(request, hit)
        if not s.ondemand:
            return s.kv.blocks_needed(request.kv_tokens, loops) + shared
        tokens = max(item.end, resume_tokens(request), request.resume_need)
        need = s.kv.blocks_needed(tokens, loops) + shared
        return need + (s.watermark_blocks if s.running else 0)

    def admit(self, items: list[WorkItem], owners: list[InFlight], budget: int) -> None:
        """Admits waiting requests in (priority, arrival) order while seats, KV and the token
        budget allow, each with its first item planned in the step being built."""
        s = self.s
        self._sort()
        i = reserved = 0
        while i < len(s.waiting) and budget > 0:
            request = s.waiting[i]
            if s.preemptor.preempted_now(request):
                break  # no re-admission in the step that preempted it
            if len(s.running) + reserved >= s.config.max_num_seqs:
                break
            if s.sharing.waits(request):
                # A prefix another request computes; a follower keeps its seat (else it may
                # come too late and recompute its leader's prompt).
                reserved += s.sharing.waits_for_leader(request)
                i += 1
                continue
            if request.transfer is not None:
                # The file is read into the pool now (on the step thread, after the steps
                # already submitted): not into a victim's blocks this plan swaps out, which
                # hold its KV until the plan runs (the swapped KV came back overwritten).
                if s.preemptor.swapping_out or not self._room_for_transfer(request):
                    break  # (its file waits; a later step reads it)
                path, request.transfer = request.transfer, None
                if self.importer is not None:
                    self.importer(request, path)
            hit = s.sharing.lookup(request)
            before = request.num_scheduled
            request.num_scheduled = max(before, hit.start)
            item = s.item_maker.next_item(request, budget)
            if item is None:  # (a shared/ring prompt chunk the budget left does not hold)
                request.num_scheduled = before
                break
            if self.blocks(request, item, hit) > s.kv.num_free_blocks:
                request.num_scheduled = before
                break  # in order: do not let later requests overtake
            s.waiting.pop(i)
            rid = request.request_id
            tokens = max(item.end, request.swapped_tokens) if s.ondemand else request.kv_tokens
            s.kv.allocate(rid, tokens, request.num_loops, hit.entries)
            s.sharing.admitted(request, hit)
            replay = max(0, resume_tokens(request) - request.swapped_tokens)
            s.preemptor.restore(request)
            request.status = RequestStatus.RUNNING
            request.admitted = True
            if request.first_scheduled_time is None:  # (not a preempted one's re-admission)
                request.first_scheduled_time = s.clock()
            request.admitted_step = s.next_step_id
            request.admitted_outputs = len(request.output_token_ids)
            request.admitted_replay = replay
            s.running.append(request)
            penalties = _uses_penalties(request)
            # A guide is advanced over the tokens sampled before a preemption (``LiveRequest``).
            replayed = penalties or request.params.structured_outputs is not None
            s.new_setups.append(
                RequestSetup(
                    rid,
                    request.params,
                    request.num_loops,
                    request.seed,
                    list(request.prompt_token_ids) if penalties else None,
                    num_sampled=len(request.output_token_ids) - request.num_forced,
                    output_token_ids=list(request.output_token_ids) if replayed else None,
                    banned_ids=request.banned_ids,
                    banned_below=request.num_prompt_tokens - 1 + request.params.min_tokens,
                    epoch=request.epoch,
                )
            )
            budget -= s.start(request, item, items, owners)
            if request.num_scheduled < request.replay_until:
                budget = s.wavefront.start_runs(request, item, items, owners, budget)

    def _room_for_transfer(self, request: Request) -> bool:
        """Whether the pool has room for the request's prompt (its whole context with
        ``kv_reservation="full"``) and the watermark, as admitting it after the import takes:
        blocks read earlier would only be evicted again. With nothing running the file is read
        anyway (the pool frees nothing more by waiting; admission then decides as usual)."""
        s = self.s
        if not s.running:
            return True
        tokens = request.num_prompt_tokens if s.ondemand else request.kv_tokens
        need = s.kv.blocks_needed(tokens, request.num_loops) + s.watermark_blocks
        return need <= s.kv.num_free_blocks


def _uses_penalties(request: Request) -> bool:
    p = request.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
