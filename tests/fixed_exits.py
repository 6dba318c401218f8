"""Hand-built step results for the torch-free scheduler with fixed exits (no gate): what the
runner would report, without a model. Every output position exits where its fixed spec says,
sampling one token id; carried decode tokens (``plan.Carry``) run on, one loop per step, until
they end, as the runner runs them. (And ``make_request`` and ``make_scheduler``: a plain
request, and a scheduler over a small pool, for them; ``working``: a bounded step loop.)"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rltserve.config import SchedulerConfig
from rltserve.core.kv_cache import KVManager, KVPolicy
from rltserve.core.plan import CarriedEvents, ItemResult, StepPlan, StepResult, WorkItem
from rltserve.core.request import Request
from rltserve.core.scheduler import Scheduler
from rltserve.core.swap import SwapSpace
from rltserve.sampling import SamplingParams


def make_request(
    rid: str, prompt_len: int, max_tokens: int, priority: int = 0, loops: int = 2
) -> Request:
    """A request of ``prompt_len`` prompt ids and ``max_tokens`` outputs (EOS ignored), every
    token looping ``loops`` times."""
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, priority=priority
        ),
        num_loops=loops,
        max_loops=loops,
        eos_token_ids=frozenset(),
        max_total_tokens=1000,
        seed=0,
    )


def working(s: Scheduler, limit: int = 1000):
    """Yields while ``s`` has work, at most ``limit`` times: a scheduler that never finishes
    (requests preempting each other back and forth) fails the test instead of hanging it."""
    for _ in range(limit):
        if not s.has_work():
            return
        yield
    raise AssertionError(f"the scheduler still has work after {limit} steps")


def make_scheduler(
    num_blocks: int = 64,
    *,
    swap: bool = False,
    reservation: str = "ondemand",
    watermark: float = 0.0,
    **config,
) -> Scheduler:
    """A scheduler over ``num_blocks`` 4-token blocks (``last_exited``; with ``swap``, a small
    swap space), 4-token prompt chunks unless ``config`` says otherwise."""
    config.setdefault("prefill_chunk_size", 4)
    kv = KVManager(num_blocks, 4, KVPolicy("last_exited"), has_boundary=False)
    return Scheduler(
        SchedulerConfig(**config),
        kv,
        has_gate=False,
        has_boundary=False,
        reservation=reservation,
        watermark=watermark,
        swap=SwapSpace(8, 1) if swap else None,
    )


@dataclass
class _Row:
    work: WorkItem
    depth: int
    exited: bool  # its output has exited (it may run on: ``full`` policy)


class FixedExits:
    def __init__(self, token: int = 7) -> None:
        self.token = token
        self.rows: list[_Row] = []  # carried tokens, in carry order
        self.ended: dict[str, WorkItem] = {}  # request id -> its last carried token that ended

    def result(self, plan: StepPlan) -> StepResult:
        gone = {*plan.released, *plan.preempted}
        rows = [row for row in self.rows if row.work.request_id not in gone]
        for rid in gone:
            self.ended.pop(rid, None)
        moved = {entry[0]: entry for entry in plan.moved}  # (entering a new KV block)
        for rid, previous, key in plan.continued:  # the next position, under the same Carry
            work = self.ended.pop(rid)
            assert work.carry.key == previous
            carry = replace(work.carry, key=key)
            if key in moved:
                _, tables, boundary, blocks = moved[key]
                carry = replace(carry, tables=tables, copy_blocks=blocks)
                work = replace(work, block_table=tables[0], boundary_table=boundary)
            rows.append(_Row(replace(work, start=work.start + 1, carry=carry), 0, False))
        events: list[tuple] = []  # (key, request id, depth, ended, exited)
        kept = []
        for row in rows:
            row.depth += 1
            if not self._run(row, events):
                kept.append(row)
        items: list[ItemResult | None] = []
        for work in plan.items:
            if work.carry is not None:  # its first loop reports as a carried event
                items.append(None)
                row = _Row(work, work.depth, False)
                if not self._run(row, events):
                    kept.append(row)
                continue
            exited = work.exit is not None and work.exit.exit_now
            items.append(
                ItemResult(exited, token_id=self.token if exited else -1) if work.exit else None
            )
        self.rows = kept
        n = len(events)
        keys, rids, depths, ended, exited = (list(c) for c in zip(*events)) if n else ([],) * 5
        carried = CarriedEvents(
            keys,
            rids,
            depths,
            ended,
            exited,
            [False] * n,
            [self.token if x else -1 for x in exited],
            [None] * n,
            [None] * n,
            [True] * n,
        )
        return StepResult(plan.step_id, items, carried, num_rows=len(rows) + plan.num_tokens)

    def _run(self, row: _Row, events: list[tuple]) -> bool:
        """Row's loop at ``row.depth``: its event, if any, goes to ``events``. True when it
        ends."""
        work = row.work
        carry = work.carry
        if row.depth == 1:
            now = work.exit is not None and work.exit.exit_now
        else:
            now = not row.exited and carry.exit_at > 0 and row.depth >= carry.exit_at
        ended = row.depth >= work.ends_at or (now and work.stop_at_exit)
        row.exited |= now
        if ended:
            self.ended[work.request_id] = work
        if now or ended:
            events.append((carry.key, work.request_id, row.depth, ended, now))
        return ended
