"""Applying a step's result (the scheduler's second half): each item's outcome and each carried
token's events go to its request (tokens, exit depths, delayed decisions, ends of carried
tokens, rollbacks), and the requests they stop finish. Torch-free. Part of the scheduler: it
reads and writes the scheduler's state (``Scheduler._carried``), as ``Scheduler.apply``
calls it, in submission order; a result of a request's earlier incarnation
(``InFlight.life``) or of one gone meanwhile is dropped.
"""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING

from rltserve.core.plan import CarriedEvents, ItemResult, StepPlan, StepResult, WorkItem
from rltserve.core.request import FinishReason, InFlight, Request
from rltserve.core.thinking import force_thinking_end
from rltserve.updates import RequestUpdate, StepUpdates

if TYPE_CHECKING:
    from rltserve.core.scheduler import Scheduler


class Applier:
    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def apply(self, plan: StepPlan, owners: list[InFlight], result: StepResult) -> StepUpdates:
        """Applies a step's result to the requests it planned for (``owners``: the record
        behind each of its items)."""
        s = self.s
        if result.error is not None:
            return self._fail_planned(plan, result.error, result.lost)
        updates = StepUpdates()
        scored = result.prompt_logprobs
        for k, (work, item, outcome) in enumerate(zip(plan.items, owners, result.items)):
            if outcome is None and item.carry_key:
                # A carried token's first loop: its events are in ``result.carried``. (Were
                # its request gone or preempted, the field of a forgotten item is set.)
                item.applied = work.depth
                continue
            request = s.requests.get(work.request_id)
            if request is None or item.life != request.num_preemptions:
                continue  # finished, aborted or preempted after this step was planned
            item.applied = work.depth
            if work.depth == item.ends_at and item.start < request.num_prompt_tokens:
                s.sharing.on_prompt_done(request, item.start, item.end)
            if request.forced_unsent and item.end == request.num_prompt_tokens:
                self._send_forced(request, updates)  # (a thinking budget of 0)
                if request.is_finished:
                    continue  # (the forced ids filled max_tokens)
            if scored and k in scored:  # (a prompt or replay item after its max_loops)
                self._record_scores(request, work, scored[k], updates)
                if request.is_finished:
                    continue  # (ended by what it withheld)
            if outcome is None:
                continue
            appended = self._apply_outcome(request, item, work.depth, outcome, updates)
            if appended and outcome.rollback and not request.is_finished:
                self._rollback(request, work.end)
        if result.carried:
            self._apply_carried(result.carried, updates)
        return updates

    def _apply_carried(self, events: CarriedEvents, updates: StepUpdates) -> None:
        """Exits, delayed decisions and ends of carried tokens (in the runner's order: a
        request's older token first)."""
        carried = self.s._carried
        standing = self.s.standing
        ends: list[tuple[Request, InFlight]] | None = [] if standing is not None else None
        # A token that neither starts nor ends its request's output, its request's only one in
        # this step so far, takes a row of ``updates``' columns (``_append_token``'s usual case,
        # written out: most of a decode batch's tokens).
        general, rows = updates.updates, updates.rows
        rids, token_ids, depths = updates.request_ids, updates.token_ids, updates.exit_depths
        logprobs, tops, ranks = updates.logprobs, updates.top_logprobs, updates.ranks
        for key, depth, ended, exited, exit_next, token, logprob, top, finite, rank in zip(
            events.keys,
            events.depths,
            events.ended,
            events.exited,
            events.exit_next,
            events.token_ids,
            events.logprobs,
            events.top_logprobs,
            events.finite,
            repeat(None) if events.ranks is None else events.ranks,
        ):
            owner = carried.get(key)
            if owner is None:
                continue  # its request finished, was aborted or preempted meanwhile
            request, item = owner
            if exit_next:
                item.exits_after(depth)
            if exited and finite:  # (``_exit``'s usual case, one call fewer per token)
                item.exit_depth = depth
                item.wake = 0
                out = request.output_token_ids
                rid = request.request_id
                if (
                    out
                    and len(out) + 1 < request.max_outputs
                    and token not in request.stop_ids
                    and request.params.max_thinking_tokens is None
                    and not request.scoring
                    and rid not in general
                    and rid not in rows
                ):
                    out.append(token)
                    request.exit_depths.append(depth)
                    rows[rid] = len(rids)
                    rids.append(rid)
                    token_ids.append(token)
                    depths.append(depth)
                    logprobs.append(logprob)
                    tops.append(top)
                    ranks.append(rank)
                else:
                    self._append_token(request, depth, token, logprob, top, rank, updates)
            elif exited:
                self._exit(request, item, depth, token, logprob, top, rank, finite, updates)
            # Ended (the runner runs it no more), its request not finished by its token: it is
            # forgotten and out of the request's items (an item is carried only while it is one
            # of them), or, with standing tokens, it may become the request's next token.
            if ended:
                if ends is not None:
                    ends.append(owner)  # (after every exit: one finishes its request)
                elif key in carried:
                    del carried[key]
                    request.items.remove(item)
        if ends:
            standing.apply_ends(ends)

    def _apply_outcome(
        self,
        request: Request,
        item: InFlight,
        depth: int,
        outcome: ItemResult,
        updates: StepUpdates,
    ) -> bool:
        """An output position's result at loop ``depth``: a delayed decision, or its exit with
        a token. True when the token was appended."""
        if outcome.exit_next:
            item.exits_after(depth)
        if not outcome.exited:
            return False
        return self._exit(
            request,
            item,
            outcome.exit_depth or depth,
            outcome.token_id,
            outcome.logprob,
            outcome.top_logprobs,
            outcome.rank,
            outcome.finite,
            updates,
        )

    def _exit(
        self,
        request: Request,
        item: InFlight,
        depth: int,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        rank: int | None,
        finite: bool,
        updates: StepUpdates,
    ) -> bool:
        """The item's output exited at loop ``depth`` with ``token``. True when the token was
        appended (its logits were finite)."""
        item.exit_depth = depth
        item.wake = 0
        if request.finish_pending is not None:
            return False  # (a token started before its end was known: never output)
        if not finite:
            rid = request.request_id
            update = updates.update_of(rid)
            if update is None:
                update = updates.updates[rid] = RequestUpdate(rid)
            self._fail_nonfinite(request, item.end, depth, update)
            return False
        self._append_token(request, depth, token, logprob, top, rank, updates)
        return True

    def _append_token(
        self,
        request: Request,
        depth: int,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        rank: int | None,
        updates: StepUpdates,
    ) -> None:
        """Appends an output token to the request and to its update in ``updates`` (its
        logprobs go only there: nothing reads them again), and ends the request when the
        token stops it. (``_apply_carried`` appends a token none of the rules here can touch
        as a row of ``updates``' columns: a rule added here must be excluded there.)"""
        if request.finish_pending is not None:
            return  # (a token started before its end was known: never output)
        request.output_token_ids.append(token)
        request.exit_depths.append(depth)
        rid = request.request_id
        update = request.withheld if request.scoring else updates.update_of(rid)
        if update is None:  # (positional: one per request per step)
            update = RequestUpdate(rid, [token], [depth], [logprob], [top])
            update.add_rank(rank)
            if request.scoring:
                request.withheld = update
            else:
                updates.updates[rid] = update
        else:
            update.new_token_ids.append(token)
            update.new_exit_depths.append(depth)
            update.new_logprobs.append(logprob)
            update.new_top_logprobs.append(top)
            update.add_rank(rank)
        n = len(request.output_token_ids)
        if n == 1:
            _first_output(request, update, updates)
        # What stops it (a stop id once ``min_tokens`` are out; the most tokens it may have).
        reason = None
        if token in request.stop_ids and n >= request.params.min_tokens:
            reason = FinishReason.STOP
        elif n >= request.max_outputs:
            reason = FinishReason.LENGTH
        bounded = request.params.max_thinking_tokens is not None  # (bounded thinking only)
        if reason is None and bounded and force_thinking_end(request, update):
            reason = FinishReason.LENGTH
        if reason is not None:
            self._end(request, update, reason)

    def _end(self, request: Request, update: RequestUpdate, reason: FinishReason) -> None:
        """Ends the request with ``reason`` in ``update``, once its prompt logprobs (or its
        forced tokens') are out: until then the end waits, and no more tokens start."""
        if request.scoring or request.forced_pending:
            request.finish_pending = reason
            request.max_outputs = len(request.output_token_ids)
            return
        self.s.finish(request, reason)
        update.finish_reason = reason

    def _send_forced(self, request: Request, updates: StepUpdates) -> None:
        """A thinking budget of 0 (``thinking.force_at_start``): the forced ids that open the
        output go out, as its first outputs (no logprob yet: scored later, as any forced
        token's), when the result of the prompt's last chunk is first applied; a request
        whose forced ids fill ``max_tokens`` ends (with logprobs, once they are scored)."""
        request.forced_unsent = False
        rid = request.request_id
        n = request.num_forced
        if request.scoring:  # (nothing withheld yet: no output came before these)
            update = request.withheld = RequestUpdate(rid)
        else:
            # No output came before these, but under wavefront prefill an earlier chunk's
            # scores may have completed the prompt's logprobs in this step, in an update of
            # their own: the forced ids join it (a second update would replace it).
            update = updates.update_of(rid)
            if update is None:
                update = updates.updates[rid] = RequestUpdate(rid)
        update.new_token_ids += request.output_token_ids[:n]
        update.new_exit_depths += request.exit_depths[:n]
        update.new_logprobs += [None] * n
        update.new_top_logprobs += [None] * n
        _first_output(request, update, updates)
        if n >= request.max_outputs:
            self._end(request, update, FinishReason.LENGTH)

    def _record_scores(
        self,
        request: Request,
        work: WorkItem,
        scores: list[tuple[float, list[tuple[int, float]], int]],
        updates: StepUpdates,
    ) -> None:
        """An item's scores (``WorkItem.prompt_targets``): its rows before the prompt's last
        position score prompt tokens, the others output tokens (forced ones), each with its
        own number of top logprobs (one item may score both: a budget of 0's last chunk)."""
        start = work.start + work.targets_from
        split = max(0, min(len(scores), request.num_prompt_tokens - 1 - start))
        params = request.params
        if split:
            prompt = _top(scores[:split], params.prompt_logprobs or 0, work.targets_top)
            self._record_prompt_logprobs(request, start, prompt, updates)
        if split < len(scores) and not request.is_finished:
            forced = _top(scores[split:], params.logprobs or 0, work.targets_top)
            self._record_forced(request, start + split, forced, updates)

    def _record_prompt_logprobs(
        self,
        request: Request,
        start: int,
        scores: list[tuple[float, list[tuple[int, float]], int]],
        updates: StepUpdates,
    ) -> None:
        """A prompt item's logprobs (after its request's ``max_loops``) of the prompt tokens its
        rows predict, into the request's slots from ``start`` on (slots filled before, by a
        prompt recomputed after a preemption, keep their values). The last sends them with what
        the request withheld meanwhile, and ends it if that ended it."""
        slots = request.prompt_logprobs
        if slots is None or not request.scoring:
            return
        for q, score in enumerate(scores, start):
            if slots[q] is None:
                slots[q] = score
        if None in slots:
            return
        request.scoring = False
        rid = request.request_id
        update = request.withheld or RequestUpdate(rid)
        request.withheld = None
        update.prompt_logprobs = slots
        updates.updates[rid] = update  # (none of its own this step: it was withholding)
        self._end_once_scored(request, update)

    def _record_forced(
        self,
        request: Request,
        start: int,
        scores: list[tuple[float, list[tuple[int, float]], int]],
        updates: StepUpdates,
    ) -> None:
        """Bounded thinking: a replay item's logprobs (after its request's ``max_loops``) of the
        output tokens its rows predict, into the forced tokens' slots still empty (a recompute
        after a preemption finds the others filled); they go out as ``forced_logprobs``, and
        a request whose end waited for them ends."""
        slots = request.forced_scores
        first = start - request.num_prompt_tokens + 1  # (the output its first row predicts)
        new = [(j, *v) for j, v in enumerate(scores, first) if j in slots and slots[j] is None]
        if not new:
            return
        for j, *score in new:
            slots[j] = tuple(score)
        rid = request.request_id
        update = request.withheld if request.scoring else updates.update_of(rid)
        if update is None:
            update = RequestUpdate(rid)
            if request.scoring:
                request.withheld = update
            else:
                updates.updates[rid] = update
        update.forced_logprobs = (update.forced_logprobs or []) + new
        self._end_once_scored(request, update)

    def _end_once_scored(self, request: Request, update: RequestUpdate) -> None:
        """Ends a request whose end waited for scores (``finish_pending``: its prompt's, its
        forced tokens') once none is missing, in ``update``."""
        reason = request.finish_pending
        if reason is not None and not request.scoring and not request.forced_pending:
            self.s.finish(request, reason)
            update.finish_reason = reason

    def _fail_nonfinite(
        self, request: Request, end: int, depth: int, update: RequestUpdate
    ) -> None:
        """The model's logits for the request's next token held a NaN or an infinity: its token
        is meaningless and its state likely too, so the request ends; others are unaffected
        (every row is computed independently of the others)."""
        error = (
            f"non-finite logits (NaN or infinity) for output token "
            f"{len(request.output_token_ids)} (position {end - 1}, loop {depth}); "
            "the model's computation overflowed or the weights hold non-finite values"
        )
        request.error = error
        self.s.finish(request, FinishReason.ERROR)
        update.finish_reason = FinishReason.ERROR
        update.error = error

    def _rollback(self, request: Request, position: int) -> None:
        """A committed token contradicted the draft that position ``position`` ran on: every
        item from there on is discarded and decoding resumes from the committed token. Their
        KV positions are simply overwritten when recomputed (the blocks stay reserved)."""
        request.items = [it for it in request.items if it.start < position]
        request.num_scheduled = position
        request.epoch += 1

    def _fail_planned(self, plan: StepPlan, error: str, lost: list[str]) -> StepUpdates:
        """A failed step: its requests (and those it lost) end; nothing else is touched."""
        updates = StepUpdates()
        for rid in [work.request_id for work in plan.items] + lost:
            request = self.s.requests.get(rid)
            if request is None:
                continue  # a second item of a request already failed, or it ended meanwhile
            request.error = error
            self.s.finish(request, FinishReason.ERROR)
            updates.updates[rid] = RequestUpdate(rid, finish_reason=FinishReason.ERROR, error=error)
        return updates


def _first_output(request: Request, update: RequestUpdate, updates: StepUpdates) -> None:
    """What the update holding a request's first output token says once: its prompt (for the
    step's prompt-token count), its reused prompt tokens and its time in the queue."""
    updates.num_prompt_tokens += request.num_prompt_tokens
    update.num_cached_tokens = request.num_cached_tokens or 0
    update.queued_s = request.queued_s
    if request.prompt_logprobs == []:  # (a one-token prompt: none to score)
        update.prompt_logprobs = []


def _top(
    scores: list[tuple[float, list[tuple[int, float]], int]], k: int, scored: int
) -> list[tuple[float, list[tuple[int, float]], int]]:
    """``scores`` with ``k`` top logprobs each, of the ``scored`` the runner gave."""
    if k >= scored:
        return scores
    return [(logprob, top[:k], rank) for logprob, top, rank in scores]
