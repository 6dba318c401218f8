"""What a ``Step`` reads per row, and how it gathers rows: column getters over work items and
their states (``map`` with them runs at C speed where a Python loop over rows would not), the
exit rule's thresholds, gathering rows of earlier steps' tensors with one ``index_select``,
and the copy-on-exit of exiting rows' K/V (``copy_on_exit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from math import inf
from operator import attrgetter, ge

import numpy as np
import torch

from rltserve.core.attention import copy_slots
from rltserve.core.live import LiveRequest
from rltserve.core.plan import WorkItem
from rltserve.core.staging import move_to, to_device
from rltserve.core.step_host import StepHost

# Per-item columns: work items, their ItemStates, their LiveRequests.
RID = attrgetter("request_id")
START = attrgetter("start")
COUNT = attrgetter("num_tokens")
DEPTH = attrgetter("depth")
TABLE = attrgetter("block_table")
EXIT = attrgetter("exit")
ENDS_AT = attrgetter("ends_at")
DRAFT = attrgetter("draft")
CARRY = attrgetter("carry")
CODA_STATE_AT = attrgetter("coda_state_at")
SPEC = attrgetter("mode", "exit_now", "min_loops", "max_loops", "threshold")
SRC = attrgetter("src")
ROW = attrgetter("row")
GATE_SRC = attrgetter("gate_src")
GATE_ROW = attrgetter("gate_row")
EXITED = attrgetter("exited")
PENDING = attrgetter("pending")
DRAFTS = attrgetter("drafts")
COMMITS = attrgetter("commits")
LAST_TOKENS = attrgetter("last_tokens")
LAST_ROW = attrgetter("last_row")
CARRY_COPIES = attrgetter("carry.copy_blocks")
SAMPLE_ROW = attrgetter("sample_row")
PROMPT_TARGETS = attrgetter("prompt_targets")
BANNED_BELOW = attrgetter("banned_below")


def thresholds(
    r: StepHost,
    values: Sequence[float],
    depths: Sequence[int],
    min_loops: Sequence[int],
    max_loops: Sequence[int],
    modes: Sequence[str],
) -> torch.Tensor:
    """What each output row's CDF must reach to exit: its threshold (``values``), or inf
    (which no CDF reaches) where the rule does not apply (threshold 1, or before
    ``min_loops``) or where a crossing cannot move the exit: from the cap on (``max_loops``
    exits the row there anyway), which a delayed row's crossing reaches one loop early (its
    exit is the next loop). Only the CDF comparison needs the device, the rest of the rule
    is host-known. A 0-dim fp32 tensor (``StepHost.scalar``) when it is every row's, a [M]
    fp32 tensor else."""
    t, d, lo, hi, mode = values[0], depths[0], min_loops[0], max_loops[0], modes[0]
    m = len(values)
    if (
        values.count(t) == m
        and depths.count(d) == m
        and min_loops.count(lo) == m
        and max_loops.count(hi) == m
        and modes.count(mode) == m
    ):
        return r.scalar(inf if t >= 1.0 or d < lo or d + (mode == "delayed") >= hi else t)
    thr = [
        inf if t >= 1.0 or d < lo or d + (mode == "delayed") >= hi else t
        for t, d, lo, hi, mode in zip(values, depths, min_loops, max_loops, modes)
    ]
    if thr.count(thr[0]) == m:
        return r.scalar(thr[0])
    return r.tensor(thr, torch.float32)


def gather_tokens(refs: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Row ``row`` of each ``(tensor, row)`` (sampled tokens' [R] int64, criteria's statistics):
    [len(refs), ...]; the tensor itself when the rows are all of one tensor, in order."""
    sources: list[torch.Tensor] = []
    source_of: dict[int, int] = {}
    picks = []
    last, k = None, -1
    for src, row in refs:
        if src is not last:
            k = source_of.get(id(src), -1)
            if k < 0:
                k = source_of[id(src)] = len(sources)
                sources.append(src)
            last = src
        picks.append((k, row, 1))
    return gather_rows(sources, picks, in_order=True)


def recorded_inputs(
    r: StepHost,
    items: Sequence[WorkItem],
    lives: Sequence[LiveRequest],
    starts: Sequence[int],
    prompts: list[int],
) -> list[torch.Tensor]:
    """The inputs of the items ``prompts`` (entering with recorded ``token_ids``: prompt
    chunks, replays) as one tensor, in a list ([] without them). The outputs among them join
    their requests' penalty histories (``LiveRequest.record_inputs``: forced thinking ids)."""
    for i in prompts:
        lives[i].record_inputs(starts[i], items[i].token_ids)  # (without penalties: nothing)
    if len(prompts) == 1:  # (one recorded-input item, e.g. a chunk: its ids as they are)
        return [r.tensor(items[prompts[0]].token_ids)]
    if prompts:
        return [r.tensor([t for i in prompts for t in items[i].token_ids])]
    return []


def gather_rows(
    sources: list[torch.Tensor], picks: list[tuple[int, int, int]], in_order: bool = False
) -> torch.Tensor:
    """Rows ``picks`` ((source, first row, rows) in output order) of ``sources``: one
    index_select over their concatenation. ``in_order``: check first whether the picks are
    all of one source's rows in order, which is then returned as it is."""
    if in_order and len(sources) == 1:
        expected = 0
        for _, row, n in picks:
            if row != expected:
                break
            expected += n
        else:
            if expected == sources[0].shape[0]:
                return sources[0]
    bases = offsets([src.shape[0] for src in sources])
    index: list[int] = []
    for k, row, n in picks:
        first = bases[k] + row
        if n == 1:
            index.append(first)
        else:
            index.extend(range(first, first + n))
    data = torch.cat(sources) if len(sources) > 1 else sources[0]
    return data.index_select(0, to_device(index, data.device))


def offsets(counts: list[int]) -> list[int]:
    return list(accumulate(counts, initial=0))


def row_positions(r: StepHost, starts: list[int], counts: list[int]) -> torch.Tensor:
    """[sum(counts)] int64 on the device: each row's position, item after item (item k's
    rows are positions ``starts[k]..starts[k] + counts[k] - 1``), computed with numpy when
    prompt chunks make the rows many (a 512-token chunk's positions as a Python list cost
    several times as much)."""
    n, total = len(starts), sum(counts)
    if total == n:  # one row each (decode rows): the starts themselves
        return r.tensor(starts)
    if n == 1:
        return move_to(torch.arange(starts[0], starts[0] + counts[0]), r.device)
    if total < 4 * n:  # (mostly one-row items: a list is as quick)
        return r.tensor([p for s, c in zip(starts, counts) for p in range(s, s + c)])
    sizes = np.array(counts, dtype=np.int64)
    first = np.cumsum(sizes) - sizes  # [n]: each item's first row
    base = np.array(starts, dtype=np.int64) - first  # [n]: row -> position offset
    return move_to(torch.from_numpy(np.repeat(base, sizes) + np.arange(total)), r.device)


def copy_on_exit(
    r: StepHost,
    items: list[WorkItem],
    exits: list[int],
    specs: list,
    carried: list[int],
    starts: list[int],
) -> None:
    """last_exited: the exit-depth K/V of a token stopping early serves deeper planes
    (``exits``: the items whose output exits in this step; ``specs``: the items' exit specs;
    ``carried``: the depths of the first items, the runner's carried tokens; ``starts``: the
    items' positions)."""
    nc = len(carried)
    if exits and exits[-1] < nc and all(specs):
        # Only carried rows exit: the loop's first test below, over columns. A decode batch's
        # rows usually all pass it (each exits at its last plane: nothing to copy).
        depths = carried if len(exits) == nc else list(map(carried.__getitem__, exits))
        carries = items[:nc] if len(exits) == nc else list(map(items.__getitem__, exits))
        if all(map(ge, depths, map(len, map(CARRY_COPIES, carries)))):
            return
    # A token recomputed after preemption carries copy blocks (and no exit) at its last loop.
    if not all(specs):
        exits = exits + [
            i
            for i, it in enumerate(items[nc:], nc)
            if specs[i] is None and it.exit_copy_blocks  # (carried rows always have a spec)
        ]
    src: list[int] = []
    dst: list[int] = []
    bs = r.block_size
    for i in exits:
        it = items[i]
        if i < nc:  # a carried row: its Carry's copy targets and table at its depth
            d = carried[i]
            if d >= len(it.carry.copy_blocks):
                continue  # (at its last plane: the usual exit of a decode batch's token)
            copies = it.carry.copy_blocks[d:]
            table = it.carry.tables[d - 1]
        else:
            copies, table = it.exit_copy_blocks, it.block_table
        if not copies:
            continue
        # An exiting output copies position start; a recomputed chunk copies every position
        # (its blocks are listed position by position).
        start = starts[i]
        positions = range(start, start + it.num_tokens) if specs[i] is None else (start,)
        per = len(copies) // len(positions)
        for k, q in enumerate(positions):
            offset = q % bs
            slot = table[q // bs] * bs + offset
            for block in copies[k * per : (k + 1) * per]:
                src.append(slot)
                dst.append(block * bs + offset)
    if src:
        copy_slots(r.kv, r.tensor(src), r.tensor(dst))
