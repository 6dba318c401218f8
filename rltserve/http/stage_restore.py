"""A restarted stage until it serves (``SupervisedStage``'s restart): it loads (within
``startup_timeout_s``), gets the weight updates applied so far again, and is put back to the
sleep the failed stage was in (``SleepState``).

Those two are control calls on the new stage, bounded as the watchdog bounds a serving stage's
controls (``watchdog_s``; ``startup_timeout_s`` with the watchdog off, as the load): no other
watchdog runs meanwhile (the supervisor's is busy with this restart), and a new stage that
hangs there (stopped, stuck in a load) would hold the restart, and the server's 503, for good.
Such a stage is killed and the attempt fails, so the restart policy decides what follows
(another attempt, or giving up once they ran out). A shutdown meanwhile (the supervisor
closing, or its task cancelled) kills it too: the call's thread must end for the process to
exit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from rltserve.core.restart import RestartPolicy, stop_stage
from rltserve.core.stage import StageError
from rltserve.core.update_log import AppliedUpdate
from rltserve.http.frontend import StageClientLike
from rltserve.http.sleep_state import SleepState

T = TypeVar("T")
_POLL_S = 0.25  # (waits poll, so that a shutdown is noticed)


class RestoreFailed(Exception):
    """The new stage did not take what it must have before serving: why (the attempt failed)."""


async def restore(
    client: StageClientLike,
    needed: list[AppliedUpdate],
    sleep: SleepState,
    policy: RestartPolicy,
    closing: Callable[[], bool],
    clock: Callable[[], float],
) -> None:
    """Waits for the new stage to load, applies ``needed`` to it, in order, then puts it to
    sleep as ``sleep`` says; RestoreFailed saying why when it did not get there."""
    await _loaded(client, policy, closing, clock)

    def bounded(name: str, call: Callable[[], T]):
        return answered(client, name, call, policy, closing, clock)

    for update in needed:
        paths = list(update.paths)
        try:  # (a stage with no request has nothing to wait for: the timeout is a formality)
            await bounded(
                "update_weights",
                lambda p=paths: client.update_weights(p, False, policy.startup_timeout_s),
            )
        except Exception as exc:  # noqa: BLE001 - the stage must not serve older weights
            raise RestoreFailed(f"weight update {paths} again: {exc}") from exc
    try:
        await bounded("sleep", lambda: sleep.restore(client, policy.startup_timeout_s))
    except Exception as exc:  # noqa: BLE001 - awake, it would hold what the trainer freed
        raise RestoreFailed(f"putting it back to sleep: {exc}") from exc


async def _loaded(
    client: StageClientLike,
    policy: RestartPolicy,
    closing: Callable[[], bool],
    clock: Callable[[], float],
) -> None:
    deadline = clock() + policy.startup_timeout_s
    while not closing():
        try:
            await asyncio.to_thread(client.wait_ready, _POLL_S)
        except StageError as exc:
            if not client.alive or clock() > deadline:
                raise RestoreFailed(str(exc)) from exc
            continue
        if client.alive:
            return
        raise RestoreFailed(str(getattr(client, "error", None)))
    raise RestoreFailed("the server is shutting down")


async def answered(
    client: StageClientLike,
    name: str,
    call: Callable[[], T],
    policy: RestartPolicy,
    closing: Callable[[], bool],
    clock: Callable[[], float],
) -> T:
    """``call()`` (control ``name`` of ``client``) on a worker thread, its result once the
    stage answered; StageError once it went unanswered past the bound (the module doc), the
    stage killed."""
    limit = policy.watchdog_s or policy.startup_timeout_s
    task = asyncio.ensure_future(asyncio.to_thread(call))
    deadline = clock() + limit
    try:
        while not task.done() and not closing() and clock() <= deadline:
            await asyncio.wait({task}, timeout=_POLL_S)
    finally:
        if not task.done():  # (also cancelled: a kill ends the call, which close() then fails)
            kill = getattr(client, "kill", None)
            if kill is not None:
                kill()
    if task.done():
        return task.result()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (retrieved)
    await asyncio.to_thread(stop_stage, client)
    if closing():
        raise StageError("the server is shutting down")
    bound = "stage watchdog" if policy.watchdog_s else "--startup-timeout-s"
    raise StageError(f"no answer to {name} within {limit:g} s ({bound}); killed it")
