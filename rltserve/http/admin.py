"""Administrative routes: ``POST /v1/update_weights`` loads new weights into the serving model;
vLLM's sleep-mode routes and ``POST /reset_prefix_cache`` (see ``sleep``).

Body (``UpdateWeightsRequest``): ``{"model_path": DIR, "abort": false, "timeout": 300}``.
``model_path`` is a checkpoint directory (or a ``.safetensors`` file) on the server's host with
the served model's tensor names and shapes, any subset of them, or a Hugging Face repo id found
in the server's local cache (as ``--model`` takes one; never downloaded). The update runs
between steps once no request runs (requests that arrive meanwhile wait for it); ``abort``
aborts the running requests instead of waiting for them. With an API key configured the route
needs it, like every ``/v1`` route. The body is read like every other route's
(``body.read_body``), except that unknown fields are always an error: a misspelled option must
not be dropped silently here.

Answers ``{"weight_version": "N"}``, a string as in ``/v1/models`` and every response's
``metadata`` (OpenAI's ``metadata`` holds strings: one type to compare); a rejected update is a
400 naming ``model_path`` (nothing applied, the old weights keep serving), one that timed out
waiting for running requests a 409.
Engine replicas (``--replicas``) refuse it, as they refuse sleep mode and
``/reset_prefix_cache``: a 400 naming no parameter (a Serve call reaches one replica).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from dataclasses import dataclass

from aiohttp import web

from rltserve.core.stage import StageConfigError, StageError
from rltserve.http.body import read_body
from rltserve.http.errors import HTTPError, bad_request, json_response, unavailable
from rltserve.http.state import STATE, ServingState
from rltserve.http.supervisor import NotWithReplicas
from rltserve.http.validation import SchemaError
from rltserve.preflight import resolve_model
from rltserve.updates import SLEEP_TAGS, UpdateTimeout

MAX_TIMEOUT_S = 3600
log = logging.getLogger("rltserve.http")


@dataclass(frozen=True)
class UpdateWeightsRequest:
    """The body of ``POST /v1/update_weights``."""

    model_path: str  # a checkpoint directory or .safetensors file on the server's host
    abort: bool = False  # abort running requests instead of waiting for them
    timeout: float = 300.0  # seconds to wait for running requests, in [0, MAX_TIMEOUT_S]

    def validate(self) -> None:
        if not self.model_path:
            raise SchemaError("model_path", "model_path: required (a checkpoint directory)")
        if (problem := _timeout_problem(self.timeout)) is not None:
            raise SchemaError("timeout", problem)


async def update_weights(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: UpdateWeightsRequest = await read_body(request, UpdateWeightsRequest, strict=True)
    client = state.require_frontend().client
    try:
        cache_dir = state.engine_config.model.download_dir  # (where --model was found too)
        path = resolve_model(req.model_path, cache_dir=cache_dir, name="model_path")
    except ValueError as exc:
        raise bad_request(str(exc), "model_path") from None
    call = (client.update_weights, [path], req.abort, float(req.timeout))
    version = await _call(state, *call, param="model_path")
    return json_response({"weight_version": str(version)})


# vLLM's sleep mode over HTTP, for a trainer that shares the device with the server between
# rollouts: ``POST /sleep?level=1|2`` frees the KV cache (forgetting cached prefixes) and, on
# CUDA, the weights (level 1 keeps a host copy); it waits for running requests up to ``timeout``
# seconds (our query parameter, default 300: a 409 after it, nothing freed). ``POST /wake_up``
# (``?tags=weights&tags=kv_cache``, none: both) restores them; ``GET /is_sleeping`` answers
# ``{"is_sleeping": bool}`` (false until the sleep is done). While asleep, completions and chat
# are a 503 (the rest answers); while a sleep waits for running requests, new ones are a 503
# at once too (``delivery``), and are served again if the sleep times out. Each answers an
# empty 200, as vLLM's; a replica set has none of them (400).


async def sleep(request: web.Request) -> web.Response:
    level = _query_number(request, "level", 1, int)
    if level not in (1, 2):
        raise bad_request(f"level={level}: must be 1 or 2", "level")
    timeout = _query_number(request, "timeout", 300.0, float)
    if (problem := _timeout_problem(timeout)) is not None:
        raise bad_request(problem, "timeout")
    _check_control(request, "sleep")
    log.info("sleep the engine with level %d", level)  # (vLLM's words, as each line here)
    state = request.app[STATE]
    # Pending until the stage answers, whether or not this caller still waits (shielded).
    call = asyncio.ensure_future(_sleep(state, level, timeout))
    state.sleeps_pending += 1
    call.add_done_callback(functools.partial(_sleep_answered, state))
    await asyncio.shield(call)
    return web.Response()


async def _sleep(state: ServingState, level: int, timeout: float) -> None:
    """One sleep, to the stage's answer, and ``engine_sleep_state``'s label with it.

    Sleeps reach the stage one at a time, each once those before it have answered: the label
    is set before the call (a scrape as the stage's reply lands must not find it asleep at no
    level), from what the sleeps before left, and a refused sleep puts back the label it found,
    which no other sleep changed meanwhile. Sent together, a level-1 sleep would see the
    weights awake and show level 1 while a level-2 one waiting before it in the stage drops
    them (and that one's timeout would restore a label over the other's). The stage applies
    them in that order all the same (``weight_gate``); the wait for the ones before counts in
    ``timeout``, as the stage counts it from a command's arrival."""
    start = time.monotonic()
    lock = state.sleep_lock
    try:
        if lock.locked():  # (wait_for on a free lock may time out at 0 s before taking it)
            await asyncio.wait_for(lock.acquire(), timeout)
        else:
            await lock.acquire()
    except asyncio.TimeoutError:  # (not the builtin before Python 3.11)
        message = f"{UpdateTimeout.PREFIX} an earlier sleep still waiting after {timeout:g} s"
        raise HTTPError(409, message, param="timeout") from None
    try:
        client, metrics = state.require_frontend().client, state.metrics
        previous = metrics.sleep_level
        # A sleep over sleeping weights leaves them as the first sleep left them
        # (``core/sleep``: level 2's dropped, or level 1's host copy): that level still shows.
        weights_asleep = "weights" in client.sleeping
        metrics.sleep_level = previous if weights_asleep and previous else level
        left = max(0.0, timeout - (time.monotonic() - start))
        try:
            await _call(state, client.sleep, level, left)
        except BaseException:
            metrics.sleep_level = previous
            raise
    finally:
        state.sleep_lock.release()


def _sleep_answered(state: ServingState, call: asyncio.Future) -> None:
    state.sleeps_pending -= 1
    if not call.cancelled():
        call.exception()  # (retrieved: a caller that gave up never reads it)


async def wake_up(request: web.Request) -> web.Response:
    tags = request.query.getall("tags", []) or list(SLEEP_TAGS)
    if not set(tags) <= set(SLEEP_TAGS):
        raise bad_request(f"tags={tags}: each must be one of {list(SLEEP_TAGS)}", "tags")
    _check_control(request, "wake_up")
    log.info("wake up the engine with tags: %s", tags)
    await _run(request, "wake_up", tags)
    return web.Response()


async def is_sleeping(request: web.Request) -> web.Response:
    client = request.app[STATE].require_frontend().client
    return json_response({"is_sleeping": bool(client.sleeping)})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's: forgets every cached prefix (blocks running requests hold stay theirs)."""
    _check_control(request, "reset_prefix_cache")
    log.info("Resetting prefix cache...")
    await _run(request, "reset_prefix_cache")
    return web.Response()


def _check_control(request: web.Request, name: str) -> None:
    """A 400 for a control a replica set does not have, before its log line says it runs."""
    client = request.app[STATE].require_frontend().client
    try:
        getattr(client, "check_control", lambda name: None)(name)
    except NotWithReplicas as exc:
        raise bad_request(str(exc)) from exc


async def _run(request: web.Request, name: str, *args: object) -> None:
    state = request.app[STATE]
    await _call(state, getattr(state.require_frontend().client, name), *args)


async def _call(state, method, *args: object, param: str | None = None):
    """``method(*args)`` on a worker thread; its refusals as HTTP errors: a wait that timed out
    is a 409, a stage that died meanwhile a 503 (it restarts: retry), bad input a 400."""
    try:
        return await asyncio.to_thread(method, *args)
    except UpdateTimeout as exc:
        raise HTTPError(409, str(exc), param="timeout") from exc
    except StageConfigError as exc:  # (a StageError that is bad input)
        raise bad_request(str(exc), param) from exc
    except StageError as exc:
        raise unavailable(str(exc), state.config.retry_after_s) from exc
    except NotWithReplicas as exc:  # (the route, not a value of it)
        raise bad_request(str(exc)) from exc
    except ValueError as exc:
        raise bad_request(str(exc), param) from exc


def _query_number(request: web.Request, name: str, default: float, kind: type) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = math.nan
    # (Python's int() and float() take "1_0" as 10; NaN compares with nothing)
    if "_" in raw or value != value:
        what = "an integer" if kind is int else "a number"
        raise bad_request(f"{name}={raw!r}: must be {what}", name)
    return value


def _timeout_problem(timeout: float) -> str | None:
    """Why a wait of ``timeout`` seconds is refused, or None."""
    if 0 <= timeout <= MAX_TIMEOUT_S:
        return None
    return f"timeout={timeout:g}: must be in [0, {MAX_TIMEOUT_S}] seconds"
