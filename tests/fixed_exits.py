"""Hand-built step results for the torch-free scheduler with fixed exits (no gate): what the
runner would report, without a model. Every output position exits where its fixed spec says,
sampling one token id; carried decode tokens (``plan.Carry``) run on, one loop per step, until
they end, as the runner runs them."""

from __future__ import annotations

from dataclasses import dataclass

from rltserve.core.plan import CarriedResult, ItemResult, StepPlan, StepResult, WorkItem


@dataclass
class _Row:
    work: WorkItem
    depth: int
    exited: bool  # its output has exited (it may run on: ``full`` policy)


class FixedExits:
    def __init__(self, token: int = 7) -> None:
        self.token = token
        self.rows: list[_Row] = []  # carried tokens, in carry order

    def result(self, plan: StepPlan) -> StepResult:
        gone = {*plan.released, *plan.preempted}
        rows = [row for row in self.rows if row.work.request_id not in gone]
        events, kept = [], []
        for row in rows:
            row.depth += 1
            carry = row.work.carry
            now = not row.exited and carry.exit_at > 0 and row.depth >= carry.exit_at
            ended = row.depth >= row.work.ends_at or (now and row.work.stop_at_exit)
            outcome = ItemResult(True, 1.0, 0.0, token_id=self.token) if now else None
            row.exited |= now
            if now or ended:
                events.append(
                    CarriedResult(carry.key, row.work.request_id, row.depth, ended, outcome)
                )
            if not ended:
                kept.append(row)
        items: list[ItemResult | None] = []
        for work in plan.items:
            exited = work.exit is not None and work.exit.exit_now
            items.append(
                ItemResult(exited, 1.0, 0.0, token_id=self.token if exited else -1)
                if work.exit
                else None
            )
            ended = work.depth >= work.ends_at or (exited and work.stop_at_exit)
            if work.carry is not None and not ended:
                kept.append(_Row(work, work.depth, exited))
        self.rows = kept
        return StepResult(plan.step_id, items, events, num_rows=len(rows) + plan.num_tokens)
