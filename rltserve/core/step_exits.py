"""The exit rule of a ``Step``'s output rows on the runner (DESIGN §5): the gate's survival
and CDF carried from loop to loop (on models without a gate, a zero-shot criterion instead:
``step_criteria``), and which rows exit in this step. Fixed and delayed decisions are
host-known; only ``gate`` mode reads this loop's crossings in-step."""

from __future__ import annotations

from itertools import repeat
from operator import add, ge, is_, or_
from typing import TYPE_CHECKING

import torch

from rltserve.core import step_criteria, step_rows

if TYPE_CHECKING:
    from rltserve.core.live import ItemState
    from rltserve.core.step import Step


_FIXED, _GATE, _DELAYED = frozenset({"fixed"}), frozenset({"gate"}), frozenset({"delayed"})


def decide_exits(
    step: Step, loop_in: torch.Tensor, state: torch.Tensor, positions: torch.Tensor, specs: list
) -> list[bool]:
    """The exit rule for the output rows, in fp32 with the reference's arithmetic:
    lam = sigmoid(g); p = lam * S; S' = S * (1 - lam); CDF' = CDF + p. (``loop_in``, ``state``:
    [N, S] the rows before and after this loop; ``positions`` [N].)

    The decision itself is host-known for fixed exits and for delayed ones (made by the
    previous loop, delivered by now); only ``gate`` mode reads this loop's gate in-step.
    """
    out, held = step.out, step.held
    step.modes, step.kinds = (), frozenset()
    if not out:
        return []
    r = step.r
    every = isinstance(out, range)  # every item is an output row
    nc = step.num_carried
    # The output rows are the carried rows (a decode batch, prompt chunks beside it without
    # an output): the first rows, one each.
    carried_out = nc == len(out) and (every or out[-1] == nc - 1)
    if every:
        out_held, out_depths = held, step.depths
    elif carried_out:
        out_held, out_depths = held[:nc], step.depths[:nc]
    else:
        out_held, out_depths = [held[i] for i in out], [step.depths[i] for i in out]
    if every and step.one_row:  # decode-only steps: every row is an output row
        out_state = state
    elif carried_out:
        out_state = state[:nc]
    else:
        rows = r.tensor([step.offsets[i + 1] - 1 for i in out])
        out_state = state.index_select(0, rows)
    if carried_out:  # their columns, built once per specs list
        columns = r.carried.spec_columns()
        modes, exit_now, min_loops, max_loops, thresholds, kinds, lowest = columns
    elif every and nc:  # the carried rows' columns, then the plan's items'
        head = r.carried.spec_columns()
        tail = tuple(zip(*map(step_rows.SPEC, specs[nc:])))
        modes, exit_now, min_loops, max_loops, thresholds = map(add, head[:5], tail)
        kinds, lowest = head[5].union(tail[0]), min(head[6], min(tail[3]))
    else:
        modes, exit_now, min_loops, max_loops, thresholds = zip(
            *map(step_rows.SPEC, specs if every else [specs[i] for i in out])
        )
        kinds, lowest = frozenset(modes), min(max_loops)
    step.modes, step.kinds = modes, kinds
    crossed_now: list[bool] | None = None
    new_gate = None
    m = len(out_held)
    # A carried row's gate goes unread (its results are events) where no crossing can move
    # its exit: a fixed exit's, and once every row is at its cap, a delayed one from a loop
    # before (``thresholds``). Later loops are later still, so the gate state is never needed
    # again: not computed.
    settled = carried_out and (
        kinds == _FIXED
        or (
            kinds in (_GATE, _DELAYED)  # (``thresholds``' test, for every row at once)
            and min(out_depths) + (kinds == _DELAYED) >= max(max_loops)
        )
    )
    logit = None if settled else r.timed(r.model.exit_logit, out_state)  # [M] fp32 or None
    if logit is not None:
        gate = gate_state(step, out_held)  # [2, M]
        surv, cdf = gate.unbind(0)  # [M]
        lam = torch.sigmoid(logit if logit.dtype == torch.float32 else logit.float())
        cdf = cdf + lam * surv
        surv = surv * torch.sub(r.scalar(1.0), lam)  # (1 - lam)
        new_gate = torch.stack((surv, cdf))  # [2, M]
        limit = step_rows.thresholds(r, thresholds, out_depths, min_loops, max_loops, modes)
        crossed = torch.ge(cdf, limit)  # [M]
        step.outputs.add("crossed", crossed)
        if "gate" in kinds:
            crossed_now = crossed.tolist()  # in-step read: gate mode is synchronous
        step.gate_rows = new_gate  # written with the states, or left pending (run())
    elif not settled and kinds != _FIXED and not r.spec.has_gate:
        columns = (modes, thresholds, out_depths, min_loops, max_loops)
        crossed = step_criteria.crossed(step, loop_in, state, positions, columns)
        if crossed is not None:
            step.outputs.add("crossed", crossed)
            if "gate" in kinds:
                crossed_now = crossed.tolist()  # in-step read, as the gate's
    if kinds == {"delayed"}:
        if max(out_depths) < lowest and not any(map(step_rows.PENDING, out_held)):
            exited = [False] * m  # (most steps: no row is at its cap or decided)
        else:
            capped = map(ge, out_depths, max_loops)
            exited = list(map(or_, capped, map(step_rows.PENDING, out_held)))  # (bools)
    elif kinds == _GATE:  # (the loop below, for every row at once: its cap, or its gate)
        capped = map(ge, out_depths, max_loops)
        exited = list(capped) if crossed_now is None else list(map(or_, capped, crossed_now))
    else:
        exited = []
        for k in range(m):
            mode = modes[k]
            if mode == "fixed":
                now = exit_now[k]
            elif out_depths[k] >= max_loops[k]:
                now = True
            elif mode == "delayed":
                now = out_held[k].pending
            else:
                now = bool(crossed_now and crossed_now[k])
            exited.append(now)
    return exited


def gate_state(step: Step, out_held: list[ItemState]) -> torch.Tensor:
    """[2, M] fp32: the output rows' (survival, CDF) before this loop: columns of earlier
    steps' gates, or the initial state for positions at their first loop."""
    r = step.r
    m = len(out_held)
    pending = step.pending
    if pending is not None and pending.gate is not None and step.out == pending.out:
        return pending.gate  # the same output rows as in the step that left it
    if r.pending_rows is not None:  # this step's states are it, but not its gates
        r.pending_rows.settle()
        r.pending_rows = None
    srcs = list(map(step_rows.GATE_SRC, out_held))
    first = srcs[0]
    if all(map(is_, srcs, repeat(first))):
        if first is None:
            return r.gate_init[:, None].expand(2, m)
        rows = list(map(step_rows.GATE_ROW, out_held))
        if first.shape[1] == m and rows == list(range(m)):
            return first
        return first.index_select(1, r.tensor(rows))
    sources: list[torch.Tensor] = []
    source_of: dict[int, int] = {}
    picks = []
    last, k = None, -1
    for h in out_held:
        src = h.gate_src
        if src is None or src is not last:
            key = id(src)  # id(None) stands for the initial state
            k = source_of.get(key, -1)
            if k < 0:
                k = source_of[key] = len(sources)
                sources.append(r.gate_init[None] if src is None else src.t())
            last = src
        picks.append((k, h.gate_row, 1))
    return step_rows.gather_rows(sources, picks).t()
