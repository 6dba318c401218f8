"""Reading a ``Step``'s results on the host once its device work is done: the items'
``ItemResult``s, the carried tokens' ``CarriedEvents``, and the host copies of device state
(delayed decisions, drafts, penalty history, rollbacks) brought up to date."""

from __future__ import annotations

from itertools import compress
from operator import gt, or_
from typing import TYPE_CHECKING

from rltserve.core import step_rows
from rltserve.core.plan import CarriedEvents, ItemResult
from rltserve.core.sampler import SampleOutput

if TYPE_CHECKING:
    from rltserve.core.step import Step


def read_results(step: Step) -> tuple[list[ItemResult | None], CarriedEvents | None]:
    """Reads the staged outputs on the host, updating the host copies of device state
    (delayed decisions, drafts, history, rollbacks). Returns the items' results (None for
    an item without an open output position, and for a carried token: a row with a
    ``carry``) and the carried tokens' events (exits, delayed decisions, ends)."""
    items, held = step.items, step.held
    host = step.outputs.read()
    for draft, value in zip(step.drafts, host.get("drafts", [])):
        draft.value = value
    out, exited = step.out, step.exited
    m = len(exited)
    every = isinstance(out, range)
    if "crossed" in host:
        crossed = host["crossed"]
        # Delayed mode: a crossing that did not exit now makes the next loop the exit.
        if not any(crossed):
            nexts = [False] * m
        elif step.kinds == {"delayed"}:
            nexts = list(map(gt, crossed, exited))  # (bools: crossed and not exited)
        else:
            nexts = [
                c and not x and mode == "delayed" for c, x, mode in zip(crossed, exited, step.modes)
            ]
    else:
        nexts = [False] * m
    if any(nexts):  # only ever set: a pending row exits at its next loop, never again
        for h in compress(held if every else [held[i] for i in out], nexts):
            h.pending = True
    sample = _read_sample(step, host) if step.sampled else None
    carrying = step.carrying
    # No token this loop: positional (one is built per row per step).
    if not step.num_carrying:
        outcomes = list(map(ItemResult, exited, nexts))
    elif step.num_carrying == len(items):
        outcomes = [None] * m
    else:
        quiet = carrying if every else list(map(carrying.__getitem__, out))
        if all(quiet):  # carried output rows beside prompt chunks without an output
            outcomes = [None] * m
        else:
            outcomes = [
                None if q else ItemResult(x, nxt) for q, x, nxt in zip(quiet, exited, nexts)
            ]
    lives = step.lives
    # (Nothing to do when every row is a carried token's, none with drafts, a penalty
    # history or a guide: a decode batch's exits.)
    if sample is not None and (
        step.num_carrying < len(items)
        or any(map(step_rows.DRAFTS, lives))
        or any(map(step_rows.COMMITS, lives))
    ):
        _sampled_results(step, sample, outcomes)
    events = _events(step, nexts, sample) if step.num_carrying else None
    if every:
        return outcomes, events
    results: list[ItemResult | None] = [None] * len(items)
    for i, outcome in zip(out, outcomes):
        results[i] = outcome
    return results, events


def _read_sample(step: Step, host: dict[str, list]) -> SampleOutput:
    prefix = "sample."
    return step.sample.to_output(
        {k[len(prefix) :]: v for k, v in host.items() if k.startswith(prefix)}
    )


def _events(step: Step, nexts: list[bool], sample: SampleOutput | None) -> CarriedEvents:
    """The carried rows' events: those whose output exited or got a delayed decision
    (``nexts``, aligned with ``step.out``), or that end in this step."""
    items, out, exited, carrying = step.items, step.out, step.exited, step.carrying
    every = isinstance(out, range)
    noted = []
    if any(exited) or any(nexts):
        noted = list(compress(out, map(or_, exited, nexts)))
        if step.num_carrying < len(items):
            noted = [i for i in noted if carrying[i]]
    ends = step.ending
    if step.num_carrying < len(items):
        ends = [i for i in ends if carrying[i]]
    if not ends or ends == noted:
        rows, ended = noted, [bool(ends)] * len(noted)
    else:
        rows = sorted(set(noted).union(ends))
        ending = set(ends)
        ended = [i in ending for i in rows]
    if every:  # (row i is output k = i)
        x_col = list(map(exited.__getitem__, rows))
        next_col = list(map(nexts.__getitem__, rows))
    else:
        k_of = {i: k for k, i in enumerate(out)}
        ks = [k_of.get(i, -1) for i in rows]  # -1: its output exited in an earlier step
        x_col = [k >= 0 and exited[k] for k in ks]
        next_col = [k >= 0 and nexts[k] for k in ks]
    n = len(rows)
    ranks = None
    if sample is None or not any(x_col):
        tokens, logprobs, tops, finite = [-1] * n, [None] * n, [None] * n, [True] * n
    elif rows == step.sampled:  # every sampled row, and only those (a decode batch's exits)
        tokens, logprobs = sample.token_ids, sample.logprobs
        tops, finite, ranks = sample.top_logprobs, sample.finite or [True] * n, sample.ranks
    else:
        j_of = {i: j for j, i in enumerate(step.sampled)}
        js = [j_of.get(i, -1) for i in rows]
        tokens = [sample.token_ids[j] if j >= 0 else -1 for j in js]
        logprobs = [sample.logprobs[j] if j >= 0 else None for j in js]
        tops = [sample.top_logprobs[j] if j >= 0 else None for j in js]
        finite = [not sample.finite or j < 0 or sample.finite[j] for j in js]
        if sample.ranks is not None:
            ranks = [sample.ranks[j] if j >= 0 else None for j in js]
    depths, keys, nc = step.depths, step.carried_keys, step.num_carried
    return CarriedEvents(
        list(map(keys.__getitem__, rows))
        if not rows or rows[-1] < nc  # (rows increase: every one a carried row)
        else [keys[i] if i < nc else items[i].carry.key for i in rows],
        list(map(step_rows.RID, map(items.__getitem__, rows))),
        list(map(depths.__getitem__, rows)),
        ended,
        x_col,
        next_col,
        tokens,
        logprobs,
        tops,
        finite,
        ranks,
    )


def _sampled_results(step: Step, sample: SampleOutput, outcomes: list[ItemResult | None]) -> None:
    """Fills in the tokens of the sampled items' results (``outcomes`` is aligned with
    ``step.out``; a carried token has none); a draft the token contradicts rolls its
    request back."""
    r, items, lives = step.r, step.items, step.lives
    if isinstance(step.out, range):
        index = step.sampled
    else:
        k_of = {i: k for k, i in enumerate(step.out)}
        index = [k_of[i] for i in step.sampled]
    rollbacks: list[int] = []
    finite = sample.finite
    for j, (i, k) in enumerate(zip(step.sampled, index)):
        outcome = outcomes[k]
        live = lives[i]
        token = sample.token_ids[j]
        if outcome is not None:
            outcome.token_id = token
            outcome.logprob = sample.logprobs[j]
            outcome.top_logprobs = sample.top_logprobs[j]
            if sample.ranks is not None:
                outcome.rank = sample.ranks[j]
            outcome.finite = finite[j] if finite else True
            if items[i].coda_state_at:  # its coda ran on that loop's state (Huginn's first)
                outcome.exit_depth = items[i].coda_state_at
        if live.drafts or live.commits:
            end = step.starts[i] + items[i].num_tokens
            checked = end in live.drafts
            r.drafts_checked += checked
            if live.commit(end, token):  # (never a carried token: those have no drafts)
                outcome.rollback = True
                rollbacks.append(i)
                r.drafts_rejected += 1
    for i in rollbacks:  # after the states were stored, so the discarded items stay discarded
        lives[i].rollback(step.starts[i] + items[i].num_tokens)
