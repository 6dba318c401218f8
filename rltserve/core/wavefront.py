"""Wavefront rules (DESIGN §6, §8): when a request's next item may enter loop 1 while its earlier
items are still looping (``may_start``: prompt chunks under wavefront prefill, replays after
preemption, token pipelining, decode tokens under wavefront prefill), and replay runs in
lockstep: a preempted request recomputes its generated tokens run by run
(``preemption.replay_item``: a run is tokens of one recorded exit depth); the runs start in
one step, with the last chunk of the prompt when that is recomputed too, and loop together,
each to its own depth (``start_runs``, ``continue_lockstep``), so a replay takes about as many
steps as its deepest item has loops instead of one step per run and the prompt's loops
before them.

Exact on per-depth planes: a replayed token's loop d reads its predecessors' plane-d K/V, which
a run still looping writes in the same layer call of the same step (every row's K/V is written
before any row attends) and a run that ended wrote (or copied, ``last_exited``) in an earlier
step. Not with coda attention (a token's coda reads earlier codas written at their exits).

Torch-free; works on the scheduler's requests and plans their loops through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rltserve.core.exit import exit_known
from rltserve.core.plan import WorkItem
from rltserve.core.request import InFlight, Request

if TYPE_CHECKING:
    from rltserve.core.scheduler import Scheduler

# What ``Scheduler._next_loop`` says of an item.
PLAN, WAIT, OVER, CARRIED = "plan", "wait", "over", "carried"


class Wavefront:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def may_start(self, request: Request, states: list[str]) -> bool:
        """Whether a new item of the request may enter loop 1 in this step (``states``: its
        items' ``Scheduler._next_loop`` before this step's planning)."""
        s = self.s
        active = len(states) - states.count(OVER)
        if not active:
            return True
        start = request.num_scheduled
        if start < request.num_prompt_tokens:
            return s.config.wavefront_prefill  # the next chunk trails the previous by a loop
        if start <= request.replay_until:
            # Resume after preemption: inputs are recorded tokens and no replayed token samples,
            # so on per-depth planes the recompute runs as a wavefront over (token, depth).
            # With coda attention, a token's coda reads every earlier position's coda K/V,
            # written at that position's exit: not where tokens may exit before the last loop
            # (traced exits, zero-shot criteria: such models have no gate) or where the output
            # position runs its coda at every loop (criteria), which they then do in turns.
            if s.has_boundary and (request.params.trace_depths is not None or request.criterion):
                return False
            return s.kv.policy.per_depth
        last = request.items[-1]
        if request.pipelined:
            # Token pipelining: the next token enters on the draft of the newest item.
            drafted = last.draft_at and last.planned >= last.draft_at
            return bool(drafted) and active <= s.config.speculative_tokens
        if not s.config.wavefront_prefill:
            return False
        # A decode token needs its input: the previous item's output, sampled in an earlier step.
        return exit_known(request, last, s._planned_loops(last)) is True

    def continue_lockstep(
        self,
        request: Request,
        states: list[str],
        items: list[WorkItem],
        owners: list[InFlight],
        budget: int,
    ) -> tuple[int, bool]:
        """``Scheduler._continue_items`` for a request with runs in lockstep (``start_runs``),
        first to last: an item's loop needs its nearest predecessor still looping (those that
        ended wrote every plane) to have planned that loop in an earlier step, or, for a run
        started with it, in this one (planned counts before this step). (Runs in lockstep end
        at different loops, so the plain rule's "an ended predecessor is behind one that is
        further ahead" does not hold for them.) Returns the budget left and whether an item
        still has loops to plan."""
        s = self.s
        request_items = request.items
        before = [it.planned for it in request_items]
        planned = [False] * len(request_items)
        busy = lockstep = False
        over = []
        ahead = -1  # the nearest predecessor still looping
        for k, item in enumerate(request_items):
            state = states[k]
            if state == OVER:
                over.append(item)
                continue
            busy = True
            lockstep = lockstep or item.lockstep
            j, ahead = ahead, k
            if state in (WAIT, CARRIED):
                continue
            if budget < item.num_tokens:
                lockstep = True  # (not known for the rest: keep the flag)
                break  # a later item may be a run in lockstep with this one: none passes it
            if (
                j >= 0
                and states[j] != CARRIED
                and before[j] <= before[k]
                and not (item.lockstep and before[j] == before[k] and planned[j])
            ):
                continue
            budget -= s._plan_loop(request, item, items, owners)
            planned[k] = True
        for item in over:
            if not item.carry_key or item.carry_key not in s._carried:
                request_items.remove(item)
        request.lockstep = lockstep  # (off once no run in lockstep is left)
        return budget, busy

    def start_runs(
        self,
        request: Request,
        first: InFlight,
        items: list[WorkItem],
        owners: list[InFlight],
        budget: int,
    ) -> int:
        """Recompute after preemption (``replay_item``): the runs of generated tokens after
        ``first`` (the first run, or the last chunk of the prompt) start in the same step and
        loop in lockstep with it, each to its recorded exit depth, so a replay takes about as
        many steps as its deepest item has loops. Exact on per-depth planes: a replayed
        token's loop d reads its predecessors' plane-d K/V, which an item still looping writes
        in the same layer call (every row's K/V is written before any row attends) and one
        that ended wrote (or copied, ``last_exited``) in an earlier step. Not with coda
        attention (``may_start`` keeps those replays in turns)."""
        s = self.s
        if (
            first.has_output
            or first.end < request.num_prompt_tokens
            or not s.kv.policy.per_depth
            or s.has_boundary
        ):
            return budget
        maker, rid = s.item_maker, request.request_id
        while budget > 0 and request.num_scheduled < request.replay_until:
            item = maker.next_item(request, budget)
            if item is None or item.has_output:
                break
            if s.kv.extend(rid, item.end) and not s._grow(request, item.end):
                break
            item.lockstep = request.lockstep = True
            budget -= s.start(request, item, items, owners)
        return budget
