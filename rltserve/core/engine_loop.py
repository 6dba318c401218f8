"""The stage's asyncio loop over an ``EngineCore``: it takes commands from an inbox, submits each
planned step to the runner as an ``ExecutionFuture`` (so the event loop stays free for IPC while
the step computes) and hands every request update to ``emit``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from rltserve.core.engine import EngineCore, engine_error
from rltserve.core.engine_info import EngineStats
from rltserve.core.executor import ExecutionFuture
from rltserve.core.plan import StepPlan
from rltserve.core.request import FinishReason
from rltserve.core.weight_gate import Reply, WeightGate
from rltserve.updates import RequestUpdate, StepUpdates

# (A step's updates come as ``StepUpdates``: ``to_wire`` sends either.)
Emit = Callable[[list[RequestUpdate] | StepUpdates, EngineStats], None]
# Seconds without work or commands before ``on_idle`` runs: a pause between a client's
# requests is shorter, so a busy engine never pays for it.
IDLE_S = 1.0


async def run_engine_loop(
    core: EngineCore,
    inbox: asyncio.Queue,
    emit: Emit,
    reply: Reply | None = None,
    on_idle: Callable[[], None] | None = None,
) -> None:
    """Serves commands until ("shutdown",) arrives. Commands: ("add", rid, prompt_ids, params) or
    ("add", rid, prompt_ids, params, group[, transfer]), ("abort", rid), ("update_weights",
    token, paths, abort, timeout_s), ("sleep", token, level, timeout_s), ("wake_up", token,
    tags) (``weight_gate``; its outcome goes to ``reply``), ("reset_prefix_cache", token)
    and ("set_weight_version", token, version) (at once). A rejected add is emitted as an
    ERROR update for that request id. ``on_idle`` runs once per idle spell, ``IDLE_S`` into it
    (the worker process gives its free heap back).

    With ``async_scheduling`` up to two steps are in flight: the next step is planned and
    submitted before the current one's result is applied, so planning, IPC and output handling
    overlap the computation. Steps launch in submission order on the runner's step thread, and
    a step's future completes when its result reaches the host.
    """
    in_flight: deque[tuple[StepPlan, ExecutionFuture]] = deque()
    limit = 2 if core.config.scheduler.async_scheduling else 1
    answer = reply or (lambda *_: None)

    def replied(token: int, error: str | None, version: int) -> None:
        # The stats first: sleep and a cache reset drop the prefix cache without a step, and
        # a scrape after the reply must not show the blocks it held.
        emit([], _stats(core, gate))
        answer(token, error, version)

    gate = WeightGate(core, replied)
    while True:
        for command in gate.poll(busy=bool(in_flight)):
            _handle(core, command, emit, gate)
        idle = not in_flight and not core.has_work()
        if idle and _handle(core, await next_when_idle(inbox, on_idle), emit, gate):
            break
        while not inbox.empty():
            if _handle(core, inbox.get_nowait(), emit, gate):
                return
        while len(in_flight) < limit:
            try:
                plan = core.plan()
            except Exception as exc:  # steps in flight stay: their results are dropped
                emit(core.fail_all(engine_error("planning a step", exc)), _stats(core, gate))
                break
            if plan is None:
                break
            in_flight.append((plan, _start(core, plan, limit)))
        if not in_flight:
            if gate.waiting and not core.has_work():
                continue  # idle now: the update applies at the top of the loop
            try:  # while an update waits, its timeout is checked even without commands
                command = await asyncio.wait_for(inbox.get(), 0.05 if gate.waiting else None)
            except asyncio.TimeoutError:
                continue
            if _handle(core, command, emit, gate):
                return
            continue
        plan, future = in_flight.popleft()
        result = await future.wait()
        emit(core.apply(plan, result), _stats(core, gate))


async def next_when_idle(
    inbox: asyncio.Queue, on_idle: Callable[[], None] | None, idle_s: float = IDLE_S
) -> tuple:
    """The next command for an idle engine; ``on_idle`` runs if none comes in ``idle_s``."""
    if on_idle is None or not inbox.empty():
        return await inbox.get()
    try:
        return await asyncio.wait_for(inbox.get(), idle_s)
    except asyncio.TimeoutError:
        on_idle()
        return await inbox.get()


def _stats(core: EngineCore, gate: WeightGate) -> EngineStats:
    """The engine's stats, its waiting requests counting those held behind an update."""
    stats = core.stats()
    held = sum(1 for command in gate.held if command[0] == "add")
    return replace(stats, num_waiting=stats.num_waiting + held) if held else stats


def _start(core: EngineCore, plan: StepPlan, limit: int) -> ExecutionFuture:
    """Synchronous scheduling runs the step right here, on the thread that loaded the model;
    async scheduling runs it on the step thread (which loaded the model) so that planning
    overlaps the step."""
    if limit == 1:
        return ExecutionFuture.completed(core.runner.execute(plan))
    return core.runner.submit(plan)


def _handle(core: EngineCore, command: tuple, emit: Emit, gate: WeightGate) -> bool:
    kind = command[0]
    if kind == "shutdown":
        aborted = [u for rid in list(core.scheduler.requests) if (u := core.abort(rid))]
        for cmd in gate.held:  # held requests end as aborted too
            if cmd[0] == "add":
                aborted.append(RequestUpdate(cmd[1], finish_reason=FinishReason.ABORT))
        emit(aborted, _stats(core, gate))
        return True
    # Awake, and no sleep waiting before it (that one would apply after the wake_up: the engine
    # would end asleep): nothing to wait for.
    if kind == "wake_up" and not core.sleeping and not gate.waiting:
        gate.reply(command[1], None, core.weight_version)
    elif kind in ("update_weights", "sleep", "wake_up"):
        aborted = gate.request(command)
        if aborted:
            emit(aborted, _stats(core, gate))
    elif kind == "reset_prefix_cache":
        core.clear_prefix_cache()
        gate.reply(command[1], None, core.weight_version)
    elif kind == "set_weight_version":  # (its caller waits for its updates before)
        try:
            core.set_weight_version(command[2])
        except ValueError as exc:
            gate.reply(command[1], str(exc), core.weight_version)
        else:
            gate.reply(command[1], None, core.weight_version)
    elif gate.waiting and kind == "add":  # runs once the update is done
        gate.held.append(command)
        emit([], _stats(core, gate))  # (it waits: the front end's gauges say so)
    elif gate.waiting and kind == "abort" and gate.drop_held(command[1]):
        emit([RequestUpdate(command[1], finish_reason=FinishReason.ABORT)], _stats(core, gate))
    elif kind == "add":
        _, rid, prompt, params, *group = command
        try:
            core.add_request(rid, prompt, params, *group)
        except ValueError as exc:
            reason = FinishReason.ERROR
            emit(
                [RequestUpdate(rid, finish_reason=reason, error=str(exc), rejected=True)],
                _stats(core, gate),
            )
    elif kind == "abort":
        update = core.abort(command[1])
        if update is not None:
            emit([update], _stats(core, gate))
    return False
