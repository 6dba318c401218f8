"""Zero-shot exit criteria of models without an exit gate (Huginn, Nanbeige; MODELS.md §2.5,
DESIGN §5), for a ``Step``'s output rows at their current loop.

A row's value compares its state after this loop, ``s_t``, with its state before it, ``s_{t-1}``
(the loop's input, which the step holds):

- ``latent-diff``: ``||s_{t-1} - s_t|| / ||s_t||``;
- ``kl``: ``KL(p_{t-1} || p_t)`` of the next-token distributions ``p = softmax(logits(coda(s)))``,
  with ``p_0`` uniform;
- ``minp-kl``: the same after each distribution's entries below a tenth of its largest are set
  to ``1/V`` and it is renormalised (``p_0`` uniform);
- ``entropy-diff``: ``|H(p_t) - H(p_{t-1})|`` with ``H(p_0) = 100``;
- ``argmax-stability``: how many loops in a row the argmax of ``p`` has not changed (0 at loop
  1), which exits the row when it reaches the threshold.

The row exits when its value is below its threshold (from ``min_loops`` on; ``step_exits``
applies the cap and, in delayed mode, moves the exit one loop later). The arithmetic is Hugging
Face's (``generate_with_adaptive_compute``), in fp32. The statistic of ``p_t`` (log
distribution, entropy, or argmax and count) stays on the item (``ItemState.criterion_prev``) for
the next loop; where the loop before computed none (it was before ``min_loops``, or the item
restarted after a preemption) it is computed again from ``s_{t-1}``, one more coda. The count of
``argmax-stability`` needs every loop's argmax, so its rows compute it from loop 1 on (a
restart begins at loop 1 again). Every coda writes the row's
coda K/V, which its exit's coda (``Step._coda_and_sample``) writes last, as Hugging Face's coda
K/V of a token is that of its last prediction.
"""

from __future__ import annotations

from math import inf
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rltserve.core import step_rows

if TYPE_CHECKING:
    from rltserve.core.live import ItemState
    from rltserve.core.step import Step

# What the criteria compare against before the first loop (Hugging Face's initial values).
_FIRST_ENTROPY = 100.0
_FIRST_ARGMAX = (-1, 0)  # (argmax, loops unchanged): no token id is -1
_COUNTS = "argmax-stability"  # the criterion whose value must reach its threshold


def crossed(
    step: Step,
    loop_in: torch.Tensor,
    state: torch.Tensor,
    positions: torch.Tensor,
    columns: tuple,
) -> torch.Tensor | None:
    """[M] bool on the device: the output rows (``step.out``) whose criterion after this loop
    asks for the exit, where the rule applies (``columns``: the rows' modes, thresholds, depths,
    min_loops and max_loops); None when it applies to none of them. ``loop_in`` / ``state``:
    [N, S] the step's rows before and after the loop; ``positions`` [N] their positions."""
    modes, thresholds, depths, min_loops, max_loops = columns
    r, out, offsets, items = step.r, step.out, step.offsets, step.items
    # Rows whose value this loop computes: from min_loops on (from loop 1 for a count), and
    # before the cap (a delayed row's crossing at the loop before its cap would exit it at the
    # cap anyway).
    active, criteria = [], []
    for k, (mode, _, d, lo, hi) in enumerate(zip(*columns)):
        if mode == "fixed" or d + (mode == "delayed") >= hi:
            continue
        criterion = step.lives[out[k]].setup.params.exit_criterion or "kl"
        if lo <= d or criterion == _COUNTS:
            active.append(k)
            criteria.append(criterion)
    if not active:
        return None
    rows, helds, spans = [], [], []
    for k in active:
        i = out[k]
        if offsets[i + 1] - offsets[i] != 1:  # (a generated token's output: one row)
            raise RuntimeError(f"{items[i].request_id}: an exit criterion on a multi-row item")
        rows.append(offsets[i])
        helds.append(step.held[i])
        spans.append((step.starts[i], 1, items[i].boundary_table))
    index = r.tensor(rows)
    now, before = state.index_select(0, index), loop_in.index_select(0, index)  # [A, S]
    values = torch.empty(len(active), dtype=torch.float32, device=now.device)  # [A]
    latent = [a for a, c in enumerate(criteria) if c == "latent-diff"]
    if latent:
        s_now, s_before = _rows(r, now, latent).float(), _rows(r, before, latent).float()
        change = (s_before - s_now).norm(dim=-1) / s_now.norm(dim=-1)
        values.index_copy_(0, r.tensor(latent), change)
    scored = [a for a, c in enumerate(criteria) if c != "latent-diff"]
    if scored:
        scored_values = _distribution_values(
            r,
            _rows(r, now, scored),
            _rows(r, before, scored),
            _rows(r, positions.index_select(0, index), scored),
            [spans[a] for a in scored],
            [criteria[a] for a in scored],
            [depths[active[a]] for a in scored],
            [helds[a] for a in scored],
        )
        values.index_copy_(0, r.tensor(scored), scored_values)
    # A value is compared where the row may exit: below its threshold, or a count reaching it
    # (negated: -count < 0.5 - threshold, thresholds being whole numbers).
    counted = [a for a, c in enumerate(criteria) if c == _COUNTS]
    if counted:
        values.index_copy_(0, r.tensor(counted), -_rows(r, values, counted))
    limits = [-inf] * len(modes)  # (no value is below -inf: where the rule does not apply)
    for a, k in enumerate(active):
        if depths[k] >= min_loops[k]:
            limits[k] = 0.5 - thresholds[k] if criteria[a] == _COUNTS else thresholds[k]
    every = torch.full((len(modes),), inf, dtype=torch.float32, device=now.device)  # [M]
    every.index_copy_(0, r.tensor(active), values)
    return torch.lt(every, r.tensor(limits, torch.float32))


def _distribution_values(
    r,
    now: torch.Tensor,
    before: torch.Tensor,
    positions: torch.Tensor,
    spans: list,
    criteria: list[str],
    depths: list[int],
    helds: list[ItemState],
) -> torch.Tensor:
    """[K] fp32: the values of the criteria that compare next-token distributions, for K rows
    (their states after and before the loop [K, S], positions, coda spans, criteria, loops and
    item states). The statistic before the loop is the initial one at loop 1, the one the
    previous loop left on the item (``ItemState.criterion_prev``), or, where that loop computed
    none (before ``min_loops``, a restart), computed again from the loop's input."""
    kept, redo = {}, []  # rows whose statistic before is on their item; rows to compute
    for k, (h, d, c) in enumerate(zip(helds, depths, criteria)):
        prev = h.criterion_prev
        if d == 1:
            continue
        if prev is not None and prev[2] == d - 1 and prev[3] == c:
            kept[k] = prev
        elif c == _COUNTS:  # (its rows compute every loop from loop 1)
            raise RuntimeError(f"argmax-stability: no count from loop {d - 1}")
        else:
            redo.append(k)
    logits_before = None
    if redo:  # first, so that the coda K/V this step leaves is the one after the loop
        logits_before = _logits(
            r, _rows(r, before, redo), _rows(r, positions, redo), [spans[k] for k in redo]
        )  # [R, V]
    logits_now = _logits(r, now, positions, spans)  # [K, V]
    vocab = logits_now.shape[-1]
    row_before = {k: j for j, k in enumerate(redo)}  # row k's row of logits_before
    values = torch.empty(len(criteria), dtype=torch.float32, device=now.device)  # [K]
    for criterion in dict.fromkeys(criteria):
        mine = [k for k, c in enumerate(criteria) if c == criterion]
        if criterion == _COUNTS:
            values.index_copy_(0, r.tensor(mine), _count(r, logits_now, mine, kept, helds, depths))
            continue
        current = _statistic(_rows(r, logits_now, mine), criterion)  # [Km, V] or [Km]
        if criterion == "entropy-diff":
            prior = torch.full_like(current, _FIRST_ENTROPY)
        else:  # the uniform distribution's log, in fp32 as Hugging Face computes it
            prior = torch.full_like(current, 1.0 / vocab).log()
        at = [j for j, k in enumerate(mine) if k in row_before]
        if at:
            rows_before = _rows(r, logits_before, [row_before[mine[j]] for j in at])
            prior = prior.index_copy(0, r.tensor(at), _statistic(rows_before, criterion))
        at = [j for j, k in enumerate(mine) if k in kept]
        if at:
            refs = [kept[mine[j]][:2] for j in at]  # (the previous step's tensor, row)
            prior = prior.index_copy(0, r.tensor(at), step_rows.gather_tokens(refs))
        if criterion == "entropy-diff":
            value = (current - prior).abs()
        else:  # kl, minp-kl
            value = F.kl_div(current, prior, reduction="none", log_target=True).sum(dim=-1)
        values.index_copy_(0, r.tensor(mine), value)
        for j, k in enumerate(mine):
            helds[k].criterion_prev = (current, j, depths[k], criterion)
    return values


def _count(r, logits: torch.Tensor, mine: list[int], kept: dict, helds: list, depths: list):
    """[Km] fp32: for rows ``mine`` (of ``logits`` [K, V]), how many loops in a row their argmax
    has not changed, left with the argmax on their items."""
    top = _rows(r, logits, mine).argmax(dim=-1)  # [Km] int64
    prior = r.tensor([_FIRST_ARGMAX] * len(mine))  # [Km, 2] (argmax, count)
    at = [j for j, k in enumerate(mine) if k in kept]
    if at:
        refs = [kept[mine[j]][:2] for j in at]
        prior = prior.index_copy(0, r.tensor(at), step_rows.gather_tokens(refs))
    count = torch.where(top == prior[:, 0], prior[:, 1] + 1, torch.zeros_like(top))  # [Km]
    current = torch.stack((top, count), dim=-1)  # [Km, 2]
    for j, k in enumerate(mine):
        helds[k].criterion_prev = (current, j, depths[k], _COUNTS)
    return count.float()


def _rows(r, tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return tensor.index_select(0, r.tensor(rows))


def _logits(r, states: torch.Tensor, positions: torch.Tensor, spans: list) -> torch.Tensor:
    """[K, V] fp32: the next-token logits of states [K, S] through the coda (its attention, on
    models with coda attention, writing their coda K/V)."""
    attn = r.attention(spans) if spans[0][2] is not None else None
    return r.timed(r.model.logits, r.timed(r.model.coda, states, positions, attn))


def _statistic(logits: torch.Tensor, criterion: str) -> torch.Tensor:
    """What the criterion compares between loops: the entropy [K], or the (min-p floored) log
    distribution [K, V]."""
    if criterion == "entropy-diff":
        probs = F.softmax(logits.float(), dim=-1)
        return -torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    if criterion != "minp-kl":
        return F.log_softmax(logits.float(), dim=-1)
    probs = F.softmax(logits.float(), dim=-1)
    floor = 0.1 * probs.max(dim=-1, keepdim=True)[0]
    probs = torch.where(probs < floor, 1.0 / probs.shape[-1], probs)
    return (probs / probs.sum(dim=-1, keepdim=True)).log()
