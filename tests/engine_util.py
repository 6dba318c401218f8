"""Drives an ``EngineCore`` synchronously in tests and compares it with the dense oracle."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from reference import Reference

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.sampling import SamplingParams


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    depths: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    logprobs: dict[str, list[float | None]] = field(default_factory=dict)
    top_logprobs: dict[str, list] = field(default_factory=dict)
    forced_ranks: dict[str, dict[int, int]] = field(default_factory=dict)  # (bounded thinking)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)  # (as the update has them)
    cached: dict[str, int] = field(default_factory=dict)  # num_cached_tokens, once reported
    steps: int = 0
    max_rows: int = 0


def random_workload(
    n: int,
    seed: int,
    thresholds: tuple[float, ...],
    *,
    max_prompt: int,
    max_tokens: tuple[int, int],
    max_arrival: int,
    vary_min_loops: bool = True,
) -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    """n random prompts (1..max_prompt ids below 384), their params (thresholds in turn,
    max_tokens in the closed range, min_loops 1 or 2 when varied) and arrival steps."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)]
    params = []
    for i in range(n):
        tokens = rng.randint(*max_tokens)
        extra = {"min_loops": rng.choice([1, 2])} if vary_min_loops else {}
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=tokens,
                ignore_eos=True,
                exit_threshold=thresholds[i % len(thresholds)],
                **extra,
            )
        )
    arrivals = [rng.randint(0, max_arrival) for _ in range(n)]
    return prompts, params, arrivals


def with_eos(src: Path, dst: Path, eos_token_ids: list[int]) -> Path:
    """A copy of checkpoint ``src`` (weights linked) whose config.json declares ``eos_token_ids``,
    so that real EOS can be placed inside a tiny random model's greedy output."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["eos_token_id"] = list(eos_token_ids)
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in Path(src).iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    return dst


def count_grouped_attention(monkeypatch) -> list[int]:
    """A list that gets an entry for every ``GroupedAttention`` built (several attention groups
    in one step) while ``monkeypatch`` lasts."""
    import rltserve.core.attention as attention

    built: list[int] = []
    real = attention._grouped
    monkeypatch.setattr(attention, "_grouped", lambda *a: built.append(1) or real(*a))
    return built


def make_core(path, **engine) -> EngineCore:
    engine.setdefault("num_blocks", 512)
    return EngineCore(EngineConfig.from_flat(model=str(path), **engine))


def tight_blocks(path, prompts, params, **kw) -> int:
    """The smallest pool every request fits alone, plus two blocks: requests are preempted
    again and again. (Alone at the model's default depth too: the pool bounds the context.)"""
    kw = {**kw, "block_size": 4, "num_blocks": 4096}
    core = make_core(path, **kw)
    need = 0
    default = core.spec.num_loops
    for prompt, p in zip(prompts, params):
        r = core.make_request(None, prompt, p.replace(priority=0))  # (fcfs refuses others)
        loops = max(r.num_loops, default)
        need = max(need, core.kv.blocks_needed(r.kv_tokens, loops))
    core.shutdown()
    return need + 2


# Engine modes every per-request feature is checked in against the oracle (with ``run_mode``).
ENGINE_MODES = {
    "sync": {},
    "chunked": {"prefill_chunk_size": 4, "max_num_batched_tokens": 12},
    "wavefront": {"prefill_chunk_size": 4, "wavefront_prefill": True},
    "async": {"async_scheduling": True, "exit_mode": "delayed"},
    "pipelined": {"speculative_tokens": 2, "draft_loops": 2},
    "recompute": {"preemption_mode": "recompute"},
    "swap": {"preemption_mode": "swap"},
}


def run_mode(
    path, prompts: list[list[int]], params: list[SamplingParams], **engine
) -> tuple[EngineCore, Run]:
    """Runs the requests on an engine with ``engine`` settings (``kv_policy`` last_exited
    unless given; one of ``ENGINE_MODES``, say): a preemption mode gets a pool so small that
    requests are preempted again and again (``tight_blocks``), async scheduling its lag."""
    engine.setdefault("kv_policy", "last_exited")
    if "preemption_mode" in engine:
        engine["block_size"] = 4  # (``tight_blocks``')
        engine["num_blocks"] = tight_blocks(path, prompts, params)
    core = make_core(path, **engine)
    return core, run_core(core, prompts, params, lag=1 if engine.get("async_scheduling") else 0)


def run_core(
    core: EngineCore,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    arrivals: list[int] | None = None,
    aborts: dict[int, int] | None = None,
    lag: int = 0,
    deferred: bool = False,
    max_steps: int = 10_000,
    groups: list[str | None] | None = None,
    abort_when: Callable[[EngineCore], Iterable[str]] | None = None,
) -> Run:
    """Runs requests to completion. ``arrivals[i]`` is the step at which request i is added;
    ``aborts`` maps a request index to the step at which it is aborted. With ``lag=1`` each
    step is planned before the previous step's result is applied, as async scheduling does
    (steps still execute in order). ``deferred`` makes the runner deliver each step's result
    inside the next launch, as it does on a GPU with async scheduling. ``groups[i]``: the
    prompt-sharing group key of request i. ``abort_when(core)``, called before every plan,
    names requests to abort then (by the state they are in)."""
    core.runner.defer_results = deferred
    arrivals = arrivals or [0] * len(prompts)
    aborts = aborts or {}
    run = Run()
    rids = [f"r{i}" for i in range(len(prompts))]
    pending: deque = deque()

    def apply_oldest() -> None:
        plan, handle = pending.popleft()
        result = handle.result()
        run.max_rows = max(run.max_rows, result.num_rows)  # carried rows included
        for u in core.apply(plan, result):
            run.tokens[u.request_id].extend(u.new_token_ids)
            run.depths[u.request_id].extend(u.new_exit_depths)
            run.logprobs[u.request_id].extend(u.new_logprobs)
            run.top_logprobs[u.request_id].extend(u.new_top_logprobs)
            for j, lp, top, rank in u.forced_logprobs or ():  # (bounded thinking)
                assert run.logprobs[u.request_id][j] is None, "forced logprob sent twice"
                run.logprobs[u.request_id][j], run.top_logprobs[u.request_id][j] = lp, top
                run.forced_ranks.setdefault(u.request_id, {})[j] = rank
            if u.num_cached_tokens is not None:
                run.cached[u.request_id] = u.num_cached_tokens
            if u.prompt_logprobs is not None:
                assert u.request_id not in run.prompt_logprobs, "prompt logprobs sent twice"
                run.prompt_logprobs[u.request_id] = u.prompt_logprobs
            if u.error:
                raise AssertionError(f"{u.request_id} failed: {u.error}")
            if u.finish_reason is not None:
                run.finish[u.request_id] = u.finish_reason.value

    step = 0
    added = set()
    while True:
        for i, at in enumerate(arrivals):
            if at == step and i not in added:
                group = {"group": groups[i]} if groups else {}
                core.add_request(rids[i], prompts[i], params[i], **group)
                run.tokens[rids[i]] = []
                run.depths[rids[i]] = []
                run.logprobs[rids[i]] = []
                run.top_logprobs[rids[i]] = []
                added.add(i)
        for i, at in aborts.items():
            if at == step and core.abort(rids[i]) is not None:
                run.finish[rids[i]] = "abort"
        if abort_when is not None:
            for rid in abort_when(core):
                if core.abort(rid) is not None:
                    run.finish[rid] = "abort"
        plan = core.plan()
        if plan is not None:
            pending.append((plan, core.runner.launch(plan)))
            run.steps += 1
        if len(pending) > lag or (plan is None and pending):
            apply_oldest()
        step += 1
        if len(added) == len(prompts) and not core.has_work() and not pending:
            break
        assert step < max_steps, "engine did not finish"
    # Flush the releases of the last finished requests to the runner, then check for leaks.
    final = core.plan()
    if final is not None:
        core.execute(final)
    assert not core.runner.live, "runner kept state of finished requests"
    core.kv.check_no_leaks()
    return run


def oracle_run(ref: Reference, prompt: list[int], p: SamplingParams, **kw):
    """The oracle's greedy output for ``p``, with the model's EOS ids unless ``ignore_eos``."""
    return ref.generate(
        prompt,
        p.max_tokens,
        min_loops=p.min_loops,
        max_loops=p.max_loops,
        exit_threshold=p.exit_threshold,
        exit_criterion=p.exit_criterion,
        trace_depths=list(p.trace_depths) if p.trace_depths else None,
        init_state=p.init_state or "random",  # (None: the model's, Huginn's random)
        seed=p.seed,
        stop_token_ids=tuple(p.stop_token_ids),
        eos_token_ids=() if p.ignore_eos else ref.eos_token_ids,
        min_tokens=p.min_tokens,
        logit_bias=p.logit_bias,
        allowed_token_ids=p.allowed_token_ids,
        **kw,
    )


def stream_all(
    client,
    prompts,
    params,
    timeout: float = 300,
    groups=None,
    arrivals: list[int] | None = None,
    aborts: dict[int, int] | None = None,
) -> Run:
    """Sends every request through a stage client and waits for all of them; fails on any
    error update. ``groups[i]``: request i's prompt-sharing group; ``arrivals[i]``: request i
    is sent once the run has produced that many tokens in all (or when nothing sent is still
    running); ``aborts[i]``: request i is aborted once it has that many tokens (0: as soon as
    it is sent). The client's methods are called on this thread, never under the sink's lock
    (a stage may deliver updates while it holds its own). A request the engine refused (an
    update that says ``rejected``) raises ValueError with its error, as ``LLM.generate``'s."""
    n = len(prompts)
    arrivals = arrivals or [0] * n
    run = Run()
    for i in range(n):
        run.tokens[f"r{i}"], run.depths[f"r{i}"] = [], []
        run.logprobs[f"r{i}"], run.top_logprobs[f"r{i}"] = [], []
    changed = threading.Condition()
    produced = [0]
    refused: list[str] = []

    def sink(update):
        with changed:
            rid = update.request_id
            run.tokens[rid].extend(update.new_token_ids)
            run.depths[rid].extend(update.new_exit_depths)
            run.logprobs[rid].extend(update.new_logprobs)
            run.top_logprobs[rid].extend(update.new_top_logprobs)
            for j, lp, top, _ in update.forced_logprobs or ():  # (bounded thinking)
                run.logprobs[rid][j], run.top_logprobs[rid][j] = lp, top
            produced[0] += len(update.new_token_ids)
            if update.prompt_logprobs is not None:
                assert update.request_id not in run.prompt_logprobs, "prompt logprobs sent twice"
                run.prompt_logprobs[update.request_id] = update.prompt_logprobs
            if update.finish_reason is not None:
                run.finish[rid] = update.error or update.finish_reason.value
            if update.rejected:
                refused.append(update.error)
            changed.notify_all()

    unsent = sorted(range(n), key=lambda i: arrivals[i])
    unaborted = dict(aborts or {})
    sent: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        with changed:
            running = [i for i in sent if f"r{i}" not in run.finish]
            send = []
            while unsent and (not running and not send or arrivals[unsent[0]] <= produced[0]):
                send.append(unsent.pop(0))
            abort = [
                i for i in running if i in unaborted and len(run.tokens[f"r{i}"]) >= unaborted[i]
            ]
            if not send and not abort:
                if not unsent and not running:
                    break
                assert time.monotonic() < deadline, "requests did not finish"
                changed.wait(0.05)
                continue
        for i in send:
            sent.add(i)
            group = groups[i] if groups else None
            client.add_request(f"r{i}", prompts[i], params[i], sink, group=group)
        for i in abort + [i for i in send if unaborted.get(i) == 0]:
            unaborted.pop(i, None)
            client.abort(f"r{i}")
    if refused:
        raise ValueError("; ".join(refused))
    errors = {rid: f for rid, f in run.finish.items() if f not in ("stop", "length", "abort")}
    assert not errors, errors
    return run


def wait_pd_idle(client, timeout: float = 30.0) -> None:
    """Waits for both stages of a ``PDClient`` to be idle with no block in use and no transfer
    file left (stats arrive a step after the last finish); fails with what is left."""
    deadline = time.monotonic() + timeout
    while True:
        stats = [s.stats for s in (client.prefill, client.decode)]  # (None: never ran a step)
        busy = [s for s in stats if s and (s.num_running or s.num_waiting or s.kv_usage)]
        files = sorted(set(os.listdir(client._files.dir)) - {"owner.lock"})
        if not busy and not files:
            return
        assert time.monotonic() < deadline, f"stages not idle: {busy}, transfer files {files}"
        time.sleep(0.05)


def decode_took(client) -> int:
    """Prompt tokens the decode stage of a ``PDClient`` found in its prefix cache: blocks moved
    from the prefill stage (``kv_transfer_hits``) and real reuse (``prefix_cache_hits``)."""
    stats = client.decode.stats
    return stats.prefix_cache_hits + stats.kv_transfer_hits


def run_pd(path, prompts, params, **engine) -> tuple[Run, int]:
    """``prompts`` through an in-process prefill/decode disaggregated engine of ``engine``'s
    settings (``stream_all``), and what its decode stage took from its prefix cache
    (``decode_took``); both stages left idle (``wait_pd_idle``) and closed."""
    from rltserve.config import EngineConfig
    from rltserve.core.pd import PDClient
    from rltserve.core.stage import InProcessStageClient

    config = EngineConfig.from_flat(model=str(path), disaggregate=True, **engine)
    client = PDClient(config, InProcessStageClient)
    try:
        client.wait_ready(120)
        run = stream_all(client, prompts, params)
        took = decode_took(client)
        wait_pd_idle(client)
    finally:
        client.close()
    return run, took
