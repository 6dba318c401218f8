"""One step's work on the runner's state: ``Step.run()`` queues it, ``Step.results()`` reads it.

``run``: the prelude for items entering loop 1 (prompt chunks from the plan, decode tokens from
the device tensors of the last sampled token or a draft), one loop for every row, the exit rule
for output positions, copy-on-exit, the coda and sampling for rows that finished, drafts. Device
results are collected in ``StepOutputs``. ``results``: reads them on the host and updates the
host copies of device state (delayed-exit decisions, draft values, penalty history, rollbacks).
"""

from __future__ import annotations

from itertools import accumulate
from math import inf

import torch

from rltserve.core.attention import copy_slots
from rltserve.core.live import Draft, ItemState, LiveRequest
from rltserve.core.plan import ItemResult, WorkItem
from rltserve.core.staging import StepOutputs, move_to, to_device
from rltserve.core.step_host import StepHost


class Step:
    """One step's work on the runner's state: launched by ``run()``, read by ``results()``."""

    def __init__(self, runner: StepHost, items: list[WorkItem]) -> None:
        self.r = runner
        self.items = items
        self.lives = [runner.live[it.request_id] for it in items]
        self.outputs = StepOutputs(runner.device)
        self.num_rows = 0  # set by run()
        self.num_coda_rows = 0

    def run(self) -> bool:
        r, items, lives = self.r, self.items, self.lives
        self.offsets = _offsets([it.num_tokens for it in items])
        self.num_rows = self.offsets[-1]
        spans = [(it.start, it.num_tokens, it.block_table) for it in items]
        if r.graphs is not None:  # replays decode-only steps, runs the others eagerly
            positions = r.tensor([p for it in items for p in range(it.start, it.end)])  # [N]
            state, e = self._gather_inputs()
            state = r.timed(r.graphs.run, state, e, spans, positions)  # [N, S]
        else:
            # The metadata's one transfer brings the rows' positions too.
            attn = r.attention(spans, [(it.request_id, it.depth) for it in items])
            positions = attn.positions  # [N]
            state, e = self._gather_inputs()
            state = r.timed(r.model.loop, state, e, positions, attn)  # [N, S]
        # The loop is queued: the device is busy, so waiting for the previous step is free.
        r.deliver()

        held = self.held  # each item's ItemState (from _gather_inputs)
        self.out = [i for i, it in enumerate(items) if it.exit is not None and not held[i].exited]
        self.exited = self._decide_exits(state)
        self._copy_on_exit()
        exited_set = {i for i, x in zip(self.out, self.exited) if x}
        ending = [
            i
            for i, it in enumerate(items)
            if it.depth >= it.ends_at or (it.stop_at_exit and i in exited_set)
        ]
        self.sampled = self._coda_and_sample(positions, state, ending, exited_set)
        self.drafts = self._draft(positions, state)
        ending_set = set(ending)
        offsets = self.offsets
        for i, (it, live) in enumerate(zip(items, lives)):
            if i in ending_set:
                del live.items[it.start]
            else:  # rows of this step's output: the next step gathers them in one call
                h = held[i]
                h.src, h.e_src, h.row = state, e, offsets[i]
        self.outputs.stage()
        # A sampled token checked against a draft may roll back later items: the next step
        # must see the outcome before it runs, so this step is delivered at once.
        return any(items[i].end in lives[i].drafts for i in self.sampled)

    # ---------------------------------------------------------------- pieces

    def _gather_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """States entering this loop: the prelude's for items at depth 1 (prompt chunks first,
        then decode tokens, whose inputs are device tensors), the held ones otherwise, which
        are rows of earlier steps' outputs: one index_select over their sources."""
        r, items, lives = self.r, self.items, self.lives
        entering = [i for i, it in enumerate(items) if it.depth == 1]
        if entering:
            prompts = [i for i in entering if items[i].token_ids is not None]
            decodes = [i for i in entering if items[i].token_ids is None]
            entering = prompts + decodes
            parts = []
            if prompts:
                parts.append(r.tensor([t for i in prompts for t in items[i].token_ids]))
            if decodes:  # rows of the tensors that sampled (or drafted) them
                parts.append(
                    _gather_tokens([lives[i].input_token(items[i].start) for i in decodes])
                )
            ids = torch.cat(parts) if len(parts) > 1 else parts[0]  # [n_enter]
            sub = [items[i] for i in entering]
            pos = r.tensor([p for it in sub for p in range(it.start, it.end)])
            boundary = None
            if r.spec.num_boundary_layers:
                boundary = r.attention(
                    [(it.start, it.num_tokens, it.boundary_table) for it in sub],
                    [(it.request_id, 0) for it in sub],
                )
            e_new = r.timed(r.model.prelude, ids, pos, boundary)  # [n_enter, E]
            noise = None
            if r.spec.needs_noise:
                noise = torch.cat([self._noise(it, lives[i]) for i, it in zip(entering, sub)])
                noise = move_to(noise, r.device)
            s_new = r.model.initial_state(e_new, noise)  # [n_enter, S]
            row = 0
            for i in entering:  # a fresh state: rows of the prelude's output
                start = items[i].start
                lives[i].items[start] = ItemState(start, s_new, e_new if r.keeps_e else None, row)
                row += items[i].num_tokens
        # Every item's state is rows of a source (an earlier step's output, or the prelude's);
        # usually one source whose rows are exactly this step's, in order.
        held = self.held = []
        sources: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        source_of: dict[int, int] = {}  # id(state source) -> index in sources
        picks: list[tuple[int, int, int]] = []  # per item: (source, first row, rows)
        last = None
        k = -1
        expected = 0  # the next row, while every pick so far continues source 0 in order
        for it, live in zip(items, lives):
            h = live.items.get(it.start)
            if h is None or h.src is None:
                raise RuntimeError(f"{it.request_id}: no in-flight state at {it.start}")
            held.append(h)
            src = h.src
            if src is not last:
                k = source_of.get(id(src), -1)
                if k < 0:
                    k = source_of[id(src)] = len(sources)
                    sources.append((src, h.e_src))
                last = src
            if expected >= 0:
                expected = expected + it.num_tokens if k == 0 and h.row == expected else -1
            picks.append((k, h.row, it.num_tokens))
        if len(sources) == 1 and expected == sources[0][0].shape[0]:
            return sources[0]  # this step's rows are the source's, in order
        state = _gather_rows([src for src, _ in sources], picks)
        if not r.keeps_e:
            return state, None
        return state, _gather_rows([e_src for _, e_src in sources], picks)

    def _noise(self, item: WorkItem, live: LiveRequest) -> torch.Tensor:
        seed = live.setup.seed if live.setup.params.init_state == "random" else None
        return self.r.model.draw_noise(seed, list(range(item.start, item.end)))

    def _decide_exits(self, state: torch.Tensor) -> list[bool]:
        """The exit rule for the output rows, in fp32 with the reference's arithmetic:
        lam = sigmoid(g); p = lam * S; S' = S * (1 - lam); CDF' = CDF + p.

        The decision itself is host-known for fixed exits and for delayed ones (made by the
        previous loop, delivered by now); only ``gate`` mode reads this loop's gate in-step.
        """
        out, items, held = self.out, self.items, self.held
        if not out:
            return []
        r = self.r
        if len(out) == state.shape[0]:  # every row is an output row (decode-only steps)
            out_state = state
        else:
            rows = r.tensor([self.offsets[i + 1] - 1 for i in out])
            out_state = state.index_select(0, rows)
        logit = r.timed(r.model.exit_logit, out_state)  # [M] fp32 or None
        specs = [items[i].exit for i in out]
        crossed_now: list[bool] | None = None
        new_gate = None
        if logit is not None:
            # One pass: each row's threshold (ineligible rows get inf, which no CDF reaches:
            # only the CDF comparison needs the device, the rest of the rule is host-known)
            # and where its gate state is (rows of earlier steps' gates, or the initial one).
            thr = []
            sources: list[torch.Tensor] = []
            source_of: dict[int, int] = {}
            picks = []
            last, k = None, -1
            gate_mode = False
            for i, spec in zip(out, specs):
                gate_mode = gate_mode or spec.mode == "gate"
                thr.append(
                    spec.threshold
                    if spec.threshold < 1.0 and items[i].depth >= spec.min_loops
                    else inf
                )
                h = held[i]
                src = h.gate_src
                if src is None or src is not last:
                    key = id(src)  # id(None) stands for the initial state
                    k = source_of.get(key, -1)
                    if k < 0:
                        k = source_of[key] = len(sources)
                        sources.append(r.gate_init[None] if src is None else src)
                    last = src
                picks.append((k, h.gate_row, 1))
            gate = _gather_rows(sources, picks, in_order=True)  # [M, 2]
            surv, cdf = gate[:, 0], gate[:, 1]  # [M]
            lam = torch.sigmoid(logit.float())
            cdf = cdf + lam * surv
            surv = surv * (1.0 - lam)
            new_gate = torch.stack((surv, cdf), dim=1)  # [M, 2]
            crossed = cdf >= r.tensor(thr, torch.float32)  # [M]
            self.outputs.add("gate", new_gate)
            self.outputs.add("crossed", crossed)
            if gate_mode:
                crossed_now = crossed.tolist()  # in-step read: gate mode is synchronous
        exited = []
        for k, (i, spec) in enumerate(zip(out, specs)):
            h = held[i]
            if new_gate is not None:
                h.gate_src, h.gate_row = new_gate, k
            mode = spec.mode
            if mode == "fixed":
                now = spec.exit_now
            elif items[i].depth >= spec.max_loops:
                now = True
            elif mode == "delayed":
                now = h.pending
            else:
                now = bool(crossed_now and crossed_now[k])
            h.exited = now
            exited.append(now)
        return exited

    def _copy_on_exit(self) -> None:
        """last_exited: the exit-depth K/V of a token stopping early serves deeper planes."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.r.block_size
        exits = [i for i, x in zip(self.out, self.exited) if x]
        # A token recomputed after preemption carries copy blocks (and no exit) at its last loop.
        exits += [i for i, it in enumerate(self.items) if it.exit is None and it.exit_copy_blocks]
        for i in exits:
            it = self.items[i]
            if not it.exit_copy_blocks:
                continue
            # An exiting output copies position start; a recomputed chunk copies every position
            # (its blocks are listed position by position).
            positions = range(it.start, it.end) if it.exit is None else (it.start,)
            per = len(it.exit_copy_blocks) // len(positions)
            for k, q in enumerate(positions):
                offset = q % bs
                slot = it.block_table[q // bs] * bs + offset
                for block in it.exit_copy_blocks[k * per : (k + 1) * per]:
                    src.append(slot)
                    dst.append(block * bs + offset)
        if src:
            copy_slots(self.r.kv, self.r.tensor(src), self.r.tensor(dst))

    def _coda_and_sample(
        self,
        positions: torch.Tensor,
        state: torch.Tensor,
        ending: list[int],
        exited: set[int],
    ) -> list[int]:
        """Coda for finishing rows, logits + sampling for exited output rows. Returns the items
        that sampled; their tokens become the requests' next inputs on the device."""
        r, items, lives, offsets = self.r, self.items, self.lives, self.offsets
        boundary = r.spec.num_boundary_layers > 0
        # With coda attention every row of an ending item writes coda KV that later tokens read.
        coda_items = sorted(set(ending) | exited) if boundary else sorted(exited)
        if not coda_items:
            return []
        if boundary:
            rows = [row for i in coda_items for row in range(offsets[i], offsets[i + 1])]
            spans = [
                (items[i].start, items[i].num_tokens, items[i].boundary_table) for i in coda_items
            ]
            attn = r.attention(spans)
            widths = [offsets[i + 1] - offsets[i] for i in coda_items]
        else:
            rows = [offsets[i + 1] - 1 for i in coda_items]
            attn = None
            widths = [1] * len(coda_items)
        index = r.tensor(rows)
        hidden = r.timed(
            r.model.coda, state.index_select(0, index), positions.index_select(0, index), attn
        )
        sample_items = [i for i in coda_items if i in exited]
        if not sample_items:
            return []  # coda rows that only write coda KV (non-final prompt chunks)
        ends = _offsets(widths)
        last = {i: ends[k + 1] - 1 for k, i in enumerate(coda_items)}  # an item's output row
        pick = r.tensor([last[i] for i in sample_items])
        logits = r.timed(r.model.logits, hidden.index_select(0, pick))  # [M, V] fp32
        r.logits_width = logits.shape[-1]
        sample_rows = [lives[i].sample_row for i in sample_items]
        self.sample = r.sampler.sample_device(logits, sample_rows)
        tokens = self.sample.token_ids
        for k, i in enumerate(sample_items):  # the next decode token's input
            live = lives[i]
            live.last_tokens, live.last_row = tokens, k
        for name, tensor in self.sample.tensors().items():
            self.outputs.add("sample." + name, tensor)
        self.num_coda_rows = len(sample_items)
        return sample_items

    def _draft(self, positions: torch.Tensor, state: torch.Tensor) -> list[Draft]:
        """Token pipelining: the greedy prediction from a token's state at ``draft_loops``
        becomes the input of the next position, which enters loop 1 in the next step."""
        r, items = self.r, self.items
        drafting = [i for i, it in enumerate(items) if it.draft]
        if not drafting:
            return []
        rows = r.tensor([self.offsets[i + 1] - 1 for i in drafting])
        hidden = r.timed(
            r.model.coda, state.index_select(0, rows), positions.index_select(0, rows), None
        )
        tokens = r.timed(r.model.logits, hidden).argmax(dim=-1)  # [K]
        drafts = [Draft(tokens, k) for k in range(len(drafting))]
        for i, draft in zip(drafting, drafts):
            self.lives[i].drafts[items[i].end] = draft
        self.outputs.add("drafts", tokens)
        return drafts

    # ---------------------------------------------------------------- delivery

    def results(self) -> list[ItemResult | None]:
        """Reads the staged outputs on the host and builds the items' results, updating the
        host copies of device state (delayed decisions, drafts, history, rollbacks)."""
        r, items, lives, held = self.r, self.items, self.lives, self.held
        host = self.outputs.read()
        for draft, value in zip(self.drafts, host.get("drafts", [])):
            draft.value = value
        sample = None
        if self.sampled:
            prefix = "sample."
            sample = self.sample.to_output(
                {k[len(prefix) :]: v for k, v in host.items() if k.startswith(prefix)}
            )
        out, exited = self.out, self.exited
        gates = host.get("gate") or [(1.0, 0.0)] * len(out)
        crossed = host.get("crossed") or [False] * len(out)
        row_of = {i: k for k, i in enumerate(self.sampled)}
        results: list[ItemResult | None] = [None] * len(items)
        rollbacks: list[int] = []
        for i, ex, (survival, cdf), cr in zip(out, exited, gates, crossed):
            exit_next = bool(cr and not ex and items[i].exit.mode == "delayed")
            held[i].pending = exit_next
            j = row_of.get(i) if row_of else None
            if j is None:  # no token this loop (positional: one is built per row per step)
                results[i] = ItemResult(ex, survival, cdf, exit_next)
                continue
            token = sample.token_ids[j]
            checked = items[i].end in lives[i].drafts
            rollback = lives[i].commit(items[i].end, token)
            r.drafts_checked += checked
            if rollback:
                rollbacks.append(i)
                r.drafts_rejected += 1
            results[i] = ItemResult(
                exited=ex,
                survival=survival,
                cdf=cdf,
                exit_next=exit_next,
                token_id=token,
                logprob=sample.logprobs[j],
                top_logprobs=sample.top_logprobs[j],
                rollback=rollback,
                finite=sample.finite[j],
            )
        for i in rollbacks:  # after the states were stored, so the discarded items stay discarded
            lives[i].rollback(items[i].end)
        return results


def _gather_tokens(refs: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """[len(refs)] int64: row ``row`` of each ``(tensor, row)``; the tensor itself when the
    rows are all of one tensor, in order."""
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
    return _gather_rows(sources, picks, in_order=True)


def _gather_rows(
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
    bases = _offsets([src.shape[0] for src in sources])
    index: list[int] = []
    for k, row, n in picks:
        first = bases[k] + row
        if n == 1:
            index.append(first)
        else:
            index.extend(range(first, first + n))
    data = torch.cat(sources) if len(sources) > 1 else sources[0]
    return data.index_select(0, to_device(index, data.device))


def _offsets(counts: list[int]) -> list[int]:
    return list(accumulate(counts, initial=0))
