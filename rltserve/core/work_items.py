"""Work items: what a request's next item is (``next_item``: a prompt chunk, a replayed chunk
after preemption, or a decode token) and what the runner gets for one loop of an item
(``work_item``: a ``WorkItem`` with its block table, exit spec and copy-on-exit targets).

Torch-free. The scheduler decides *whether* an item starts or continues in a step; this module
only says *what* it is, from the request, the scheduler config and the KV manager's tables.
"""

from __future__ import annotations

from rltserve.config import SchedulerConfig
from rltserve.core.exit import exit_spec, fixed_exit_depth
from rltserve.core.kv_cache import KVManager, KVPolicy
from rltserve.core.plan import Carry, WorkItem
from rltserve.core.preemption import replay_item
from rltserve.core.request import InFlight, Request
from rltserve.core.thinking import awaits_budget


class ItemMaker:
    def __init__(self, config: SchedulerConfig, kv: KVManager, has_boundary: bool) -> None:
        self.config = config
        self.kv = kv
        self.has_boundary = has_boundary
        self.block_size = kv.block_size

    def next_item(self, request: Request, budget: int) -> InFlight | None:
        """The request's next item, of at most ``budget`` tokens (not yet started: the
        scheduler's ``start`` commits it); None when every output is planned, when its next
        prompt chunk must not be cut and does not fit ``budget``, or while its next decode
        token waits for a result (``decode_item``)."""
        start = request.num_scheduled
        p = request.num_prompt_tokens
        if start < p:
            if not self._policy(request).per_depth:
                # Under shared/ring a chunk reads an earlier chunk's last versions, so the KV
                # depends on where chunks start: at multiples of ``whole_chunk_size`` whatever
                # else runs (a request's output does not depend on the batch, a recompute
                # repeats its chunks); a chunk the budget does not hold waits.
                n = min(self.config.whole_chunk_size, p - start)
                if n > budget:
                    return None
            else:
                n = min(self.config.prefill_chunk_size, p - start, budget)
            # After a preemption the first output may be recorded already: no output then.
            out = start + n == p and not request.output_token_ids
            draft_at = self.config.draft_loops if request.pipelined else 0
            return InFlight(
                start=start,
                num_tokens=n,
                ends_at=request.num_loops,
                stop_at_exit=False,
                has_output=out,
                # (No draft for a next token when this output is the last: ``decode_item``.)
                draft_at=draft_at if out and request.max_outputs > 1 else 0,
                epoch=request.epoch,
                life=request.num_preemptions,
                # (Recomputed after the first output too: its coda K/V is the same.)
                coda_state_at=request.first_coda_at if start + n == p else 0,
            )
        if start < request.replay_until:
            chunk = min(self.config.prefill_chunk_size, request.replay_until - start, budget)
            return replay_item(request, start, chunk, self._policy(request), self.has_boundary)
        return self.decode_item(request)

    def decode_item(self, request: Request) -> InFlight | None:
        """The request's next decode token (its prompt is scheduled, nothing is left to
        replay), not yet started; None when every output is planned, or while its input, not
        yet applied, may spend the thinking budget (``awaits_budget``: async scheduling)."""
        start = request.num_scheduled
        produces = start - request.num_prompt_tokens + 1  # the output this token produces
        if produces >= request.max_outputs or start + 1 >= request.max_total_tokens:
            return None
        if request.params.max_thinking_tokens is not None and awaits_budget(request):
            return None  # (it may be the first forced id's replay: the input decides)
        full = self._policy(request).kind == "full"  # loops on past its exit
        draft_at = self.config.draft_loops if request.pipelined else 0
        # Positional, in field order (one per decode token; keywords cost 2-3x as much).
        return InFlight(
            start,  # start
            1,  # num_tokens
            request.num_loops if full else request.max_loops,  # ends_at
            not full,  # stop_at_exit
            True,  # has_output
            produces,  # output_index
            0,  # planned
            0,  # applied
            None,  # exit_depth
            None,  # delayed_exit_at
            draft_at if produces + 1 < request.max_outputs else 0,  # draft_at
            request.epoch,  # epoch
            request.num_preemptions,  # life
        )

    def work_item(self, request: Request, item: InFlight, depth: int) -> WorkItem:
        """What the runner gets for loop ``depth`` of ``item``."""
        if item.carry_key:
            return self.carried_item(request, item)
        rid = request.request_id
        spec = None
        copy_blocks: list[int] = []
        if item.has_output and item.exit_depth is None:
            spec = exit_spec(request, item, depth)
            if item.stop_at_exit and self._copies(request):
                # The position's blocks on every plane, found once: they never change while
                # the item lives (a rollback or preemption makes new items).
                blocks = item.exit_blocks
                if blocks is None:
                    loops = request.num_loops
                    blocks = item.exit_blocks = self.kv.exit_copy_blocks(rid, item.start, 0, loops)
                copy_blocks = blocks[depth:]
        elif item.copy_at_end and depth == item.ends_at:
            loops = request.num_loops
            copy_blocks = [
                b
                for q in range(item.start, item.end)
                for b in self.kv.exit_copy_blocks(rid, q, depth, loops)
            ]
        prompt_ids = None
        if depth == 1:
            start = item.start
            if start < len(request.prompt_token_ids):
                prompt_ids = request.prompt_token_ids[start : start + item.num_tokens]
            elif start <= request.replay_until:
                prompt_ids = [request.token_at(q) for q in range(start, item.end)]
        # Positional, in field order: one WorkItem per row per step, and keywords make the
        # constructor about 3x slower (0.34 vs 0.12 ms for 256 rows).
        work = WorkItem(
            rid,  # request_id
            item.start,  # start
            item.num_tokens,  # num_tokens
            depth,  # depth
            item.ends_at,  # ends_at
            item.stop_at_exit,  # stop_at_exit
            self.kv.table_for_depth(rid, depth),  # block_table
            prompt_ids,  # token_ids
            self.kv.boundary_table(rid) if self.has_boundary else None,  # boundary_table
            spec,  # exit
            copy_blocks,  # exit_copy_blocks
            depth == item.draft_at,  # draft
            item.epoch,  # epoch
        )
        if item.coda_state_at:
            work.coda_state_at = item.coda_state_at
        if depth == request.max_loops and (request.prompt_logprobs or request.forced_scores):
            _set_targets(request, item, work)
        return work

    def carries_next(self, request: Request) -> bool:
        """Whether the runner runs the loops of the request's next item by itself, if it is a
        decode token (past the prompt and any replay): when the request has no drafts and its
        earlier items in flight are all carried too (a carried token runs a loop every step,
        so it never overtakes a carried predecessor; an explicitly planned one might wait for
        budget)."""
        start = request.num_scheduled
        return (
            self.config.carry_decode
            and start >= request.num_prompt_tokens
            and start >= request.replay_until
            and not request.pipelined
            and (not request.items or all(it.carry_key for it in request.items))
        )

    def exit_known_by(self, request: Request, item: InFlight) -> int:
        """Loops after which the exit of a decode token's output is known without a result:
        the fixed exit, else the cap (``max_loops``)."""
        if request.exit_mode == "fixed":
            return fixed_exit_depth(request, item.output_index)
        return request.max_loops

    def continuation(self, request: Request) -> InFlight | None:
        """The request's next decode token (``decode_item``), when the runner can start it as
        the continuation of its previous carried token (``StepPlan.continued``); None when it
        cannot be one (``next_item`` and ``Scheduler.start`` then decide). Asked only once
        every earlier item of the request is a carried token that has ended (the
        scheduler's ``_ended``).

        It can be one when it is the next position (so no rollback since: one moves
        ``num_scheduled`` back), under the same tables and boundary table (until a position
        in a new KV block grows them: ``moved``), with the same fixed exit, no preemption
        since (the same life) and no draft (what ``carries_next`` asks); its input is the
        token that one sampled. The scheduler gives it its blocks, then
        ``Scheduler._continues`` commits it; nothing is changed here."""
        prev = request.carry_prev
        if prev is None:
            return None
        last, tables, exit_at, boundary, life = prev
        at = last.start + 1
        rid = request.request_id
        if (
            at != request.num_scheduled
            or life != request.num_preemptions
            or at <= request.replay_until
            or request.pipelined
            or tables is not self.kv.depth_tables(rid)
            or (self.has_boundary and boundary is not self.kv.boundary_table(rid))
        ):
            return None
        item = self.decode_item(request)
        if item is None:
            return None  # every output is planned
        item.exit_by = self.exit_known_by(request, item)
        if exit_at != (item.exit_by if request.exit_mode == "fixed" else 0):
            return None  # (``carried_item``'s ``exit_at``)
        known = request.carry_blocks  # (the same block under the same tables)
        if known is not None and item.stop_at_exit and self._copies(request):
            item.exit_blocks = known[2]  # (``moved`` replaces them in a new block)
        return item

    def moved(
        self, request: Request, item: InFlight
    ) -> tuple[int, list[list[int]], list[int] | None, list[int]]:
        """A continuation (``continuation``, committed, its key set) whose position is the
        first of a KV block: its ``StepPlan.moved`` entry, the fields of its ``Carry`` that
        ``carried_item`` would give it (its blocks taken: the tables grown)."""
        rid = request.request_id
        tables = self.kv.depth_tables(rid)
        boundary = self.kv.boundary_table(rid) if self.has_boundary else None
        self._exit_blocks(request, item, tables)
        if item.ends_at < len(tables):
            tables = tables[: item.ends_at]
        return (item.carry_key, tables, boundary, item.exit_blocks or [])

    def _policy(self, request: Request) -> KVPolicy:
        """The KV policy the request runs: its own, else the engine's."""
        return request.kv_policy or self.kv.policy

    def _copies(self, request: Request) -> bool:
        """Whether the request's early exits copy K/V into deeper planes."""
        return self._policy(request).copies_on_exit

    def _exit_blocks(self, request: Request, item: InFlight, tables: list[list[int]]) -> list[int]:
        """last_exited: sets ``item.exit_blocks``, the blocks holding a carried decode token's
        position on the planes of depths 1..num_loops (what ``KVManager.exit_copy_blocks``
        finds, read off ``tables``, its depth tables), and returns those past depth 1 (its
        first loop's copy targets); [] when no copy can be needed. The same for the
        request's tokens in one block while its tables are the same lists."""
        if not (item.stop_at_exit and self._copies(request)):
            return []
        index = item.start // self.block_size
        known = request.carry_blocks
        if known is None or known[0] is not tables or known[1] != index:
            top = self.kv.policy.copy_depths(len(tables))
            blocks = [table[index] for table in (tables[:top] if top < len(tables) else tables)]
            known = request.carry_blocks = (tables, index, blocks, blocks[1:])
        item.exit_blocks = known[2]
        return known[3]

    def carried_item(self, request: Request, item: InFlight) -> WorkItem:
        """The first loop of a carried decode token, with what the runner needs for the
        others (``Carry``)."""
        rid = request.request_id
        start = item.start
        kv = self.kv
        tables = kv.depth_tables(rid)
        exit_at = item.exit_by if request.exit_mode == "fixed" else 0  # (``exit_known_by``)
        boundary = kv.boundary_table(rid) if self.has_boundary else None
        life = request.num_preemptions
        # (``continuation`` reads it; ``Scheduler._continues`` moves it on.)
        request.carry_prev = (item, tables, exit_at, boundary, life)
        spec = exit_spec(request, item, 1)
        copy_blocks = self._exit_blocks(request, item, tables)
        if item.ends_at < len(tables):
            tables = tables[: item.ends_at]
        # The input is on the runner, unless it was recorded before a preemption.
        prompt_ids = [request.token_at(start)] if start <= request.replay_until else None
        carry = Carry(item.carry_key, tables, request.exit_specs, exit_at, item.exit_blocks or [])
        return WorkItem(
            rid,  # request_id
            start,  # start
            1,  # num_tokens
            1,  # depth
            item.ends_at,  # ends_at
            item.stop_at_exit,  # stop_at_exit
            tables[0],  # block_table
            prompt_ids,  # token_ids
            boundary,  # boundary_table
            spec,  # exit
            copy_blocks,  # exit_copy_blocks
            False,  # draft (carried tokens are never pipelined)
            item.epoch,  # epoch
            carry,  # carry
        )


def _set_targets(request: Request, item: InFlight, work: WorkItem) -> None:
    """The tokens loop ``max_loops`` of ``item`` scores. A prompt runs every loop up to
    ``num_loops`` (Ouro: at least the model's count, for the planes later tokens read); its
    logprobs are those after the request's most loops. Bounded thinking: a forced token's
    logprob is its position's at that loop too, from the item holding the position before it
    (``core/thinking.py``): a replay item, or under a budget of 0 the prompt's last chunk,
    whose rows before the last score the prompt (with ``prompt_logprobs``) or nothing."""
    targets = top = None
    if request.prompt_logprobs is not None:
        targets = request.prompt_targets(item.start, item.end)
        top = request.params.prompt_logprobs or 0
    forced = None if item.has_output else request.forced_targets(item.start, item.end)
    if forced is not None:
        row, ids = forced
        logprobs = request.params.logprobs or 0
        if targets is None:
            work.targets_from = row
            targets, top = ids, logprobs
        else:  # (the prompt's rows end where the forced ones start: one list)
            targets, top = targets + ids, max(top, logprobs)
    if targets is not None:
        work.prompt_targets = targets
        work.targets_top = top
