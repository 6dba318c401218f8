"""EngineCore: model + KV + scheduler + runner.

``EngineCore.step()`` is one synchronous plan -> execute -> apply round; ``engine_loop.py``
drives the same core asynchronously for a stage.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from bisect import bisect_left
from operator import attrgetter

import torch

from rltserve.config import EngineConfig
from rltserve.core.engine_info import STEP_ROW_BUCKETS, EngineInfo, EngineStats
from rltserve.core.engine_modes import checked_modes
from rltserve.core.executor import StepThread
from rltserve.core.exit import fixed_exit_depth
from rltserve.core.kv_cache import KVManager, KVPolicy
from rltserve.core.kv_sizing import block_bytes as kv_block_bytes
from rltserve.core.kv_sizing import pool_size
from rltserve.core.kv_transfer import admit_import, export_prompt
from rltserve.core.plan import StepPlan, StepResult
from rltserve.core.prefix_cache import block_hashes, make_salt
from rltserve.core.request import FinishReason, Request
from rltserve.core.request_checks import check_bans, check_params, check_pipelining
from rltserve.core.runner import ModelRunner
from rltserve.core.scheduler import Scheduler
from rltserve.core.swap import SwapSpace
from rltserve.core.thinking import check_thinking, force_at_start
from rltserve.models import load_model, read_config
from rltserve.models.base import LoopedModel
from rltserve.prompt_truncation import truncated_prompt
from rltserve.sampling import SamplingParams
from rltserve.seeds import seeded_generator
from rltserve.updates import ASLEEP, WEIGHTS_DROPPED, RequestUpdate, StepUpdates

logger = logging.getLogger(__name__)
_REQUEST_ID = attrgetter("request_id")


class EngineCore:
    def __init__(
        self, config: EngineConfig, model: LoopedModel | None = None, role: str | None = None
    ) -> None:
        if config.execution.disaggregate:
            raise ValueError(
                "disaggregate=True: an EngineCore runs one stage; a stage client runs the "
                "prefill and decode stages (rltserve.core.pd.stage_client)"
            )
        self.config = config
        mc = config.model
        # All heavy torch work stays on one thread: torch split across two threads measured
        # ~15% slower on CPU. Sync scheduling runs steps on this thread; async runs them on the
        # step thread, so the model is loaded and the runner built there too.
        step_thread = StepThread() if config.scheduler.async_scheduling else None
        if step_thread is not None:
            # An engine dropped without ``shutdown`` must not leave its thread (and, through
            # its idle hook, the runner and the model) alive for the rest of the process, nor
            # running at interpreter exit (stopped while freeing tensors, it aborts the process).
            weakref.finalize(self, step_thread.stop, 10.0)

        def on_step_thread(fn, *args, **kwargs):
            if step_thread is None:
                return fn(*args, **kwargs)
            return step_thread.call(fn, *args, **kwargs)

        if model is None:
            if mc.model is None:
                raise ValueError("model: a checkpoint directory is required")
            model = on_step_thread(load_model, mc.model, dtype=mc.dtype, device=mc.device)
            read_config(mc.model)  # fail early on a bad directory even if load_model is lazy
        self.model = model
        spec = model.spec
        self.spec = spec
        config, self.policy = checked_modes(config, spec)
        self.config = config
        size = pool_size(spec, config, self.policy, role)
        self.max_model_len = size.max_model_len
        num_blocks = self._num_blocks = size.num_blocks
        self._pool_limited = size.pool_limited
        self.prefix_caching = config.cache.prefix_caching
        self.kv, self.scheduler = self._fresh_scheduler()
        # Plans handed out and not yet applied; those of a scheduler that was replaced
        # (``fail_all``) are dropped when their results come back.
        self._outstanding: list[StepPlan] = []
        self._stale: list[StepPlan] = []
        self.runner = on_step_thread(
            ModelRunner,
            model,
            num_blocks=num_blocks,
            block_size=config.cache.block_size,
            device=mc.device,
            executor=step_thread,
            # On a GPU a step's result is read inside the next step, once that step's work is
            # queued; on the CPU there is nothing to overlap and results are read at once.
            defer_results=step_thread is not None and torch.device(mc.device).type == "cuda",
            decode_graphs="cuda" if config.execution.cuda_graphs else None,
            graph_max_rows=self._max_decode_rows(),
            graph_max_context=config.execution.cuda_graph_max_context,
            max_model_len=self.max_model_len,
            swap_space_bytes=int(config.cache.swap_space_gb * 2**30),
            pad_budget=config.execution.attention_pad_budget,
            logprobs_mode=mc.logprobs_mode,
        )
        self._seed_rng = seeded_generator(mc.seed)
        self.weight_version = 0  # in-place weight updates so far (``weight_gate``)
        # sleep(level=2) dropped the weights and no update has loaded any since. Kept on every
        # device (the CPU keeps its weights) so that a loop missing its load fails where it is
        # tested, not only on a GPU.
        self.weights_dropped = False
        # Requests whose prompt KV goes to a decode stage when they finish: request, file.
        self._exports: dict[str, tuple[Request, str]] = {}
        self._num_steps = self._num_rows = self._num_coda_rows = 0
        self._step_rows = [0] * (len(STEP_ROW_BUCKETS) + 1)  # (``EngineStats.step_rows_counts``)
        self._step_tokens = [0] * (len(STEP_ROW_BUCKETS) + 1)  # (``step_tokens_counts``)
        self._num_step_tokens = 0
        planes = len(self.kv.planes_of(spec.num_loops))
        block_bytes = kv_block_bytes(spec, config)
        pool = (self.max_model_len, num_blocks, planes, self._pool_limited, block_bytes)
        self.info = EngineInfo.of_model(spec, config.cache, str(mc.model), *pool)

    def _fresh_scheduler(self) -> tuple[KVManager, Scheduler]:
        """An empty KV manager and scheduler (no requests, every block free)."""
        config, spec = self.config, self.spec
        kv = KVManager(
            self._num_blocks,
            config.cache.block_size,
            self.policy,
            spec.num_boundary_layers > 0,
            retain_cached=self.prefix_caching,
        )
        swap = None
        if config.scheduler.preemption_mode == "swap":
            block_bytes = kv_block_bytes(spec, config)
            swap = SwapSpace(int(config.cache.swap_space_gb * 2**30 // block_bytes), block_bytes)
        scheduler = Scheduler(
            config.scheduler,
            kv,
            has_gate=spec.has_gate,
            has_boundary=spec.num_boundary_layers > 0,
            reservation=config.cache.kv_reservation,
            watermark=config.cache.kv_watermark,
            swap=swap,
        )
        scheduler.admission.importer = lambda r, path: admit_import(kv, self.runner, r, path)
        return kv, scheduler

    def _max_decode_rows(self) -> int:
        """Rows of a decode-only step at most: one per running request, plus its drafts."""
        sched = self.config.scheduler
        rows = sched.max_num_seqs * (1 + sched.speculative_tokens)
        return min(self.config.execution.cuda_graph_max_rows, rows, sched.max_num_batched_tokens)

    # ---------------------------------------------------------------- requests

    def make_request(
        self,
        request_id: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        group: str | None = None,
    ) -> Request:
        """Validates a request against the model and wraps it; raises ValueError. ``group``:
        see ``add_request``."""
        spec = self.spec
        rid = request_id or uuid.uuid4().hex
        # (The front ends truncate before their own checks; again here for direct callers.)
        prompt_token_ids = truncated_prompt(
            prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len
        )
        params = check_params(
            prompt_token_ids, params, spec, self.config, self.max_model_len, self._pool_limited
        )
        sched = self.config.scheduler
        cap = params.max_loops or spec.num_loops
        num_loops = max(spec.num_loops, cap) if spec.has_gate else cap
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        eos = frozenset(spec.eos_token_ids)
        pipelined = check_pipelining(params, cap, sched, spec.num_loops)
        check_thinking(params)
        request = Request(
            request_id=rid,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            num_loops=num_loops,
            max_loops=cap,
            eos_token_ids=eos,
            # Unbounded by max_tokens, at most what the pool holds for it alone: a deep
            # max_loops (Huginn's) may need more planes than the pool has for the whole context.
            max_total_tokens=self.max_model_len
            if params.max_tokens is not None
            else self.info.context_alone(params.max_loops),
            seed=seed,
            pipelined=pipelined,
            group=group,
        )
        check_bans(request, spec.vocab_size)
        force_at_start(request)  # (a thinking budget of 0: the forced ids come first)
        if params.kv_policy is not None and KVPolicy.parse(params.kv_policy) != self.policy:
            request.kv_policy = KVPolicy.parse(params.kv_policy)
        # Coda attention: a first output exiting before the prompt's last loop has its coda
        # wait for that loop (DESIGN §4). (Such models have no gate: a first output's exit is
        # fixed, under a zero-shot criterion too: ``exit.exit_spec``.)
        # (Not where forced ids open the output: the prompt's last position samples nothing.)
        if spec.num_boundary_layers and not request.num_forced:
            first = fixed_exit_depth(request, 0)
            request.first_coda_at = first if first < num_loops else 0
        request.cache_salt = self._cache_salt(request)
        if request.cache_salt is not None:
            # The last prompt position's coda K/V then comes from its exit state, so its block
            # is not one another prompt can share.
            tokens = request.prompt_token_ids
            request.block_hashes = block_hashes(
                request.cache_salt,
                tokens[:-1] if request.first_coda_at else tokens,
                self.config.cache.block_size,
            )
        return request

    def _cache_salt(self, request: Request) -> bytes | None:
        """Everything besides the tokens that a prompt block's KV depends on, or None when the
        request's prompt blocks must not be shared (a policy where sharing is not exact, or
        caching off and no group)."""
        if not self.policy.per_depth or not (self.prefix_caching or request.group is not None):
            return None
        noise = None
        if self.spec.needs_noise:  # Huginn's initial state: zeros, or random per seed
            init = request.params.init_state or "random"
            noise = (init, request.seed) if init == "random" else init
        return make_salt(
            self.config.model.model,
            self.spec.family,
            self.weight_version,
            self.config.model.dtype,
            self.runner.device.type,  # (kernels differ across device types)
            # Not the request's KV policy: a cached block's positions all ran every loop
            # (prompt tokens; generated ones up to the first early exit, ``on_finished``), so
            # full and last_exited write the same KV there, and only they cache (``per_depth``).
            self.config.cache.block_size,
            request.num_loops,
            noise,
            None if self.prefix_caching else request.group,
            request.params.cache_salt,  # (the client's: tenants share no blocks)
        )

    def reset_prefix_cache(self) -> None:
        """Invalidates every cached prefix (call after the weights change): the weight
        version, part of every cache salt, goes up, so no later request hits a block computed
        with the old weights; cached blocks no request holds go back to the pool. (Bumping
        ``weight_version`` alone is already exact: old entries are then only evicted later.)"""
        self.weight_version += 1
        self.clear_prefix_cache()

    def set_weight_version(self, version: int) -> None:
        """The weights in place are those a peer stage calls ``version`` (a restarted stage
        applied only the updates still needed): block hashes then match the peer's. Never
        down, where blocks of older weights could hit."""
        if version < self.weight_version:
            raise ValueError(f"weight version {version}: below this engine's {self.weight_version}")
        self.weight_version = version
        self.clear_prefix_cache()  # (blocks salted with the old version can no longer hit)

    def clear_prefix_cache(self) -> None:
        """Forgets every cached prefix: cached blocks no request holds go back to the pool,
        those requests hold stay theirs (safe between any two steps)."""
        self.kv.cache.clear()

    @property
    def sleeping(self) -> set[str]:
        """The parts whose memory ``sleep`` freed (``core/sleep.py``: the runner's record)."""
        return self.runner.memory.asleep

    def add_request(
        self,
        request_id: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        group: str | None = None,
        transfer: tuple[str, str] | None = None,
    ) -> str:
        """``group``: a key shared by requests that sample the same prompt (the samples of one
        request with ``n > 1``, each with its own id and seed). The first added computes the
        prompt once; the others reuse its KV and compute only the last prompt token. Outputs
        equal those of independent requests. ``transfer`` (prefill/decode stages,
        ``kv_transfer``): ("export", file) writes the prompt's KV there when the request
        finishes; ("import", file) caches the KV such a file holds as admission takes the
        request (``Admission.importer``): the file waits until then."""
        if self.sleeping:
            parts = " and ".join(sorted(self.sleeping))
            raise ValueError(f"{ASLEEP} ({parts} put to sleep): wake_up() first")
        if self.weights_dropped:
            raise ValueError(
                f"{WEIGHTS_DROPPED} and none were loaded since: update_weights() first "
                "(sleep(level=1) keeps them)"
            )
        request = self.make_request(request_id, prompt_token_ids, params, group)
        kind, path = transfer or (None, "")
        if kind == "import":
            request.transfer = path
        self.scheduler.add_request(request)
        if kind == "export":
            self._exports[request.request_id] = (request, path)
        return request.request_id

    def abort(self, request_id: str) -> RequestUpdate | None:
        self._exports.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        preemptor = self.scheduler.preemptor
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=self.kv.usage,
            num_steps=self._num_steps,
            num_rows=self._num_rows,
            num_coda_rows=self._num_coda_rows,
            busy_seconds=self.runner.busy_seconds,
            model_seconds=self.runner.model_seconds,
            drafts_checked=self.runner.drafts_checked,
            drafts_rejected=self.runner.drafts_rejected,
            num_graph_steps=self.runner.graphs.num_replays if self.runner.graphs else 0,
            num_preemptions=preemptor.num_preemptions,
            num_swapped=preemptor.num_swapped,
            num_recomputing=preemptor.num_recomputing(),
            swapped_bytes=preemptor.swapped_bytes,
            swap_fallbacks=preemptor.swap_fallbacks,
            prefix_cache_queries=self.kv.cache.queries,
            prefix_cache_hits=self.kv.cache.hits,
            prefix_cache_blocks=self.kv.cache.num_blocks,
            prefix_cache_evictions=self.kv.cache.evictions,
            step_rows_counts=tuple(self._step_rows),
            step_tokens_counts=tuple(self._step_tokens),
            num_step_tokens=self._num_step_tokens,
            kv_transfer_hits=self.kv.cache.transfer_hits,
            kv_transfer_unused=self.kv.cache.transfer_unused,
        )

    def execute(self, plan: StepPlan) -> list[RequestUpdate]:
        """Runs a planned step synchronously and applies its result; its updates as a list
        (for callers driving the engine by hand: the engine loop keeps ``apply``'s)."""
        return list(self.apply(plan, self.runner.execute(plan)))

    def apply(self, plan: StepPlan, result: StepResult) -> StepUpdates:
        """Applies a step's result (its updates: iterated, ``RequestUpdate``s). If the
        scheduler raises, the step's requests fail (the scheduler touches no other request
        while applying a step) and the rest continue; if failing them raises too, or leaves the
        KV tables inconsistent, every request fails and the engine starts over (``fail_all``)."""
        if result.num_rows:  # (a plan that only releases finished requests' state is no step)
            self._num_steps += 1
            self._num_rows += result.num_rows
            self._step_rows[bisect_left(STEP_ROW_BUCKETS, result.num_rows)] += 1
            self._num_coda_rows += result.num_coda_rows
        _remove(self._outstanding, plan)
        if _remove(self._stale, plan):
            # planned by a scheduler that was replaced: its requests failed
            return self._count_tokens(result, StepUpdates())
        try:
            updates = self.scheduler.apply(plan, result)
        except Exception as exc:
            error = engine_error(f"applying step {plan.step_id}", exc)
            # The step's requests that were going: each gets its final update from this step.
            # (Found only now: those it finished before raising are no longer the
            # scheduler's requests, but ``finished_ids``.)
            rids = dict.fromkeys(map(_REQUEST_ID, plan.items))
            if result.carried:
                rids.update(dict.fromkeys(result.carried.request_ids))
            going = self.scheduler.requests.keys() | self.scheduler.finished_ids
            involved = [rid for rid in rids if rid in going]
            try:
                for rid in involved:  # ended during the failed apply, or ends now
                    self.scheduler.abort(rid)  # frees its KV, releases its runner state
                self.kv.check_no_leaks()
            except Exception as again:
                logger.error("failing the step's requests failed too", exc_info=again)
                failed = self.fail_all(error)
            else:
                reason = FinishReason.ERROR
                failed = [RequestUpdate(rid, finish_reason=reason, error=error) for rid in involved]
            updates = StepUpdates({update.request_id: update for update in failed})
        updates.weight_version = version = self.weight_version
        for update in updates.updates.values():
            update.weight_version = version
            if update.finish_reason is not None and self._exports:
                self._export(update)
        return self._count_tokens(result, updates)

    def _count_tokens(self, result: StepResult, updates: StepUpdates) -> StepUpdates:
        """A step's tokens as vLLM counts them (``EngineStats.step_tokens_counts``), once its
        updates are known: every step that ``num_steps`` counts has its entry, as its rows."""
        if result.num_rows:
            n = updates.num_tokens()
            self._num_step_tokens += n
            self._step_tokens[bisect_left(STEP_ROW_BUCKETS, n)] += 1
        return updates

    def _export(self, update: RequestUpdate) -> None:
        """A finished request's prompt KV to its file, before its update leaves: the client
        hands the file on once it sees the update. A failure only costs the decode stage the
        prompt's computation."""
        export = self._exports.pop(update.request_id, None)
        if export is not None and update.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            try:
                export_prompt(self.kv, self.runner, *export)
            except Exception:
                logger.exception("exporting the prompt KV of %s failed", update.request_id)

    def fail_all(self, error: str) -> list[RequestUpdate]:
        """After the scheduler raised where the requests involved cannot be told apart: every
        request fails with ``error`` and the engine starts over with an empty scheduler and KV
        pool, so new requests are served as before. Steps still in flight are dropped when
        their results come back; the runner forgets every request after running them."""
        rids = list(self.scheduler.requests)
        self._exports.clear()
        self.kv, self.scheduler = self._fresh_scheduler()
        self._stale += self._outstanding
        self._outstanding = []
        self.runner.forget_all()
        reason = FinishReason.ERROR
        return [RequestUpdate(rid, finish_reason=reason, error=error) for rid in rids]

    # ---------------------------------------------------------------- stepping

    def plan(self) -> StepPlan | None:
        plan = self.scheduler.schedule()
        if plan is not None:
            self._outstanding.append(plan)
        return plan

    def step(self) -> list[RequestUpdate]:
        """Plans and runs a step (``execute``)."""
        try:
            plan = self.plan()
        except Exception as exc:
            return self.fail_all(engine_error("planning a step", exc))
        return [] if plan is None else self.execute(plan)

    def sleep(self, level: int) -> None:
        """Frees the device memory of an idle engine (no request in it): the KV pool, whose
        contents (the prefix cache) are forgotten, and on CUDA the weights (level 1 keeps a
        host copy, level 2 drops them). Requests are refused until ``wake_up`` restores both,
        and after level 2 until a weight update loads weights (``weights_dropped``)."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r}: must be 1 or 2")
        # (Weights already asleep stay as the first sleep left them: a level-1 copy survives.)
        drops = level == 2 and "weights" not in self.sleeping
        self.clear_prefix_cache()
        self.runner.sleep(level)
        self.weights_dropped = self.weights_dropped or drops

    def wake_up(self, tags: list[str]) -> None:
        """Restores the parts named in ``tags`` ("weights", "kv_cache")."""
        self.runner.wake_up(tags)

    def on_weights_updated(self) -> None:
        """New weights are in place (no request is running): the version moves on. State
        derived from the old weights is keyed on ``weight_version`` and goes with it."""
        self.weights_dropped = False
        self.reset_prefix_cache()

    def shutdown(self) -> None:
        self.runner.shutdown()


def _remove(plans: list[StepPlan], plan: StepPlan) -> bool:
    """Removes ``plan`` (by identity) from ``plans``; True when it was there."""
    for k, other in enumerate(plans):
        if other is plan:
            del plans[k]
            return True
    return False


def engine_error(doing: str, exc: Exception) -> str:
    """The error its requests get (the traceback goes to the log)."""
    logger.error("engine error while %s", doing, exc_info=exc)
    return f"engine error while {doing}: {type(exc).__name__}: {exc}"
