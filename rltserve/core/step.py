"""One step's work on the runner's state: ``Step.run()`` queues it, ``Step.results()`` reads it.

``run``: the prelude for items entering loop 1 (prompt chunks from the plan, decode tokens from
the device tensors of the last sampled token or a draft), one loop for every row, the exit rule
for output positions, copy-on-exit, the coda and sampling for rows that finished, drafts. Device
results are collected in ``StepOutputs``. ``results`` (``step_results.py``): reads them on the
host and updates the host copies of device state (delayed-exit decisions, draft values,
penalty history, rollbacks).
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import compress, repeat
from operator import is_, is_not

import torch

from rltserve.core import step_exits, step_results, step_rows
from rltserve.core.live import Draft, ItemState, LiveRequest, PendingRows
from rltserve.core.plan import CarriedEvents, ItemResult, WorkItem
from rltserve.core.sampler import DeviceSample, SampleRow, token_ranks
from rltserve.core.staging import StepOutputs, move_to
from rltserve.core.step_host import StepHost

PROMPT_SLAB = 256  # prompt_logprobs: rows whose logits are computed at a time


class Step:
    """One step's work on the runner's state: launched by ``run()``, read by ``results()``.

    Per-row work is done column by column (``map`` over the items and their states) where a
    loop over rows would cost a Python iteration each; steps of decode rows (every item one
    row, its state the previous step's row in order, every item an output position) take
    fast paths that skip the general bookkeeping.
    """

    def __init__(self, runner: StepHost, items: list[WorkItem], num_carried: int = 0) -> None:
        self.r = runner
        self.items = items  # the runner's carried tokens (``num_carried``) first
        self.num_carried = num_carried
        live = runner.live
        planned = self.planned = items[num_carried:] if num_carried else items
        self.lives = [live[rid] for rid in map(step_rows.RID, planned)]
        # The carried rows' keys (their items are templates: ``carried.py``).
        self.carried_keys: list[int] = []
        if num_carried:  # (the carried rows' are the runner's column)
            self.lives = runner.carried.lives + self.lives
            self.carried_keys = runner.carried.keys
        self.outputs = StepOutputs(runner.device)
        self.num_rows = 0  # set by run()
        self.num_coda_rows = 0
        self.ending: list[int] = []  # set by run(): the items whose loops end here, increasing
        self.exits: list[int] = []  # set by run(): the items whose output exits in this step
        # Rows of carried tokens (a ``carry``: the runner's, then the plan's new ones): their
        # results are ``CarriedEvents``.
        self.carrying = [True] * num_carried + list(
            map(is_not, map(step_rows.CARRY, planned), repeat(None))
        )
        self.num_carrying = self.carrying.count(True)
        self.pending: PendingRows | None = None  # the runner's, when this step's states are it
        self.gate_rows: torch.Tensor | None = None  # [2, M]: the output rows' new gates
        self.modes: tuple[str, ...] = ()  # set by ``decide_exits``: the output rows' modes
        self.kinds: frozenset[str] = frozenset()  # the modes present
        # Set by run(), read by the helpers it calls and by ``step_results`` after it:
        self.starts: list[int] = []  # each item's first position
        self.depths: list[int] = []  # the loop each item runs
        self.one_row = False  # every item is one row
        self.offsets: range | list[int] = range(1)  # item i's rows: offsets[i] .. offsets[i+1]
        self.held: list[ItemState] = []  # each item's state across steps (``_gather_inputs``)
        self.out: range | list[int] = range(0)  # the items whose output position is open
        self.exited: list[bool] = []  # aligned with ``out``: that output exits in this step
        self.sampled: list[int] = []  # the items whose output exited: sampled, in order
        self.scored: list[int] = []  # the items with prompt_targets (prompt_logprobs)
        self.drafts: list[Draft] = []  # token pipelining: this step's drafts
        self.sample: DeviceSample | None = None  # the sampler's result, on the device
        # prompt_logprobs of models with coda attention: (coda output, coda items, widths).
        self._coda_rows: tuple[torch.Tensor, list[int], list[int]] | None = None

    def run(self) -> bool:
        r, items, lives = self.r, self.items, self.lives
        n = len(items)
        nc, planned = self.num_carried, self.planned
        # Positions: a carried row's is the runner's column, not its item's (a template).
        starts = list(map(step_rows.START, planned))
        starts = self.starts = r.carried.starts + starts if nc else starts
        counts = [1] * nc + list(map(step_rows.COUNT, planned))  # (a carried row is a token)
        # The carried rows' moving fields are the runner's columns, not their items' fields.
        self.depths = list(map(step_rows.DEPTH, planned))
        specs = list(map(step_rows.EXIT, planned))
        if nc:
            self.depths = r.carried.depths + self.depths
            specs = r.carried.specs + specs
        self.num_rows = sum(counts)
        # Decode rows: item i is row i (offsets a range), its position its start.
        self.one_row = max(counts) == 1 and self.num_rows == n
        self.offsets = range(n + 1) if self.one_row else step_rows.offsets(counts)
        if r.graphs is not None:  # replays decode-only steps, runs the others eagerly
            tables = list(map(r.carried.table_at, range(nc), self.depths[:nc]))
            spans = list(zip(starts, counts, tables + list(map(step_rows.TABLE, planned))))
            positions = step_rows.row_positions(r, starts, counts)  # [N]
            loop_in, e = self._gather_inputs(starts)
            state = r.timed(r.graphs.run, loop_in, e, spans, positions)  # [N, S]
        else:
            # The metadata's one transfer brings the rows' positions too. The carried rows'
            # tables are rows of the runner's BlockTables already.
            spans = list(zip(starts[nc:], counts[nc:], map(step_rows.TABLE, planned)))
            keys = list(zip(map(step_rows.RID, planned), self.depths[nc:]))
            attn = r.attention(spans, keys, r.carried.spans() if nc else None, self.one_row)
            positions = attn.positions  # [N]
            loop_in, e = self._gather_inputs(starts)
            state = r.timed(r.model.loop, loop_in, e, positions, attn)  # [N, S]
        # The loop is queued: the device is busy, so waiting for the previous step is free.
        r.deliver()

        held = self.held  # each item's ItemState (from _gather_inputs)
        boundary = r.spec.num_boundary_layers > 0
        if boundary and any(map(step_rows.CODA_STATE_AT, planned)):
            for i, w in enumerate(planned, nc):
                if w.coda_state_at == w.depth:  # its coda runs later, on this state
                    row = self.offsets[i + 1] - 1
                    held[i].coda_state = state[row : row + 1].clone()  # [1, S]
        exited_before = any(map(step_rows.EXITED, held))
        if all(specs) and not exited_before:
            self.out = range(n)  # every item's output position is still open
        elif not exited_before:  # (prompt chunks without an output beside decode rows)
            self.out = list(compress(range(n), specs))
        else:
            self.out = [i for i, (x, h) in enumerate(zip(specs, held)) if x and not h.exited]
        self.exited = step_exits.decide_exits(self, loop_in, state, positions, specs)
        exited = self.exited
        exits = self.exits = list(compress(self.out, exited)) if any(exited) else []
        step_rows.copy_on_exit(self.r, self.items, exits, specs, self.depths[:nc], starts)
        depths = self.depths
        ends_at = list(map(step_rows.ENDS_AT, planned))
        ends_at = r.carried.ends + ends_at if nc else ends_at
        if max(depths) < min(ends_at):
            ending = []  # (most steps: no row at its last loop)
        elif min(depths) >= max(ends_at):
            ending = list(range(n))  # (a decode batch's last loop)
        else:
            ending = [i for i, (d, end) in enumerate(zip(depths, ends_at)) if d >= end]
        if exits and len(ending) < n:  # (else every item ends: none stays with an exit)
            stopping = [i for i in exits if items[i].stop_at_exit]
            ending = sorted(set(ending).union(stopping)) if ending else stopping
            staying = set(exits).difference(ending)
            for i in staying:  # an ending item's state goes with it
                held[i].exited = True
        self.ending = ending
        self.sampled = self._coda_and_sample(positions, state, ending, exits, boundary)
        # (A carried row's item is a template, never with prompt targets: the plan's only.)
        self.scored = list(compress(range(nc, n), map(step_rows.PROMPT_TARGETS, planned)))
        if self.scored:
            self._score_prompt(positions, state)
        # (Carried tokens are never pipelined: only the plan's items may draft.)
        drafting = any(map(step_rows.DRAFT, planned))
        self.drafts = self._draft(positions, state) if drafting else []
        # The items' states are rows of this step's output: the next step gathers them in one
        # call. Left pending when no item ends (the next step is likely the same items);
        # written now otherwise. An ending item's state goes.
        pending = PendingRows(held, self.offsets, state, e, self.out, self.gate_rows)
        if not ending:
            r.pending_rows = pending
        else:  # none is left pending: the staying items' states are written now
            r.pending_rows = None
            if len(ending) < len(held):
                pending.settle()
        if planned:
            # ``live.items`` holds the plan's items' states (``_enter``) until they end, or,
            # for its carried tokens, until they join the carried rows after this step
            # (``CarriedRows.keep``), whose ``held`` alone keeps a carried row's state.
            ends = set(ending[bisect_left(ending, nc) :])
            for i, w in enumerate(planned, nc):
                if w.carry is not None or i in ends:
                    del lives[i].items[starts[i]]
        self.outputs.stage()
        # A sampled token checked against a draft may roll back later items: the next step
        # must see the outcome before it runs, so this step is delivered at once.
        if not self.sampled or not any(map(step_rows.DRAFTS, lives)):
            return False
        return any(
            starts[i] + counts[i] in lives[i].drafts for i in self.sampled if lives[i].drafts
        )

    # ---------------------------------------------------------------- pieces

    def _gather_inputs(self, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """States entering this loop: the prelude's for items at depth 1 (prompt chunks first,
        then decode tokens, whose inputs are device tensors), the held ones otherwise, which
        are rows of earlier steps' outputs: one index_select over their sources."""
        r, items, lives = self.r, self.items, self.lives
        nc = self.num_carried
        entered: tuple[list[int], list[ItemState]] = ([], [])
        if 1 in self.depths:
            entered = self._enter([i for i, d in enumerate(self.depths) if d == 1])
        held = [live.items.get(s) for live, s in zip(lives[nc:], starts[nc:])]
        if nc:
            carried = r.carried.held
            if None in carried:  # tokens that joined the rows just now, entered here
                # (Continued and started ones, ``CarriedRows.advance``/``start``: the carried
                # rows at loop 1, the last ones, entered in order.)
                first = carried.index(None)
                order, states = entered
                try:
                    at = order.index(first)
                except ValueError:
                    raise RuntimeError(f"carried row {first}: joined but not entered") from None
                carried[first:] = states[at : at + nc - first]  # (a list of this launch's)
            held = carried + held
        self.held = held
        pending = r.pending_rows
        if pending is not None:
            if held == pending.held:  # the previous step's items, in order: its output
                self.pending = pending
                return pending.state, pending.e
            pending.settle()
            r.pending_rows = None
        # Usually every item's state is rows of one source (an earlier step's output, or the
        # prelude's) and this step's rows are exactly that source's, in order.
        first = held[0]
        src = first.src if first is not None else None
        if (
            src is not None
            and src.shape[0] == self.num_rows
            and all(held)
            and all(map(is_, map(step_rows.SRC, held), repeat(src)))
            and list(map(step_rows.ROW, held)) == list(self.offsets[:-1])
        ):
            return src, first.e_src
        sources: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        source_of: dict[int, int] = {}  # id(state source) -> index in sources
        picks: list[tuple[int, int, int]] = []  # per item: (source, first row, rows)
        last = None
        k = -1
        for it, h, start in zip(items, held, starts):
            if h is None or h.src is None:
                raise RuntimeError(f"{it.request_id}: no in-flight state at {start}")
            if h.src is not last:
                last = h.src
                k = source_of.get(id(last), -1)
                if k < 0:
                    k = source_of[id(last)] = len(sources)
                    sources.append((last, h.e_src))
            picks.append((k, h.row, it.num_tokens))
        state = step_rows.gather_rows([s for s, _ in sources], picks)
        if not r.keeps_e:
            return state, None
        return state, step_rows.gather_rows([e_src for _, e_src in sources], picks)

    def _enter(self, entering: list[int]) -> tuple[list[int], list[ItemState]]:
        """The prelude of the items entering loop 1; each gets a fresh state: rows of the
        prelude's output. Returns the items in the order they entered (prompt chunks first,
        then in item order) and their states."""
        r, items, lives = self.r, self.items, self.lives
        every = len(entering) == len(items)
        # (A carried row entering joined the rows before this step, continued or started: its
        # input is on the runner, whatever its item's ``token_ids``.)
        nc = self.num_carried
        prompts = [i for i in entering if i >= nc and items[i].token_ids is not None]
        if prompts:
            decodes = [i for i in entering if i < nc or items[i].token_ids is None]
            entering = prompts + decodes
            every = False
        else:
            decodes = entering
        parts = step_rows.recorded_inputs(r, items, lives, self.starts, prompts)
        if decodes:  # rows of the tensors that sampled (or drafted) them
            parts.append(self._decode_inputs(decodes))
        ids = torch.cat(parts) if len(parts) > 1 else parts[0]  # [n_enter]
        sub = items if every else [items[i] for i in entering]
        starts = self.starts if every else [self.starts[i] for i in entering]
        counts = list(map(step_rows.COUNT, sub))
        pos = step_rows.row_positions(r, starts, counts)
        boundary = None
        if r.spec.num_boundary_layers:
            boundary = r.attention(
                [(s, it.num_tokens, it.boundary_table) for s, it in zip(starts, sub)],
                [(it.request_id, 0) for it in sub],
            )
        e_new = r.timed(r.model.prelude, ids, pos, boundary)  # [n_enter, E]
        noise = None
        if r.spec.needs_noise:
            noise = torch.cat(
                [self._noise(lives[i], s, n) for i, s, n in zip(entering, starts, counts)]
            )
            noise = move_to(noise, r.device)
        s_new = r.model.initial_state(e_new, noise)  # [n_enter, S]
        e_kept = e_new if r.keeps_e else None
        fresh = list(
            map(ItemState, starts, repeat(s_new), repeat(e_kept), step_rows.offsets(counts))
        )
        if prompts or entering[-1] >= nc:  # (else all are carried rows, in increasing order)
            for i, start, h in zip(entering, starts, fresh):
                if i >= nc:  # (a carried row's state is in ``CarriedRows.held`` alone)
                    lives[i].items[start] = h
        return entering, fresh

    def _decode_inputs(self, decodes: list[int]) -> torch.Tensor:
        """[len(decodes)] int64 on the device: the decode tokens' inputs, each a row of the
        tensor that sampled (or drafted) it; that tensor itself when they are all its rows in
        order (decode rows that all sampled in one step), else one index of it when they are
        all its rows."""
        lives, starts = self.lives, self.starts
        entering = lives if len(decodes) == len(lives) else [lives[i] for i in decodes]
        if not any(map(step_rows.DRAFTS, entering)):
            sources = list(map(step_rows.LAST_TOKENS, entering))
            first = sources[0]
            if first is not None and all(map(is_, sources, repeat(first))):
                rows = list(map(step_rows.LAST_ROW, entering))
                if first.shape[0] == len(rows) and rows == list(range(len(rows))):
                    return first
                return first.index_select(0, self.r.tensor(rows))
        return step_rows.gather_tokens([lives[i].input_token(starts[i]) for i in decodes])

    def _noise(self, live: LiveRequest, start: int, count: int) -> torch.Tensor:
        seed = live.setup.seed if live.setup.params.init_state != "zero" else None
        return self.r.model.draw_noise(seed, list(range(start, start + count)))

    def _coda_and_sample(
        self,
        positions: torch.Tensor,
        state: torch.Tensor,
        ending: list[int],
        exits: list[int],
        boundary: bool,
    ) -> list[int]:
        """Coda for finishing rows, logits + sampling for exited output rows (``exits``, in
        item order; ``boundary``: the model has coda attention). Returns the items that
        sampled; their tokens become the requests' next inputs on the device."""
        r, items, lives, offsets = self.r, self.items, self.lives, self.offsets
        # With coda attention every row of an ending item writes coda KV that later tokens read.
        coda_items = sorted(set(ending).union(exits)) if boundary else exits
        if not coda_items:
            return []
        if boundary:
            # An output position runs its coda once, on its exit state (DESIGN §4): an item
            # whose output exited in an earlier step (``full``: it looped on) ends without it.
            # (Its other rows, a prompt chunk's, still run theirs; of one row none is left.)
            held, exiting = self.held, set(exits)
            counts = {
                i: items[i].num_tokens - (held[i].exited and i not in exiting) for i in coda_items
            }
            coda_items = [i for i in coda_items if counts[i]]
            if not coda_items:
                return []
            rows = [row for i in coda_items for row in range(offsets[i], offsets[i] + counts[i])]
            starts = self.starts
            spans = [(starts[i], counts[i], items[i].boundary_table) for i in coda_items]
            attn = r.attention(spans)
            widths = [counts[i] for i in coda_items]
            # (Kept for the output row, the last: never one whose output exited before.)
            kept = [
                k
                for k, i in enumerate(coda_items)
                if held[i].coda_state is not None and counts[i] == items[i].num_tokens
            ]
        else:
            # (Every row when each item is one and every item's output exits.)
            every = self.one_row and len(coda_items) == len(items)
            rows = range(len(items)) if every else [offsets[i + 1] - 1 for i in coda_items]
            attn = None
            widths = None
            kept = []
        if len(rows) == state.shape[0]:  # every row (rows are increasing)
            coda_in, coda_positions = state, positions
        else:
            index = r.tensor(rows)
            coda_in, coda_positions = state.index_select(0, index), positions.index_select(0, index)
        if kept:  # last rows whose coda input is an earlier loop's state (``coda_state_at``)
            ends = step_rows.offsets(widths)
            at = r.tensor([ends[k + 1] - 1 for k in kept])
            kept_states = torch.cat([held[coda_items[k]].coda_state for k in kept])  # [K, S]
            coda_in = coda_in.index_copy(0, at, kept_states)
        hidden = r.timed(r.model.coda, coda_in, coda_positions, attn)
        if widths is not None:  # (prompt_logprobs read a prompt chunk's rows from here)
            self._coda_rows = (hidden, coda_items, widths)
        if not exits:
            return []  # coda rows that only write coda KV (non-final prompt chunks)
        if widths is not None and max(widths) > 1:
            ends = step_rows.offsets(widths)
            last = {i: ends[k + 1] - 1 for k, i in enumerate(coda_items)}  # an item's output row
            pick = [last[i] for i in exits]
        elif len(exits) == len(coda_items):
            pick = None  # one row per coda item, every one sampling
        else:
            exiting = set(exits)
            pick = [k for k, i in enumerate(coda_items) if i in exiting]
        if pick is not None:
            hidden = hidden.index_select(0, r.tensor(pick))
        logits = r.timed(r.model.logits, hidden)  # [M, V] fp32
        r.logits_width = logits.shape[-1]
        sampling = lives if len(exits) == len(lives) else [lives[i] for i in exits]
        rows = list(map(step_rows.SAMPLE_ROW, sampling))
        banned = self._banned(exits, rows) if any(map(step_rows.BANNED_BELOW, rows)) else ()
        self.sample = r.sampler.sample_device(logits, rows, banned)
        tokens = self.sample.token_ids
        for k, live in enumerate(sampling):  # the next decode token's input
            live.last_tokens, live.last_row = tokens, k
        for name, tensor in self.sample.tensors().items():
            self.outputs.add("sample." + name, tensor)
        self.num_coda_rows = len(exits)
        return exits

    def _score_prompt(self, positions: torch.Tensor, state: torch.Tensor) -> None:
        """prompt_logprobs: the logprobs of the tokens the rows of the items in ``scored``
        predict (their ``prompt_targets``: at their request's ``max_loops``), and the
        top ones, from each row's state now (its coda's output, which models with coda
        attention have computed already: their prompts end at ``max_loops``)."""
        r, items, scored = self.r, self.items, self.scored
        widths = [len(items[i].prompt_targets) for i in scored]
        # (Row ``targets_from`` of an item predicts its first target: ``WorkItem``.)
        if self._coda_rows is not None:
            hidden, coda_items, coda_widths = self._coda_rows
            first = dict(zip(coda_items, step_rows.offsets(coda_widths)))
        else:
            hidden, first = None, self.offsets
        rows = [
            first[i] + items[i].targets_from + k for i, n in zip(scored, widths) for k in range(n)
        ]
        index = r.tensor(rows)
        if hidden is not None:
            hidden = hidden.index_select(0, index)  # [M, E]
        else:
            hidden = r.timed(
                r.model.coda, state.index_select(0, index), positions.index_select(0, index), None
            )
        targets = r.tensor([t for i in scored for t in items[i].prompt_targets])  # [M]
        top = max(items[i].targets_top for i in scored)
        chosen, ranks, values, ids = [], [], [], []
        # In slabs of rows: a long prompt chunk's [M, V] logits would take gigabytes.
        for at in range(0, len(rows), PROMPT_SLAB):
            logp = torch.log_softmax(  # [S, V]
                r.timed(r.model.logits, hidden[at : at + PROMPT_SLAB]), dim=-1
            )
            chosen.append(logp.gather(1, targets[at : at + PROMPT_SLAB, None]).squeeze(1))
            ranks.append(token_ranks(logp, chosen[-1]))  # [S]
            if top:
                slab_values, slab_ids = logp.topk(top, dim=-1)  # [S, top]
                values.append(slab_values)
                ids.append(slab_ids)
        self.outputs.add("prompt.chosen", torch.cat(chosen))  # [M]
        self.outputs.add("prompt.ranks", torch.cat(ranks))  # [M]
        if top:
            self.outputs.add("prompt.top_values", torch.cat(values))  # [M, top]
            self.outputs.add("prompt.top_ids", torch.cat(ids))

    def prompt_results(self) -> dict[int, list[tuple[float, list[tuple[int, float]], int]]]:
        """By item index, the ``scored`` items' (logprob, top logprobs, rank) per prompt
        target."""
        if not self.scored:
            return {}
        host = self.outputs.read()
        chosen, ranks = host["prompt.chosen"], host["prompt.ranks"]
        values, ids = host.get("prompt.top_values"), host.get("prompt.top_ids")
        out, row = {}, 0
        for i in self.scored:
            n = len(self.items[i].prompt_targets)
            k = self.items[i].targets_top
            out[i] = [
                (chosen[j], list(zip(ids[j][:k], values[j][:k])) if k else [], ranks[j])
                for j in range(row, row + n)
            ]
            row += n
        return out

    def _banned(self, exits: list[int], rows: list[SampleRow]) -> list[int]:
        """The sampling rows still short of their request's ``min_tokens``: their token,
        sampled at the item's last position, comes before ``banned_below``."""
        starts, offsets = self.starts, self.offsets  # (a carried row is one token)
        return [
            k
            for k, (i, row) in enumerate(zip(exits, rows))
            if starts[i] + offsets[i + 1] - offsets[i] - 1 < row.banned_below
        ]

    def _draft(self, positions: torch.Tensor, state: torch.Tensor) -> list[Draft]:
        """Token pipelining: the greedy prediction from a token's state at ``draft_loops``
        becomes the input of the next position, which enters loop 1 in the next step."""
        r, items = self.r, self.items
        drafting = [i for i, it in enumerate(items) if it.draft]
        rows = r.tensor([self.offsets[i + 1] - 1 for i in drafting])
        hidden = r.timed(
            r.model.coda, state.index_select(0, rows), positions.index_select(0, rows), None
        )
        tokens = r.timed(r.model.logits, hidden).argmax(dim=-1)  # [K]
        drafts = [Draft(tokens, k) for k in range(len(drafting))]
        for i, draft in zip(drafting, drafts):
            self.lives[i].drafts[self.starts[i] + items[i].num_tokens] = draft
        self.outputs.add("drafts", tokens)
        return drafts

    # ---------------------------------------------------------------- delivery

    def results(self) -> tuple[list[ItemResult | None], CarriedEvents | None]:
        """The items' results and the carried tokens' events (``step_results.read_results``)."""
        return step_results.read_results(self)
