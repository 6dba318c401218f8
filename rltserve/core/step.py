"""One step's work on the runner's state: ``Step.run()`` queues it, ``Step.results()`` reads it.

``run``: the prelude for items entering loop 1 (prompt chunks from the plan, decode tokens from
the device tensors of the last sampled token or a draft), one loop for every row, the exit rule
for output positions, copy-on-exit, the coda and sampling for rows that finished, drafts. Device
results are collected in ``StepOutputs``. ``results``: reads them on the host and updates the
host copies of device state (delayed-exit decisions, draft values, penalty history, rollbacks).
"""

from __future__ import annotations

from math import inf

import torch

from rltserve.core.attention import copy_slots
from rltserve.core.live import Draft, ItemState, LiveRequest
from rltserve.core.plan import ItemResult, WorkItem
from rltserve.core.sampler import SampleRow
from rltserve.core.staging import StepOutputs, move_to
from rltserve.core.step_host import StepHost


class Step:
    """One step's work on the runner's state: launched by ``run()``, read by ``results()``."""

    def __init__(self, runner: StepHost, items: list[WorkItem]) -> None:
        self.r = runner
        self.items = items
        self.lives = [runner.live[it.request_id] for it in items]
        self.outputs = StepOutputs(runner.device)
        self.num_rows = sum(it.num_tokens for it in items)
        self.num_coda_rows = 0

    def run(self) -> bool:
        r, items, lives = self.r, self.items, self.lives
        self.offsets = _offsets([it.num_tokens for it in items])
        positions = r.tensor([p for it in items for p in range(it.start, it.end)])  # [N]
        state, e = self._gather_inputs(positions)
        spans = [(it.start, it.num_tokens, it.block_table) for it in items]
        if r.graphs is not None:  # replays decode-only steps, runs the others eagerly
            state = r.timed(r.graphs.run, state, e, spans, positions)  # [N, S]
        else:
            state = r.timed(r.model.loop, state, e, positions, r.attention(spans))  # [N, S]
        # The loop is queued: the device is busy, so waiting for the previous step is free.
        r.deliver()

        held = self.held = [live.items[it.start] for it, live in zip(items, lives)]
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
        sizes = [it.num_tokens for it in items]
        states = state.split(sizes)  # one call for every item's view
        injections = e.split(sizes) if e is not None else [None] * len(items)
        for i, (it, live) in enumerate(zip(items, lives)):
            if i in ending_set:
                del live.items[it.start]
            else:
                held[i].state, held[i].e = states[i], injections[i]
        self.outputs.stage()
        # A sampled token checked against a draft may roll back later items: the next step
        # must see the outcome before it runs, so this step is delivered at once.
        return any(items[i].end in lives[i].drafts for i in self.sampled)

    # ---------------------------------------------------------------- pieces

    def _gather_inputs(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """States entering this loop: the prelude's for items at depth 1 (prompt chunks first,
        then decode tokens, whose inputs are device tensors), the held ones otherwise."""
        r, items, lives = self.r, self.items, self.lives
        prompts = [i for i, it in enumerate(items) if it.depth == 1 and it.token_ids is not None]
        decodes = [i for i, it in enumerate(items) if it.depth == 1 and it.token_ids is None]
        entering = prompts + decodes
        fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if entering:
            parts = []
            if prompts:
                parts.append(r.tensor([t for i in prompts for t in items[i].token_ids]))
            parts += [lives[i].input_token(items[i].start) for i in decodes]
            ids = torch.cat(parts) if len(parts) > 1 else parts[0]  # [n_enter]
            sub = [items[i] for i in entering]
            pos = r.tensor([p for it in sub for p in range(it.start, it.end)])
            boundary = None
            if r.spec.num_boundary_layers:
                boundary = r.attention([(it.start, it.num_tokens, it.boundary_table) for it in sub])
            e_new = r.timed(r.model.prelude, ids, pos, boundary)  # [n_enter, E]
            noise = None
            if r.spec.needs_noise:
                noise = torch.cat([self._noise(it, lives[i]) for i, it in zip(entering, sub)])
                noise = move_to(noise, r.device)
            s_new = r.model.initial_state(e_new, noise)  # [n_enter, S]
            sizes = [it.num_tokens for it in sub]
            for i, s_part, e_part in zip(entering, s_new.split(sizes), e_new.split(sizes)):
                fresh[i] = (s_part, e_part)
                lives[i].items[items[i].start] = ItemState(items[i].start)
        states: list[torch.Tensor] = []
        injections: list[torch.Tensor] = []
        for i, (it, live) in enumerate(zip(items, lives)):
            if i in fresh:
                s, e = fresh[i]
            else:
                item = live.items.get(it.start)
                if item is None:
                    raise RuntimeError(f"{it.request_id}: no in-flight state at {it.start}")
                s, e = item.state, item.e
            states.append(s)
            if r.keeps_e:
                injections.append(e)
        state = torch.cat(states) if len(states) > 1 else states[0]
        if not r.keeps_e:
            return state, None
        return state, torch.cat(injections) if len(injections) > 1 else injections[0]

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
        specs = [items[i].exit for i in out]
        capped = [items[i].depth >= s.max_loops for i, s in zip(out, specs)]
        rows = r.tensor([self.offsets[i + 1] - 1 for i in out])
        logit = r.timed(r.model.exit_logit, state.index_select(0, rows))  # [M] fp32 or None
        crossed_now: list[bool] | None = None
        if logit is not None:
            gate = torch.stack(
                [held[i].gate if held[i].gate is not None else r.gate_init for i in out]
            )
            surv, cdf = gate[:, 0], gate[:, 1]  # [M]
            lam = torch.sigmoid(logit.float())
            cdf = cdf + lam * surv
            surv = surv * (1.0 - lam)
            new_gate = torch.stack((surv, cdf), dim=1)  # [M, 2]
            for i, row in zip(out, new_gate.unbind(0)):
                held[i].gate = row
            # Only the CDF comparison needs the device; the rest of the rule is host-known.
            # Ineligible rows get threshold inf, which no CDF reaches.
            thr = r.tensor(
                [
                    s.threshold if s.threshold < 1.0 and items[i].depth >= s.min_loops else inf
                    for i, s in zip(out, specs)
                ],
                torch.float32,
            )  # [M]
            crossed = cdf >= thr  # [M]
            self.outputs.add("gate", new_gate)
            self.outputs.add("crossed", crossed)
            if any(s.mode == "gate" for s in specs):
                crossed_now = crossed.tolist()  # in-step read: gate mode is synchronous
        exited = []
        for k, (i, spec) in enumerate(zip(out, specs)):
            if spec.mode == "fixed":
                now = spec.exit_now
            elif spec.mode == "delayed":
                now = capped[k] or held[i].pending
            else:
                now = capped[k] or bool(crossed_now and crossed_now[k])
            held[i].exited = now
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
        sample_rows = [
            SampleRow(
                params=lives[i].setup.params,
                generator=lives[i].generator,
                penalty_tokens=lives[i].penalty_tokens(),
            )
            for i in sample_items
        ]
        self.sample = r.sampler.sample_device(logits, sample_rows)
        for i, token in zip(sample_items, self.sample.token_ids.split(1)):
            lives[i].last_token = token  # [1]: the next decode token's input
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
        drafts = [Draft(token) for token in tokens.split(1)]
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
        gates, crossed = host.get("gate"), host.get("crossed")
        row_of = {i: k for k, i in enumerate(self.sampled)}
        results: list[ItemResult | None] = [None] * len(items)
        rollbacks: list[int] = []
        for k, i in enumerate(self.out):
            spec = items[i].exit
            survival, cdf = gates[k] if gates is not None else (1.0, 0.0)
            exit_next = (
                spec.mode == "delayed" and crossed is not None and crossed[k] and not self.exited[k]
            )
            held[i].pending = exit_next
            token, logprob, top = -1, None, None
            rollback = False
            finite = True
            j = row_of.get(i)
            if j is not None:
                token, logprob, top = (
                    sample.token_ids[j],
                    sample.logprobs[j],
                    sample.top_logprobs[j],
                )
                finite = sample.finite[j]
                checked = items[i].end in lives[i].drafts
                rollback = lives[i].commit(items[i].end, token)
                r.drafts_checked += checked
                if rollback:
                    rollbacks.append(i)
                    r.drafts_rejected += 1
            results[i] = ItemResult(
                exited=self.exited[k],
                survival=survival,
                cdf=cdf,
                exit_next=exit_next,
                token_id=token,
                logprob=logprob,
                top_logprobs=top,
                rollback=rollback,
                finite=finite,
            )
        for i in rollbacks:  # after the states were stored, so the discarded items stay discarded
            lives[i].rollback(items[i].end)
        return results


def _offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out
