"""Preemption under KV pressure (DESIGN §8): victim choice, swap-out/in bookkeeping, resume state.

Torch-free; works on the scheduler's queues. A victim is the worst running request by the
scheduler's ``order_key`` (priority, then arrival; arrival alone under fcfs) among those the step
being built does not use. Preempting frees every block and sends the request back to waiting:

- recompute: on resume every position is recomputed without sampling, prompt chunks at full
  depth and each generated token to its recorded exit depth (``Request.replay_until``); the
  runner keeps the request's sampling generator meanwhile and continues from it;
- swap: the blocks of the positions whose KV is final on every plane (all loops planned, inputs
  recorded) go to host swap space and come back into fresh blocks on resume; the positions after
  them are recomputed as above. When the swap space is full, the request is recomputed instead
  (``swap_fallbacks``).

Either way the continuation equals an uninterrupted run, and results of the preempted
incarnation still in flight are dropped by the scheduler (``InFlight.life``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rltserve.core.request import InFlight, Request, RequestStatus, Resume
from rltserve.core.swap import SwapSpace
from rltserve.kv_policy import KVPolicy

if TYPE_CHECKING:
    from rltserve.core.scheduler import Scheduler

log = logging.getLogger(__name__)
# Preemptions and swap fallbacks cost throughput an operator can buy back with a larger pool:
# the log says so at the first and every LOG_EVERY-th after (vLLM warns of its preemptions
# every 50), not at each one (a pressured engine preempts many times a second).
LOG_EVERY = 50


class Preemptor:
    def __init__(self, scheduler: Scheduler, swap: SwapSpace | None) -> None:
        self.s = scheduler
        self.swap = swap
        self.num_preemptions = 0
        self.swap_fallbacks = 0  # swap mode, swap space full: recomputed instead
        self.num_rotations = 0  # preemptions by time slicing (``rotate``), of num_preemptions
        self._preempted: list[str] = []
        self._swap_out: list[tuple[str, list[int]]] = []
        self._swap_in: list[tuple[str, list[int]]] = []
        self._now: set[str] = set()  # preempted while building the current step
        # Requests that were set to recompute since ``num_recomputing`` last looked (a
        # superset of those that still do: it drops the others).
        self._recomputing: set[str] = set()

    # ---------------------------------------------------------------- per step

    def begin_step(self) -> None:
        self._now = set()

    def take_changes(self) -> tuple[list[str], list, list]:
        """(preempted, swap_out, swap_in) for the plan being emitted."""
        out = (self._preempted, self._swap_out, self._swap_in)
        self._preempted, self._swap_out, self._swap_in = [], [], []
        return out

    def preempted_now(self, request: Request) -> bool:
        return request.request_id in self._now

    @property
    def swapping_out(self) -> bool:
        """Whether the plan being built swaps a victim out: its blocks are free here but hold
        its KV until the runner copies them out, as the plan runs."""
        return bool(self._swap_out)

    # ---------------------------------------------------------------- decisions

    def make_room(self, request: Request, num_tokens: int) -> bool:
        """Preempts until ``request`` can cover ``num_tokens`` positions; False when it cannot
        now. Victims are worse than ``request`` and not in the step being built. With none, a
        request that is the worst of all running preempts itself (its blocks serve the
        others); otherwise it waits for worse requests in the step to end or yield."""
        s = self.s
        rid = request.request_id
        key = s.order_key(request)
        while s.kv.blocks_to_grow(rid, num_tokens) > s.kv.num_free_blocks:
            worse = [r for r in s.running if s.order_key(r) > key]
            free_to_go = [r for r in worse if not s.in_step(r)]
            if free_to_go:
                self.preempt(max(free_to_go, key=s.order_key))
                continue
            if not worse and not s.in_step(request):
                self.preempt(request)
                request.resume_need = num_tokens  # (its re-admission waits for room for them)
            return False
        return True

    def admit_by_priority(self) -> None:
        """Priority policy, before a step is built: while the best waiting request cannot be
        admitted (seats or KV full), preempt the worst running request of strictly worse
        priority; none when all of them together do not hold the blocks it lacks (they would
        wait behind it while the pool idles)."""
        s = self.s
        if not (s.priority and s.ondemand and s.waiting):
            return
        best = s.admission.head()  # (no scan of the queue per step: it is kept in order)
        budget = s.config.max_num_batched_tokens
        kv = s.kv
        checked = False
        while True:
            item = s.item_maker.next_item(best, budget)
            seats = len(s.running) >= s.config.max_num_seqs
            short = 0 if item is None else s.admission.blocks(best, item) - kv.num_free_blocks
            if item is None or not (seats or short > 0):
                return
            worse = [r for r in s.running if r.params.priority > best.params.priority]
            if not worse:
                return
            if not checked:  # (what they hold only grows the free count as they go)
                held = self._held_blocks(worse)
                if len(worse) == len(s.running):  # (none left running: no watermark to keep)
                    held += s.watermark_blocks
                if held < short:
                    return
                checked = True
            self.preempt(max(worse, key=s.order_key))

    def rotate(self) -> None:
        """Time slicing (``preemption_time_slice`` = q > 0, on-demand KV), before a step is
        built: while the first waiting request is a preempted one that has waited q steps and
        blocks keep it out, preempt a running request that has run q steps more than the
        positions its admission recomputed and produced a token since (a slice spent replaying
        would only buy the next replay). Under swap the victim is the one furthest ahead in
        outputs (a swap costs about the same for any request, so they take turns by progress
        and end together), under recompute the one with the fewest (it replays what it
        wrote); ties: admitted first. Each victim queues as a new arrival, behind the request
        it makes room for. Without this, requests preempted early wait for the first ones to
        end and then run their whole remainder alone, while the pool stands partly empty."""
        s = self.s
        q = s.config.preemption_time_slice
        if not (q and s.ondemand and s.waiting):
            return
        head = s.admission.head()
        step = s.next_step_id
        if not head.num_preemptions or step - head.preempted_step < q:
            return
        if len(s.running) >= s.config.max_num_seqs or s.sharing.waits(head):
            return  # seats or a leader's prefix, not blocks, keep it out
        item = s.item_maker.next_item(head, s.config.max_num_batched_tokens)
        if item is None:
            return
        need = s.admission.blocks(head, item) - s.kv.num_free_blocks
        if need <= 0:
            return
        priority = head.params.priority
        ripe = [
            r
            for r in s.running
            if step - r.admitted_step >= q + r.admitted_replay
            and len(r.output_token_ids) > r.admitted_outputs
            and not (s.priority and r.params.priority < priority)
        ]
        kv = s.kv
        if self._held_blocks(ripe) < need:
            return  # (its turn would take more than those whose slice is over hold)
        # Victims in order of preference, taken until the head fits.
        if self.swap is not None:
            ripe.sort(key=lambda r: (-len(r.output_token_ids), r.admitted_step))
        else:
            ripe.sort(key=lambda r: (len(r.output_token_ids), r.admitted_step))
        for victim in ripe:
            if s.admission.blocks(head, item) <= kv.num_free_blocks:
                break
            victim.seq = s.next_seq()  # (before it queues: ``Admission.enqueue``)
            self.preempt(victim)
            self.num_rotations += 1

    def _held_blocks(self, requests: list[Request]) -> int:
        """The blocks ``requests`` hold (their covered positions on their planes): what
        preempting all of them would free, shared prefix blocks aside."""
        kv = self.s.kv
        return sum(kv.blocks_needed(kv.covered(r.request_id), r.num_loops) for r in requests)

    # ---------------------------------------------------------------- state changes

    def preempt(self, victim: Request) -> None:
        s = self.s
        rid = victim.request_id
        k = len(victim.output_token_ids)
        p = victim.num_prompt_tokens
        keep = self._final_positions(victim)
        victim.resume = Resume.RECOMPUTE
        if keep:
            blocks = s.kv.all_blocks(rid, keep)
            if self.swap.can_hold(len(blocks)):
                self.swap.hold(rid, len(blocks))
                self._swap_out.append((rid, blocks))
                victim.resume = Resume.SWAP
            else:
                self.swap_fallbacks += 1
                keep = 0
                if self.swap_fallbacks % LOG_EVERY == 1:
                    log.warning(
                        "swap space full: request %s recomputes instead (%d such so far); "
                        "raise swap_space_gb",
                        rid,
                        self.swap_fallbacks,
                    )
        victim.swapped_tokens = keep
        victim.resume_need = 0  # (``make_room`` sets it for a request preempting itself)
        s.drop_carried(victim)
        s.sharing.release(victim)
        victim.items.clear()
        victim.lockstep = False
        victim.num_preemptions += 1
        victim.replay_until = p + k - 1 if k else 0
        victim.num_scheduled = keep
        s.kv.free(rid)
        victim.admitted = False
        victim.status = RequestStatus.WAITING
        victim.preempted_step = s.next_step_id
        s.running.remove(victim)
        s.admission.enqueue(victim)
        self._recomputing.add(rid)  # (swapped ones recompute what follows their swapped KV)
        self._preempted.append(rid)
        self._now.add(rid)
        self.num_preemptions += 1
        if self.num_preemptions % LOG_EVERY == 1:
            log.warning(
                "request %s preempted (%s) to free KV blocks: %d preemptions so far; a larger "
                "KV pool (kv_cache_gb, num_blocks, gpu_memory_utilization) or a lower "
                "max_num_seqs avoids them",
                rid,
                victim.resume.value,
                self.num_preemptions,
            )

    def _final_positions(self, victim: Request) -> int:
        """Swap mode: positions ``[0, n)`` whose KV is final on every plane: below every item
        that still plans loops, with recorded inputs (so a rolled-back draft never counts), and
        short of the position that produces the next unrecorded output; under shared/ring, at
        the start of a prompt chunk."""
        if self.swap is None:
            return 0
        k = len(victim.output_token_ids)
        limit = victim.num_prompt_tokens + k - 1
        starts = [it.start for it in victim.items] + [victim.num_scheduled, limit]
        if victim.scoring:  # a prompt item whose result is not applied is scored again
            starts.append(victim.prompt_logprobs.index(None))
        if victim.forced_pending:  # so is a replay item's that holds a forced token's scores
            scores = victim.forced_scores
            starts.append(victim.num_prompt_tokens - 1 + min(j for j in scores if not scores[j]))
        keep = max(0, min(min(starts), self.s.kv.covered(victim.request_id)))
        if keep < victim.num_prompt_tokens and not self.s.kv.policy.per_depth:
            # Under shared/ring a chunk's positions read each other's version of every loop,
            # which the plane keeps only until the next loop: a position recomputed from loop 1
            # would read its chunk's last versions instead. The chunk is recomputed whole.
            keep = max((c for c in victim.chunk_starts if c <= keep), default=0)
        return keep

    def restore(self, request: Request) -> None:
        """On admission (blocks already allocated): schedules the swap-in of a swapped request."""
        if request.resume is not Resume.SWAP:
            return
        rid = request.request_id
        self._swap_in.append((rid, self.s.kv.all_blocks(rid, request.swapped_tokens)))
        self.swap.release(rid)
        request.swapped_tokens = 0
        request.resume = Resume.RECOMPUTE  # the positions after the swapped ones, if any
        self._recomputing.add(rid)

    def forget(self, request: Request) -> bool:
        """A waiting request ends: frees its swap space. True when the runner may hold state
        for it (swapped KV, the kept sampling generator of a preempted request)."""
        if self.swap is not None and self.swap.holds(request.request_id):
            self.swap.release(request.request_id)
        return request.num_preemptions > 0

    # ---------------------------------------------------------------- stats

    @property
    def num_swapped(self) -> int:
        return self.swap.num_requests if self.swap is not None else 0

    @property
    def swapped_bytes(self) -> int:
        return self.swap.used_bytes if self.swap is not None else 0

    def num_recomputing(self) -> int:
        """Preempted requests that will recompute (or are recomputing) positions. Stats read
        it every step, so it looks only at the requests set to recompute that it has not yet
        seen stop, not at every request."""
        if not self._recomputing:
            return 0
        requests = self.s.requests
        self._recomputing = {
            rid
            for rid in self._recomputing
            if rid in requests and requests[rid].resume is Resume.RECOMPUTE
        }
        return len(self._recomputing)


def resume_tokens(request: Request) -> int:
    """Positions a preempted request must be able to cover to be re-admitted: all it had
    written (swapped in or recomputed), as vLLM admits a recomputed request with its whole
    prefill. Admitted on its first chunk alone, it would take the rest by preempting later
    arrivals, whose own resumes preempt in turn: every preemption costs its victim a replay.
    (The position after ``replay_until`` is the next decode token's, none where the recorded
    outputs fill ``max_tokens``: forced thinking ids, which a thinking budget of 0 records
    before the request first runs.)"""
    if not request.replay_until:
        return request.swapped_tokens
    return max(request.swapped_tokens, min(request.replay_until + 1, request.kv_tokens))


def replay_item(
    request: Request, start: int, max_tokens: int, policy: KVPolicy, coda_attention: bool
) -> InFlight:
    """The item that recomputes generated tokens from ``start`` (at most ``max_tokens`` of them)
    exactly as they first ran: under ``full`` every token looped to the request's depth, so a
    chunk of them runs like a prompt chunk; otherwise each token loops to its recorded exit depth
    (and ``last_exited`` copies its K/V into the deeper planes there). No replayed token
    samples. With coda attention a token's coda ran on its state at its exit: under ``full``
    one that exited early is recomputed alone, keeping that state for its coda."""
    exits = request.exit_depths
    first = start - request.num_prompt_tokens + 1  # the output the token at start produced
    if policy.kind == "full":
        n, keep = max_tokens, 0
        if coda_attention:
            loops = request.num_loops
            n = 0
            while n < max_tokens and exits[first + n] >= loops:
                n += 1
            if not n:
                n, keep = 1, exits[first]
        return InFlight(
            start=start,
            num_tokens=n,
            ends_at=request.num_loops,
            stop_at_exit=False,
            has_output=False,
            epoch=request.epoch,
            life=request.num_preemptions,
            coda_state_at=keep,
        )
    exit_depth = exits[first]
    n = 1
    if policy.per_depth:
        # Tokens that exited at the same depth run as one chunk: at every loop up to that
        # depth each reads its predecessors' real K/V of that loop, as when they decoded.
        # (Under shared/ring a token reads its predecessor's final version: one at a time.)
        while n < max_tokens and exits[first + n] == exit_depth:
            n += 1
    return InFlight(
        start=start,
        num_tokens=n,
        ends_at=exit_depth,
        stop_at_exit=False,
        has_output=False,
        epoch=request.epoch,
        life=request.num_preemptions,
        copy_at_end=policy.copies_on_exit and exit_depth < policy.copy_depths(request.num_loops),
    )
