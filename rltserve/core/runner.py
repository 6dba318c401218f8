"""ModelRunner: StepPlan -> tensors -> one model pass -> sampling -> StepResult.

The only torch user in ``rltserve.core`` besides attention and sampling. It never mutates a
request; what it keeps between steps is device state keyed by request id: the hidden state (and
input injection) of each in-flight work item, and each request's sampling generator.

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
from rltserve.core.plan import ItemResult, RequestSetup, StepPlan, StepResult, WorkItem
from rltserve.core.sampler import Sampler, SampleRow
from rltserve.models.base import LoopedModel


class ExecutionFuture:
    """A submitted step. ``result()`` blocks until the step's StepResult is available."""

    def __init__(self, future: Future[StepResult]) -> None:
        self._future = future

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
        self._setups: dict[str, RequestSetup] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        # request id -> (state [n, S], e [n, E] or None) of its in-flight item
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._keeps_e = self.spec.needs_noise  # only Huginn re-injects e every loop
        self._executor: ThreadPoolExecutor | None = None
        self.model_seconds = 0.0  # wall time inside model calls, for overhead measurements

    # ---------------------------------------------------------------- execution

    def submit(self, plan: StepPlan) -> ExecutionFuture:
        """Runs the step on the executor thread (torch releases the GIL while it computes)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="rltserve-step")
        return ExecutionFuture(self._executor.submit(self.execute, plan))

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def execute(self, plan: StepPlan) -> StepResult:
        try:
            with torch.inference_mode():
                return self._execute(plan)
        except Exception as exc:  # a failed step fails its requests, not the engine
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            return StepResult(plan.step_id, [None] * len(plan.items), error=detail)

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.model_seconds += time.perf_counter() - start
        return out

    def _execute(self, plan: StepPlan) -> StepResult:
        self._update_requests(plan)
        items = plan.items
        if not items:
            return StepResult(plan.step_id, [])
        counts = [item.num_tokens for item in items]
        positions = _positions(items, self.device)  # [N]
        state, e = self._gather_inputs(items, positions)

        core = PagedAttention(
            self.kv,
            AttentionMetadata.build(
                [(it.start, it.num_tokens, it.block_table) for it in items],
                self.block_size,
                self.device,
            ),
        )
        state = self._timed(self.model.loop, state, e, positions, core)  # [N, S]

        offsets = _offsets(counts)
        out_items = [i for i, it in enumerate(items) if it.exit is not None]
        exited, survival, cdf = self._decide_exits(items, out_items, offsets, state)
        self._copy_on_exit(items, out_items, exited)

        exited_set = {i for i, x in zip(out_items, exited) if x}
        ending = [
            i
            for i, it in enumerate(items)
            if it.depth >= it.ends_at or (it.stop_at_exit and i in exited_set)
        ]
        samples = self._coda_and_sample(items, offsets, positions, state, ending, exited_set)

        results: list[ItemResult | None] = [None] * len(items)
        for k, i in enumerate(out_items):
            token = samples.get(i)
            results[i] = ItemResult(
                exited=exited[k],
                survival=survival[k],
                cdf=cdf[k],
                token_id=token[0] if token else -1,
                logprob=token[1] if token else None,
                top_logprobs=token[2] if token else None,
            )
        self._store_states(items, offsets, state, e, set(ending))
        return StepResult(
            plan.step_id,
            results,
            num_rows=int(positions.shape[0]),
            num_coda_rows=len(samples),
        )

    # ---------------------------------------------------------------- pieces

    def _update_requests(self, plan: StepPlan) -> None:
        for rid in plan.released:
            self._setups.pop(rid, None)
            self._generators.pop(rid, None)
            self._states.pop(rid, None)
        for setup in plan.new_requests:
            self._setups[setup.request_id] = setup
            gen = None
            if not setup.params.greedy:
                gen = torch.Generator(device=self.device).manual_seed(setup.seed)
            self._generators[setup.request_id] = gen

    def _gather_inputs(
        self, items: list[WorkItem], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        entering = [it for it in items if it.depth == 1]
        fresh_state: list[torch.Tensor] = []
        fresh_e: list[torch.Tensor] = []
        if entering:
            ids = torch.tensor(
                [t for it in entering for t in it.token_ids], dtype=torch.long, device=self.device
            )
            pos = _positions(entering, self.device)
            boundary = None
            if self.spec.num_boundary_layers:
                boundary = PagedAttention(
                    self.kv,
                    AttentionMetadata.build(
                        [(it.start, it.num_tokens, it.boundary_table) for it in entering],
                        self.block_size,
                        self.device,
                    ),
                )
            e_new = self._timed(self.model.prelude, ids, pos, boundary)  # [n_enter, E]
            noise = None
            if self.spec.needs_noise:
                noise = torch.cat([self._noise(it) for it in entering]).to(self.device)
            s_new = self.model.initial_state(e_new, noise)  # [n_enter, S]
            fresh_state = list(s_new.split([it.num_tokens for it in entering]))
            fresh_e = list(e_new.split([it.num_tokens for it in entering]))
        states: list[torch.Tensor] = []
        injections: list[torch.Tensor] = []
        k = 0
        for it in items:
            if it.depth == 1:
                states.append(fresh_state[k])
                injections.append(fresh_e[k])
                k += 1
            else:
                s, e = self._states[it.request_id]
                states.append(s)
                if e is not None:
                    injections.append(e)
        state = torch.cat(states) if len(states) > 1 else states[0]
        if not self._keeps_e:
            return state, None
        return state, torch.cat(injections) if len(injections) > 1 else injections[0]

    def _noise(self, item: WorkItem) -> torch.Tensor:
        setup = self._setups[item.request_id]
        seed = setup.seed if setup.params.init_state == "random" else None
        return self.model.draw_noise(seed, list(range(item.start, item.end)))

    def _decide_exits(
        self, items: list[WorkItem], out_items: list[int], offsets: list[int], state: torch.Tensor
    ) -> tuple[list[bool], list[float], list[float]]:
        """Applies the exit rule to the output rows: fp32, the same arithmetic as the reference
        (p = lam * S; S' = S * (1 - lam); CDF' = CDF + p)."""
        if not out_items:
            return [], [], []
        specs = [items[i].exit for i in out_items]
        rows = torch.tensor([offsets[i + 1] - 1 for i in out_items], device=self.device)
        surv = torch.tensor([s.survival for s in specs], dtype=torch.float32, device=self.device)
        cdf = torch.tensor([s.cdf for s in specs], dtype=torch.float32, device=self.device)
        logit = self._timed(self.model.exit_logit, state.index_select(0, rows))
        if logit is not None:
            lam = torch.sigmoid(logit.float())
            p = lam * surv
            surv = surv * (1.0 - lam)
            cdf = cdf + p
        depth = torch.tensor([items[i].depth for i in out_items], device=self.device)
        min_l = torch.tensor([s.min_loops for s in specs], device=self.device)
        max_l = torch.tensor([s.max_loops for s in specs], device=self.device)
        thr = torch.tensor([s.threshold for s in specs], dtype=torch.float32, device=self.device)
        gate_exit = (depth >= max_l) | ((thr < 1.0) & (depth >= min_l) & (cdf >= thr))
        decided = gate_exit.tolist()
        exited = [d if s.exit_now is None else s.exit_now for s, d in zip(specs, decided)]
        return exited, surv.tolist(), cdf.tolist()

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
        offsets: list[int],
        positions: torch.Tensor,
        state: torch.Tensor,
        ending: list[int],
        exited: set[int],
    ) -> dict[int, tuple[int, float | None, list[tuple[int, float]] | None]]:
        """Coda for finishing rows, logits + sampling for exited output rows."""
        if self.spec.num_boundary_layers:
            # Coda attention: every row of an ending item writes coda KV that later tokens read.
            coda_items = sorted(set(ending) | exited)
        else:
            coda_items = sorted(exited)
        if not coda_items:
            return {}
        if self.spec.num_boundary_layers:
            rows = [r for i in coda_items for r in range(offsets[i], offsets[i + 1])]
            spans = [
                (items[i].start, items[i].num_tokens, items[i].boundary_table) for i in coda_items
            ]
            attn = PagedAttention(
                self.kv, AttentionMetadata.build(spans, self.block_size, self.device)
            )
        else:
            rows = [offsets[i + 1] - 1 for i in coda_items]
            attn = None
        index = torch.tensor(rows, device=self.device)
        hidden = self._timed(
            self.model.coda, state.index_select(0, index), positions.index_select(0, index), attn
        )
        # The output row of item i is its last coda row.
        sample_items = [i for i in coda_items if i in exited]
        ends = _offsets(
            [
                (offsets[i + 1] - offsets[i]) if self.spec.num_boundary_layers else 1
                for i in coda_items
            ]
        )
        last = {i: ends[k + 1] - 1 for k, i in enumerate(coda_items)}
        pick = torch.tensor([last[i] for i in sample_items], device=self.device)
        logits = self._timed(self.model.logits, hidden.index_select(0, pick))  # [M, V] fp32
        sample_rows = [
            SampleRow(
                params=self._setups[items[i].request_id].params,
                generator=self._generators.get(items[i].request_id),
                penalty_tokens=items[i].penalty_tokens,
            )
            for i in sample_items
        ]
        out = self.sampler.sample(logits, sample_rows)
        return {
            i: (out.token_ids[k], out.logprobs[k], out.top_logprobs[k])
            for k, i in enumerate(sample_items)
        }

    def _store_states(
        self,
        items: list[WorkItem],
        offsets: list[int],
        state: torch.Tensor,
        e: torch.Tensor | None,
        ending: set[int],
    ) -> None:
        for i, it in enumerate(items):
            if i in ending:
                self._states.pop(it.request_id, None)
                continue
            lo, hi = offsets[i], offsets[i + 1]
            self._states[it.request_id] = (state[lo:hi], None if e is None else e[lo:hi])


def _offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _positions(items: list[WorkItem], device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [p for it in items for p in range(it.start, it.end)], dtype=torch.long, device=device
    )
