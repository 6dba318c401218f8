"""Host work per engine step (``rltserve bench host``): the engine driven with a stand-in model
whose pieces cost almost nothing (``bench/standin.py``), so what is timed is what a GPU would
have to hide: planning, the runner's inputs and attention metadata, result application and
output emission.

Cells: decode-only steps (``rows`` requests decoding at a context of ``context`` tokens) and
mixed steps (the same rows plus one 512-token prompt chunk in every step), each run with
synchronous and with asynchronous scheduling (the step on the step thread, the next step
planned while it runs, as ``run_engine_loop`` does). Per step, in milliseconds, thread CPU time
(steady on a shared machine) and wall time of:

- ``plan``: ``EngineCore.plan`` (the scheduler);
- ``runner``: the runner's host work: inputs, metadata, exit bookkeeping, reading results
  (synchronous: ``execute`` less the stand-in's model calls, on each clock; asynchronous: the
  runner's busy time on the step thread less the model calls, wall only);
- ``apply``: ``EngineCore.apply`` (the scheduler applies the result, builds the updates);
- ``emit``: what the stage does with the updates on the engine thread: the stats snapshot and
  pickling the message for the front end (which detokenizes in its own process);

and ``steps_per_s`` over the measured steps (all phases, wall). Prompts reach their context with
attention metadata skipped (the stand-in never attends), so the set-up stays quick; those steps
are not measured. Exit mode ``delayed`` (the one async scheduling allows), threshold 0.8: the
gate reaches it at loop 3 of the stand-in's 4, so every token exits at loop 4, its cap (where a
delayed decision would say nothing new: none is made, ``step_rows.thresholds``).
"""

from __future__ import annotations

import gc
import math
import pickle
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from rltserve.bench.standin import StandInModel
from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.core.plan import StepPlan
from rltserve.core.stage_worker import tune_gc, tune_malloc
from rltserve.sampling import SamplingParams
from rltserve.updates import StepUpdates, to_wire

PHASES = ("plan", "runner", "apply", "emit")
CHUNK = 512
PROBE_PROMPT = 4 * CHUNK  # the mixed cells' prompt: 4 chunks, then one token
BLOCK = 16


class _Cell:
    """One engine at (rows, context): decode requests brought to their context, then stepped."""

    def __init__(
        self,
        model: StandInModel,
        rows: int,
        context: int,
        carry: bool = True,
        sampling: dict[str, float] | None = None,
    ) -> None:
        """``sampling``: the decode requests' sampling fields over greedy ones (``temperature``
        > 0: each row draws from its own seeded generator, as a rollout's rows do)."""
        self.rows, self.context = rows, context
        self.max_tokens = 4096
        loops = model.spec.num_loops
        per_request = math.ceil((context + self.max_tokens) / BLOCK) * loops
        probe = math.ceil((PROBE_PROMPT + 1) / BLOCK) * loops
        config = EngineConfig.from_flat(
            model="stand-in",
            device="cpu",
            dtype="float32",
            max_num_seqs=rows + 1,
            max_num_batched_tokens=max(16384, rows + CHUNK),
            prefill_chunk_size=CHUNK,
            exit_mode="delayed",
            carry_decode=carry,
            num_blocks=rows * per_request + 2 * probe,
            max_model_len=context + self.max_tokens + 1,  # (not the stand-in's 64k: no notice)
        )
        self.core = EngineCore(config, model=model)
        self.core.runner.count_model_cpu = True  # (its host figures leave the stand-in out)
        decode = {"temperature": 0.0, **(sampling or {})}
        self.decode = SamplingParams(
            max_tokens=self.max_tokens, ignore_eos=True, exit_threshold=0.8, **decode
        )
        self.probe = SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True, exit_threshold=0.8
        )
        self.probes = 0
        self.probe_id: str | None = None
        vocab = model.spec.vocab_size
        for i in range(rows):
            prompt = [(i * 7 + k) % vocab for k in range(context)]
            self.core.add_request(f"r{i}", prompt, self.decode)
        self._fast_forward()

    def _fast_forward(self) -> None:
        """Runs until every request decodes, without building attention metadata."""
        runner = self.core.runner
        runner.attention = _Unattended  # the stand-in never attends
        try:
            while any(not r.output_token_ids for r in self.core.scheduler.running) or (
                self.core.scheduler.waiting
            ):
                self.core.step()
        finally:
            del runner.attention
        if self.core.scheduler.num_running != self.rows:
            raise RuntimeError("bench host: requests failed while reaching their context")

    def add_probe(self) -> None:
        self.probes += 1
        self.probe_id = f"probe{self.probes}"
        prompt = [(self.probes + k) % 97 for k in range(PROBE_PROMPT)]
        self.core.add_request(self.probe_id, prompt, self.probe)

    def settle(self) -> None:
        """Steps until no probe is left (unmeasured), leaving decode-only steps."""
        self.probe_id = None
        while self.core.scheduler.num_running > self.rows or self.core.scheduler.waiting:
            self.core.step()


class _Unattended:
    """What a step's loop gets instead of attention while prompts are fast-forwarded."""

    def __init__(
        self, spans: list[tuple[int, int, list[int]]], keys=None, carried=None, one_row=False
    ) -> None:
        head = carried[0].starts.tolist() if carried is not None else []
        self.positions = torch.tensor(head + [p for s, n, _ in spans for p in range(s, s + n)])

    def __call__(self, layer, q, k, v):
        raise RuntimeError("the stand-in model never attends")


def _emit(core: EngineCore, updates: StepUpdates) -> None:
    message = ("updates", to_wire(updates), core.stats())  # (as the stage sends it)
    pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _measure(cell: _Cell, steps: int, mixed: bool, use_async: bool) -> dict[str, Any]:
    core, runner = cell.core, cell.core.runner
    cpu = dict.fromkeys(PHASES, 0.0)
    wall = dict.fromkeys(PHASES, 0.0)
    chunk_steps = 0
    if mixed:
        cell.add_probe()

    def timed(phase: str, fn: Callable, *args) -> Any:
        c0, w0 = time.thread_time(), time.perf_counter()
        out = fn(*args)
        cpu[phase] += time.thread_time() - c0
        wall[phase] += time.perf_counter() - w0
        return out

    def after(plan: StepPlan, updates: StepUpdates) -> None:
        nonlocal chunk_steps
        chunk_steps += any(it.num_tokens > 1 for it in plan.items)
        # (A finishing update is never a column row of ``StepUpdates``.)
        ended = updates.updates.get(cell.probe_id) if mixed else None
        if ended is not None and ended.finish_reason:
            cell.add_probe()

    collecting = [0.0, 0.0]  # collector seconds, start of the current collection

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collecting[1] = time.perf_counter()
        else:
            collecting[0] += time.perf_counter() - collecting[1]

    gc.callbacks.append(on_gc)
    model0, busy0, model_cpu0 = runner.model_seconds, runner.busy_seconds, runner.model_cpu_seconds
    start = time.perf_counter()
    if use_async:
        in_flight: deque = deque()
        done = 0
        while done < steps:
            while len(in_flight) < 2:
                plan = timed("plan", core.plan)
                in_flight.append((plan, runner.submit(plan)))
            plan, future = in_flight.popleft()
            result = future.result(timeout=60)
            updates = timed("apply", core.apply, plan, result)
            timed("emit", _emit, core, updates)
            after(plan, updates)
            done += 1
        for plan, future in in_flight:  # drain, unmeasured
            core.apply(plan, future.result(timeout=60))
        elapsed = time.perf_counter() - start
        busy = runner.busy_seconds - busy0 - (runner.model_seconds - model0)
        wall["runner"] = busy
        cpu["runner"] = math.nan  # on another thread
    else:
        for _ in range(steps):
            plan = timed("plan", core.plan)
            result = timed("runner", runner.execute, plan)
            updates = timed("apply", core.apply, plan, result)
            timed("emit", _emit, core, updates)
            after(plan, updates)
        elapsed = time.perf_counter() - start
        wall["runner"] -= runner.model_seconds - model0
        cpu["runner"] -= runner.model_cpu_seconds - model_cpu0
    gc.callbacks.remove(on_gc)
    per = 1e3 / steps
    out: dict[str, Any] = {"steps": steps, "steps_per_s": round(steps / elapsed, 1)}
    for phase in PHASES:
        if not math.isnan(cpu[phase]):
            out[f"{phase}_cpu_ms"] = round(cpu[phase] * per, 4)
        out[f"{phase}_wall_ms"] = round(wall[phase] * per, 4)
    out["host_cpu_ms"] = round(sum(v for v in cpu.values() if not math.isnan(v)) * per, 4)
    out["host_wall_ms"] = round(sum(wall.values()) * per, 4)
    out["model_wall_ms"] = round((runner.model_seconds - model0) * per, 4)
    out["gc_ms"] = round(collecting[0] * per, 4)  # wall, inside the phases above
    out["chunk_steps"] = chunk_steps
    if mixed:
        cell.settle()
    return out


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}


def run_host_bench(
    rows_list: list[int],
    contexts: list[int],
    steps: int = 40,
    repeats: int = 1,
    modes: tuple[str, ...] = ("sync", "async"),
    kinds: tuple[str, ...] = ("decode", "mixed"),
    schedules: tuple[str, ...] = ("carried",),
    threads: int = 1,
    stage_gc: bool = True,
    progress: Callable[[str], None] | None = None,
    sampling: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The benchmark's JSON report. Cells are keyed ``"{kind}/{mode}/rows{R}/ctx{C}"``, with
    ``"/reference"`` appended for the reference schedule (``carry_decode=False``; ``schedules``
    names which run, and with both the report has their ``ratios``); with ``repeats`` > 1 each
    figure is the median over repeats (the runs alternate, schedules too).

    ``threads``: torch intra-op threads while it runs. The stand-in's tensors are tiny, and on a
    GPU host the small torch ops of a step are device work; a thread pool only adds wake-ups.
    ``stage_gc``: the collector settings of the stage's worker process (``tune_gc``) while it
    runs, and its allocator settings (``tune_malloc``, left in place: glibc has no way back);
    ``gc_ms`` per cell is the collector's time per step either way. ``sampling``: the decode
    requests' sampling fields (``_Cell``; greedy without)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    thresholds = tune_gc() if stage_gc else None  # as in the stage's worker process
    malloc = tune_malloc() if stage_gc else False
    try:
        cells = _run_cells(
            rows_list, contexts, steps, repeats, modes, kinds, schedules, progress, sampling
        )
    finally:
        torch.set_num_threads(previous)
        if thresholds is not None:
            gc.unfreeze()
            gc.set_threshold(*thresholds)
    return {
        "model": "stand-in (bench/standin.py)",
        "steps": steps,
        "repeats": repeats,
        "threads": threads,
        "stage_gc": stage_gc,
        "stage_malloc": malloc,
        "chunk_tokens": CHUNK,
        "sampling": {"temperature": 0.0, **(sampling or {})},
        "cells": cells,
        "ratios": _ratios(cells),
        "targets": _targets(cells),
    }


def _run_cells(
    rows_list, contexts, steps, repeats, modes, kinds, schedules, progress, sampling
) -> dict[str, Any]:
    model = StandInModel()
    cells: dict[str, Any] = {}
    for context in contexts:
        for rows in rows_list:
            made = {s: _Cell(model, rows, context, s == "carried", sampling) for s in schedules}
            runs: dict[str, list] = {}
            # Sync first: once a step thread exists, execute() goes through it.
            for mode in [m for m in ("sync", "async") if m in modes]:
                for _ in range(repeats):
                    for schedule, cell in made.items():
                        for kind in kinds:
                            key = f"{kind}/{mode}/rows{rows}/ctx{context}"
                            key += "/reference" if schedule == "reference" else ""
                            _measure(cell, max(4, steps // 8), kind == "mixed", mode == "async")
                            run = _measure(cell, steps, kind == "mixed", mode == "async")
                            runs.setdefault(key, []).append(run)
            for cell in made.values():
                cell.core.shutdown()
            for key, rs in runs.items():
                cells[key] = _median(rs) | {"rows": rows, "context": context}
                if progress:
                    c = cells[key]
                    progress(
                        f"{key}: host {c['host_wall_ms']:.3f} ms/step wall, "
                        f"{c['steps_per_s']:.0f} steps/s"
                    )
    return cells


def _ratios(cells: dict[str, Any]) -> dict[str, Any]:
    """Per cell run with both schedules: reference / carried host time per step (thread CPU
    where measured, else wall) and carried / reference steps per second."""
    out: dict[str, Any] = {}
    for key, ref in cells.items():
        if not key.endswith("/reference"):
            continue
        base = key.removesuffix("/reference")
        if base not in cells:
            continue
        cell = cells[base]
        field = "host_cpu_ms" if "runner_cpu_ms" in cell else "host_wall_ms"
        out[base] = {
            f"{field}_reference_over_carried": round(ref[field] / cell[field], 3),
            "steps_per_s_carried_over_reference": round(
                cell["steps_per_s"] / ref["steps_per_s"], 3
            ),
        }
    return out


def _targets(cells: dict[str, Any]) -> dict[str, Any]:
    """The host-path targets, where the report has their cells."""
    checks = {
        "decode/sync/rows256/ctx1024": ("host_wall_ms", 1.0),
        "decode/sync/rows512/ctx1024": ("host_wall_ms", 2.0),
        "mixed/sync/rows256/ctx1024": ("host_wall_ms", 1.5),
    }
    out: dict[str, Any] = {}
    for key, (field, limit) in checks.items():
        if key in cells:
            value = cells[key][field]
            out[key] = {field: value, "limit": limit, "met": value <= limit}
    key = "decode/sync/rows256/ctx1024"
    if key in cells:
        value = cells[key]["steps_per_s"]
        out[key + "/steps_per_s"] = {"value": value, "limit": 1000, "met": value >= 1000}
    return out
