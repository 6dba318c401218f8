"""ModelRunner: StepPlan -> tensors -> one model pass -> sampling -> StepResult.

The only torch user in ``rltserve.core`` besides attention and sampling. It never mutates a
request. Between steps it keeps per-request execution state (``LiveRequest``): the hidden state
of the in-flight work item, the exit-gate state of its output position, the last sampled token
(the next decode token's input) and the sampling generator. Because the runner owns these, the
scheduler can plan a step before it has read the previous step's result.

One step: the prelude runs for items entering loop 1; every item runs one loop at its own depth
(each reads and writes the KV plane of that depth); the exit rule runs for output positions; the
coda, logits and sampler run for rows that finished.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from rltserve.core.attention import AttentionMetadata, PagedAttention, allocate_kv_cache, copy_slots
from rltserve.core.live import ItemState, LiveRequest
from rltserve.core.plan import ItemResult, StepPlan, StepResult, WorkItem
from rltserve.core.sampler import Sampler, SampleRow
from rltserve.models.base import LoopedModel


class ExecutionFuture:
    """A submitted step. ``result()`` blocks until the step's StepResult is available."""

    def __init__(self, future: Future[StepResult]) -> None:
        self._future = future

    @classmethod
    def completed(cls, result: StepResult) -> ExecutionFuture:
        """A step that already ran (synchronous execution)."""
        future: Future[StepResult] = Future()
        future.set_result(result)
        return cls(future)

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> StepResult:
        return self._future.result()

    def wait(self) -> asyncio.Future[StepResult]:
        """Awaitable form for an asyncio loop."""
        return asyncio.wrap_future(self._future)


class ModelRunner:
    def __init__(
        self,
        model: LoopedModel,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        num_layers = max(self.spec.num_core_layers, self.spec.num_boundary_layers)
        # Core and boundary planes draw blocks from one pool, so they share one slot space.
        self.kv = allocate_kv_cache(
            num_layers,
            num_blocks,
            block_size,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.dtype,
            self.device,
        )
        self.sampler = Sampler()
        self.live: dict[str, LiveRequest] = {}
        self._keeps_e = self.spec.needs_noise  # only Huginn re-injects e every loop
        self._executor = executor  # the thread steps run on when submitted
        self.model_seconds = 0.0  # wall time inside model calls, for overhead measurements
        self.busy_seconds = 0.0  # wall time executing steps
        self.drafts_checked = 0  # token pipelining: drafts compared with the committed token
        self.drafts_rejected = 0

    # ---------------------------------------------------------------- execution

    def submit(self, plan: StepPlan) -> ExecutionFuture:
        """Runs the step on the executor thread (torch releases the GIL while it computes).
        Steps run one at a time in submission order."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="rltserve-step")
        return ExecutionFuture(self._executor.submit(self.execute, plan))

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                return self._execute(plan)
        except Exception as exc:  # a failed step fails its requests, not the engine
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            for item in plan.items:  # their device state is unknown now
                self.live.pop(item.request_id, None)
            return StepResult(plan.step_id, [None] * len(plan.items), error=detail)
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _attention(self, spans: list[tuple[int, int, list[int]]]) -> PagedAttention:
        """Attention over ``(start, num_tokens, block_table)`` spans, one per item."""
        return PagedAttention(self.kv, AttentionMetadata.build(spans, self.block_size, self.device))

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.model_seconds += time.perf_counter() - start
        return out

    def _execute(self, plan: StepPlan) -> StepResult:
        self._update_requests(plan)
        # Items planned before a rollback this runner already did are stale: skip them.
        active = [
            k for k, it in enumerate(plan.items) if it.epoch >= self.live[it.request_id].epoch
        ]
        results: list[ItemResult | None] = [None] * len(plan.items)
        if not active:
            return StepResult(plan.step_id, results)
        sub, rows, coda_rows = self._run([plan.items[k] for k in active])
        for k, result in zip(active, sub):
            results[k] = result
        return StepResult(plan.step_id, results, num_rows=rows, num_coda_rows=coda_rows)

    def _run(self, items: list[WorkItem]) -> tuple[list[ItemResult | None], int, int]:
        lives = [self.live[it.request_id] for it in items]
        offsets = _offsets([it.num_tokens for it in items])
        positions = _positions(items, self.device)  # [N]
        state, e = self._gather_inputs(items, lives, positions)

        core = self._attention([(it.start, it.num_tokens, it.block_table) for it in items])
        state = self._timed(self.model.loop, state, e, positions, core)  # [N, S]

        held = [live.items[it.start] for it, live in zip(items, lives)]
        out_items = [i for i, it in enumerate(items) if it.exit is not None and not held[i].exited]
        exited, exit_next = self._decide_exits(items, held, out_items, offsets, state)
        self._copy_on_exit(items, out_items, exited)

        exited_set = {i for i, x in zip(out_items, exited) if x}
        ending = [
            i
            for i, it in enumerate(items)
            if it.depth >= it.ends_at or (it.stop_at_exit and i in exited_set)
        ]
        samples = self._coda_and_sample(items, lives, offsets, positions, state, ending, exited_set)
        self._draft(items, lives, offsets, positions, state)

        results: list[ItemResult | None] = [None] * len(items)
        rollbacks: list[int] = []
        for k, i in enumerate(out_items):
            token = samples.get(i)
            gate = held[i]
            checked = token is not None and items[i].end in lives[i].drafts
            rollback = token is not None and lives[i].commit(items[i].end, token[0])
            self.drafts_checked += checked
            if rollback:
                rollbacks.append(i)
                self.drafts_rejected += 1
            results[i] = ItemResult(
                exited=exited[k],
                survival=gate.survival,
                cdf=gate.cdf,
                exit_next=exit_next[k],
                token_id=token[0] if token else -1,
                logprob=token[1] if token else None,
                top_logprobs=token[2] if token else None,
                rollback=rollback,
            )
        ending_set = set(ending)
        for i, (it, live) in enumerate(zip(items, lives)):
            if i in ending_set:
                del live.items[it.start]
            else:
                lo, hi = offsets[i], offsets[i + 1]
                held[i].state = state[lo:hi]
                held[i].e = None if e is None else e[lo:hi]
        for i in rollbacks:  # after storing states, so the discarded items stay discarded
            lives[i].rollback(items[i].end)
        return results, int(positions.shape[0]), len(samples)

    def _draft(
        self,
        items: list[WorkItem],
        lives: list[LiveRequest],
        offsets: list[int],
        positions: torch.Tensor,
        state: torch.Tensor,
    ) -> None:
        """Token pipelining: the greedy prediction from a token's state at ``draft_loops``
        becomes the input of the next position, which enters loop 1 in the next step."""
        drafting = [i for i, it in enumerate(items) if it.draft]
        if not drafting:
            return
        rows = torch.tensor([offsets[i + 1] - 1 for i in drafting], device=self.device)
        hidden = self._timed(
            self.model.coda, state.index_select(0, rows), positions.index_select(0, rows), None
        )
        tokens = self._timed(self.model.logits, hidden).argmax(dim=-1).tolist()
        for i, token in zip(drafting, tokens):
            lives[i].drafts[items[i].end] = token

    # ---------------------------------------------------------------- pieces

    def _update_requests(self, plan: StepPlan) -> None:
        for rid in plan.released:
            self.live.pop(rid, None)
        for setup in plan.new_requests:
            self.live[setup.request_id] = LiveRequest.create(setup, self.device)

    def _gather_inputs(
        self, items: list[WorkItem], lives: list[LiveRequest], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        entering = [i for i, it in enumerate(items) if it.depth == 1]
        fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if entering:
            ids = torch.tensor(
                [t for i in entering for t in _input_ids(items[i], lives[i])],
                dtype=torch.long,
                device=self.device,
            )
            sub = [items[i] for i in entering]
            pos = _positions(sub, self.device)
            boundary = None
            if self.spec.num_boundary_layers:
                spans = [(it.start, it.num_tokens, it.boundary_table) for it in sub]
                boundary = self._attention(spans)
            e_new = self._timed(self.model.prelude, ids, pos, boundary)  # [n_enter, E]
            noise = None
            if self.spec.needs_noise:
                noise = torch.cat([self._noise(it, lives[i]) for i, it in zip(entering, sub)])
                noise = noise.to(self.device)
            s_new = self.model.initial_state(e_new, noise)  # [n_enter, S]
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
            if self._keeps_e:
                injections.append(e)
        state = torch.cat(states) if len(states) > 1 else states[0]
        if not self._keeps_e:
            return state, None
        return state, torch.cat(injections) if len(injections) > 1 else injections[0]

    def _noise(self, item: WorkItem, live: LiveRequest) -> torch.Tensor:
        seed = live.setup.seed if live.setup.params.init_state == "random" else None
        return self.model.draw_noise(seed, list(range(item.start, item.end)))

    def _decide_exits(
        self,
        items: list[WorkItem],
        held: list[ItemState],
        out_items: list[int],
        offsets: list[int],
        state: torch.Tensor,
    ) -> tuple[list[bool], list[bool]]:
        """The exit rule for the output rows, in fp32 with the reference's arithmetic:
        lam = sigmoid(g); p = lam * S; S' = S * (1 - lam); CDF' = CDF + p."""
        if not out_items:
            return [], []
        specs = [items[i].exit for i in out_items]
        gates = [held[i] for i in out_items]
        dev = self.device
        rows = torch.tensor([offsets[i + 1] - 1 for i in out_items], device=dev)
        surv = torch.tensor([g.survival for g in gates], dtype=torch.float32, device=dev)
        cdf = torch.tensor([g.cdf for g in gates], dtype=torch.float32, device=dev)
        logit = self._timed(self.model.exit_logit, state.index_select(0, rows))
        if logit is not None:
            lam = torch.sigmoid(logit.float())
            cdf = cdf + lam * surv
            surv = surv * (1.0 - lam)
        depth = torch.tensor([items[i].depth for i in out_items], device=dev)
        min_l = torch.tensor([s.min_loops for s in specs], device=dev)
        max_l = torch.tensor([s.max_loops for s in specs], device=dev)
        thr = torch.tensor([s.threshold for s in specs], dtype=torch.float32, device=dev)
        crossed = ((thr < 1.0) & (depth >= min_l) & (cdf >= thr)).tolist()
        capped = (depth >= max_l).tolist()
        exited: list[bool] = []
        exit_next: list[bool] = []
        for k, (spec, gate) in enumerate(zip(specs, gates)):
            if spec.mode == "fixed":
                now = spec.exit_now
            elif spec.mode == "delayed":
                now = capped[k] or gate.pending
            else:
                now = capped[k] or crossed[k]
            gate.pending = spec.mode == "delayed" and crossed[k] and not now
            exited.append(now)
            exit_next.append(gate.pending)
        for gate, s, c, x in zip(gates, surv.tolist(), cdf.tolist(), exited):
            gate.survival, gate.cdf = s, c
            gate.exited = x
        return exited, exit_next

    def _copy_on_exit(self, items: list[WorkItem], out_items: list[int], exited: list[bool]):
        """last_exited: the exit-depth K/V of a token stopping early serves deeper planes."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.block_size
        for i, x in zip(out_items, exited):
            it = items[i]
            if not x or not it.exit_copy_blocks:
                continue
            offset = it.start % bs
            slot = it.block_table[it.start // bs] * bs + offset
            for block in it.exit_copy_blocks:
                src.append(slot)
                dst.append(block * bs + offset)
        if src:
            copy_slots(
                self.kv,
                torch.tensor(src, device=self.device),
                torch.tensor(dst, device=self.device),
            )

    def _coda_and_sample(
        self,
        items: list[WorkItem],
        lives: list[LiveRequest],
        offsets: list[int],
        positions: torch.Tensor,
        state: torch.Tensor,
        ending: list[int],
        exited: set[int],
    ) -> dict[int, tuple[int, float | None, list[tuple[int, float]] | None]]:
        """Coda for finishing rows, logits + sampling for exited output rows."""
        boundary = self.spec.num_boundary_layers > 0
        # With coda attention every row of an ending item writes coda KV that later tokens read.
        coda_items = sorted(set(ending) | exited) if boundary else sorted(exited)
        if not coda_items:
            return {}
        if boundary:
            rows = [r for i in coda_items for r in range(offsets[i], offsets[i + 1])]
            spans = [
                (items[i].start, items[i].num_tokens, items[i].boundary_table) for i in coda_items
            ]
            attn = self._attention(spans)
            widths = [offsets[i + 1] - offsets[i] for i in coda_items]
        else:
            rows = [offsets[i + 1] - 1 for i in coda_items]
            attn = None
            widths = [1] * len(coda_items)
        index = torch.tensor(rows, device=self.device)
        hidden = self._timed(
            self.model.coda, state.index_select(0, index), positions.index_select(0, index), attn
        )
        sample_items = [i for i in coda_items if i in exited]
        if not sample_items:
            return {}  # coda rows that only write coda KV (non-final prompt chunks)
        ends = _offsets(widths)
        last = {i: ends[k + 1] - 1 for k, i in enumerate(coda_items)}  # an item's output row
        pick = torch.tensor([last[i] for i in sample_items], device=self.device)
        logits = self._timed(self.model.logits, hidden.index_select(0, pick))  # [M, V] fp32
        sample_rows = [
            SampleRow(
                params=lives[i].setup.params,
                generator=lives[i].generator,
                penalty_tokens=lives[i].penalty_tokens(),
            )
            for i in sample_items
        ]
        out = self.sampler.sample(logits, sample_rows)
        for k, i in enumerate(sample_items):
            lives[i].record(out.token_ids[k])
        return {
            i: (out.token_ids[k], out.logprobs[k], out.top_logprobs[k])
            for k, i in enumerate(sample_items)
        }


def _input_ids(item: WorkItem, live: LiveRequest) -> list[int]:
    if item.token_ids is not None:
        return item.token_ids
    if item.start in live.drafts:
        return [live.drafts[item.start]]
    if live.last_token is None:
        raise RuntimeError(f"{item.request_id}: decode input requested before any token")
    return [live.last_token]


def _offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _positions(items: list[WorkItem], device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [p for it in items for p in range(it.start, it.end)], dtype=torch.long, device=device
    )
