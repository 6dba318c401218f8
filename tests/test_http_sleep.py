"""vLLM's sleep-mode routes and cache reset on the real engine (ouro-tiny, in-process stage, and
two stages): POST /sleep, POST /wake_up, GET /is_sleeping, POST /reset_prefix_cache; the 503
while asleep; bad query parameters; the 409 of a sleep that waited for a running request."""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest
import pytest_asyncio
from test_http_harness import (
    Script,
    ScriptedStage,
    error_of,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
    wait_for,
)
from test_http_metrics import samples

from rltserve.core.pd import PDClient
from rltserve.core.stage import InProcessStageClient
from rltserve.updates import UpdateTimeout

pytestmark = pytest.mark.asyncio(loop_scope="module")
KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = list(range(11, 31))  # (20 tokens: two full blocks of 8 to cache)
GREEDY = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}  # fmt: skip
ENGINE = {"block_size": 8}
MODEL = ("model_name", "tiny")
ENGINE_LABEL = ("engine", "0")
PENDING = "a sleep is in progress (waiting for running requests)"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(ckpt):
    async with running(ckpt, api_key=KEY, engine=ENGINE) as live:
        yield live


async def _complete(server) -> tuple[list[int], int]:
    """The greedy completion's token ids and its cached prompt tokens."""
    status, _, raw = await server.post("/v1/completions", GREEDY, headers=AUTH)
    assert status == 200, raw
    body = orjson.loads(raw)
    cached = body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return body["choices"][0]["token_ids"], cached


async def _sleeping(server) -> bool:
    status, _, raw = await server.get("/is_sleeping", headers=AUTH)
    assert status == 200, raw
    return orjson.loads(raw)["is_sleeping"]


async def test_sleep_refuses_generation_until_both_parts_wake(server, ckpt):
    tokens, _ = await _complete(server)
    assert not await _sleeping(server)
    status, _, raw = await server.post("/sleep?level=1", None, headers=AUTH)
    assert (status, raw) == (200, b"")
    assert await _sleeping(server)
    for path, body in [
        ("/v1/completions", GREEDY),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        status, headers, raw = await server.post(path, body, headers=AUTH)
        assert status == 503 and headers["Retry-After"] == "1", raw
        assert error_of(raw)["message"] == "the model is sleeping: POST /wake_up first"
    update = {"model_path": str(ckpt)}  # (weights asleep: to be woken before an update)
    status, _, raw = await server.post("/v1/update_weights", update, headers=AUTH)
    assert status == 400 and error_of(raw)["message"] == (
        "weights: asleep; wake them first (wake_up(tags=['weights']); over HTTP POST "
        "/wake_up?tags=weights)"
    )
    # What needs no weights still answers.
    status, _, raw = await server.post("/tokenize", {"prompt": "hello"}, headers=AUTH)
    assert status == 200, raw
    status, _, _ = await server.get("/v1/models", headers=AUTH)
    assert status == 200
    status, _, raw = await server.post("/wake_up?tags=weights", None, headers=AUTH)
    assert (status, raw) == (200, b"")
    assert await _sleeping(server)  # (the KV cache still sleeps)
    status, _, _ = await server.post("/v1/completions", GREEDY, headers=AUTH)
    assert status == 503
    status, _, _ = await server.post("/wake_up", None, headers=AUTH)
    assert status == 200 and not await _sleeping(server)
    again, cached = await _complete(server)
    assert again == tokens and cached == 0  # (sleep forgot the cached prefix)


async def test_reset_prefix_cache_forgets_cached_prompts(server):
    tokens, _ = await _complete(server)
    assert await _complete(server) == (tokens, 16)
    status, _, raw = await server.post("/reset_prefix_cache", None, headers=AUTH)
    assert (status, raw) == (200, b"")
    assert await _complete(server) == (tokens, 0)


@pytest.mark.parametrize(
    ("path", "param", "message"),
    [
        ("/sleep?level=3", "level", "level=3: must be 1 or 2"),
        ("/sleep?level=one", "level", "level='one': must be an integer"),
        ("/sleep?level=1.5", "level", "level='1.5': must be an integer"),
        ("/sleep?timeout=-1", "timeout", "timeout=-1: must be in [0, 3600] seconds"),
        ("/sleep?timeout=nan", "timeout", "timeout='nan': must be a number"),
        ("/sleep?level=1_0", "level", "level='1_0': must be an integer"),
        ("/wake_up?tags=weights&tags=kv", "tags", "tags=['weights', 'kv']: each must be one of"),
    ],
)
async def test_bad_query_parameters_are_a_400_naming_them(server, path, param, message):
    status, _, raw = await server.post(path, None, headers=AUTH)
    error = error_of(raw)
    assert (status, error["param"]) == (400, param), error
    assert error["message"].startswith(message), error
    assert not await _sleeping(server)


async def test_the_routes_need_the_api_key(server):
    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/reset_prefix_cache")]:  # fmt: skip
        async with server.session.request(method, server.url + path) as r:
            assert r.status == 401, path
    assert not await _sleeping(server)


async def test_a_sleep_that_waited_for_a_running_request_is_a_409(server):
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    async with server.session.post(server.url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status == 200
        await r.content.readline()  # the stream has started: the request runs
        status, _, raw = await server.post("/sleep?timeout=0", None, headers=AUTH)
    assert status == 409, raw
    assert error_of(raw)["param"] == "timeout"
    await asyncio.sleep(0)
    assert not await _sleeping(server)


async def test_two_stages_sleep_and_wake_together(ckpt):
    factory = lambda config: PDClient(config, InProcessStageClient)  # noqa: E731
    engine = {**ENGINE, "disaggregate": True}
    async with running(ckpt, engine=engine, client_factory=factory) as live:
        tokens, _ = await _complete(live)
        status, _, _ = await live.post("/sleep?level=2", None)
        assert status == 200 and await _sleeping(live)
        status, _, _ = await live.post("/v1/completions", GREEDY)
        assert status == 503
        status, _, _ = await live.post("/wake_up", None)
        assert status == 200 and not await _sleeping(live)
        # Level 2 dropped the weights (on CUDA; refused on every device): a load comes first.
        status, _, raw = await live.post("/v1/completions", GREEDY)
        assert status == 503 and "POST /v1/update_weights first" in error_of(raw)["message"]
        status, _, raw = await live.post("/v1/update_weights", {"model_path": str(ckpt)})
        assert status == 200, raw
        assert (await _complete(live))[0] == tokens


async def test_sleep_drops_the_prefix_cache_gauge_and_runs_no_step(server):
    """The stats come with the reply: a scrape after /sleep shows the cache it dropped, and
    /sleep adds no step (the plan that releases a finished request's state is none);
    ``engine_sleep_state`` follows the level (vLLM's)."""
    await _complete(server)

    async def scrape() -> dict:
        got = samples((await server.get("/metrics", headers=AUTH))[2].decode())
        state = {s: got[("rltserve:engine_sleep_state", (MODEL, ENGINE_LABEL, ("sleep_state", s)))]
                 for s in ("awake", "weights_offloaded", "discard_all")}  # fmt: skip
        names = ("prefix_cache_blocks", "engine_steps_total", "iteration_tokens_total_count")
        return {**{n: got[(f"rltserve:{n}", (MODEL, ENGINE_LABEL))] for n in names}, **state}

    before = await scrape()
    assert before["prefix_cache_blocks"] > 0 and before["awake"] == 1.0
    steps = {n: before[n] for n in ("engine_steps_total", "iteration_tokens_total_count")}
    dropped = {**steps, "prefix_cache_blocks": 0.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    for level, label in ((2, "discard_all"), (1, "weights_offloaded")):
        assert (await server.post(f"/sleep?level={level}", None, headers=AUTH))[0] == 200
        assert await scrape() == {**dropped, "awake": 0.0, label: 1.0}
        assert (await server.post("/wake_up", None, headers=AUTH))[0] == 200
        assert await scrape() == {**dropped, "awake": 1.0}


async def test_a_sleep_over_sleeping_weights_keeps_their_level_in_the_sleep_state(server):
    """A second /sleep leaves sleeping weights as the first left them (level 2's dropped, or
    level 1's host copy): ``engine_sleep_state`` keeps the first level, which says whether
    the trainer must load weights (it showed the second)."""

    async def state() -> str:
        got = samples((await server.get("/metrics", headers=AUTH))[2].decode())
        (on,) = (dict(labels)["sleep_state"] for (name, labels), value in got.items()
                 if name == "rltserve:engine_sleep_state" and value == 1.0)  # fmt: skip
        return on

    for first, second, label in ((2, 1, "discard_all"), (1, 2, "weights_offloaded")):
        for level in (first, second):
            assert (await server.post(f"/sleep?level={level}", None, headers=AUTH))[0] == 200
        assert await state() == label
        # Weights woken (the KV cache still asleep) sleep again at the new level.
        assert (await server.post("/wake_up?tags=weights", None, headers=AUTH))[0] == 200
        assert (await server.post(f"/sleep?level={second}", None, headers=AUTH))[0] == 200
        assert await state() == ("discard_all" if second == 2 else "weights_offloaded")
        assert (await server.post("/wake_up", None, headers=AUTH))[0] == 200
        assert await state() == "awake"


class _SlowSleep(ScriptedStage):
    """A scripted stage whose sleep waits for ``release`` (a sleep still waiting for its
    running requests)."""

    def __init__(self, info, script) -> None:
        super().__init__(info, script)
        self.release = threading.Event()

        self.started = threading.Event()
        self.times_out = False  # the sleep ends in its 409 once released

    def sleep(self, level: int, timeout_s: float) -> None:
        self.started.set()
        self.release.wait(30)
        if self.times_out:
            raise UpdateTimeout(f"{UpdateTimeout.PREFIX} 1 sequence(s) still running after 1 s")
        super().sleep(level, timeout_s)


async def test_requests_while_a_sleep_waits_are_refused_at_once(ckpt):
    """While /sleep waits for running requests, completions and chat are a 503 + Retry-After
    at once (not held by the engine for the whole wait, to be refused once asleep), and
    /is_sleeping still says false; a sleep that timed out (409) leaves them served again, one
    that succeeded refuses them as asleep."""
    stage = _SlowSleep(scripted_info(ckpt), Script([5]))
    completion = {"prompt": [5], "max_tokens": 1}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        for times_out, sleep_status, after in [(True, 409, 200), (False, 200, 503)]:
            stage.started.clear()
            stage.release.clear()
            stage.times_out = times_out
            sleep = asyncio.ensure_future(live.post("/sleep?level=1&timeout=1", None))
            await asyncio.to_thread(stage.started.wait, 10)
            for path, body in [("/v1/completions", completion), ("/v1/chat/completions", chat)]:
                status, headers, raw = await live.post(path, body)
                assert (status, headers["Retry-After"]) == (503, "1"), raw
                assert error_of(raw)["message"] == PENDING
            assert not await _sleeping(live)
            stage.release.set()
            status, _, raw = await sleep
            assert status == sleep_status, raw
            status, _, raw = await live.post("/v1/completions", completion)
            assert status == after, raw
        assert error_of(raw)["message"] == "the model is sleeping: POST /wake_up first"
        assert len(stage.added) == 1  # (the one served after the 409)


async def test_a_sleep_whose_caller_gave_up_shows_in_the_sleep_state(ckpt):
    """The stage goes on with a sleep its HTTP caller stopped waiting for (the handler is
    cancelled): engine_sleep_state then shows the level it sleeps at, not awake."""
    stage = _SlowSleep(scripted_info(ckpt), Script([5]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(live.post("/sleep?level=2", None), 0.3)
        # (still pending in the stage: generation is refused meanwhile all the same)
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "max_tokens": 1})
        assert status == 503 and error_of(raw)["message"] == PENDING, raw
        stage.release.set()
        while not await _sleeping(live):
            await asyncio.sleep(0.01)
        got = samples((await live.get("/metrics"))[2].decode())
        states = {
            dict(labels)["sleep_state"]: value
            for (name, labels), value in got.items()
            if name == "rltserve:engine_sleep_state"
        }
        assert states == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}


class _OrderedSleeps(ScriptedStage):
    """A scripted stage that applies sleeps one at a time in their order, as the engine's gate
    does, the first held until ``release``; the calls numbered in ``refuse`` time out."""

    def __init__(self, info, script, refuse=()) -> None:
        super().__init__(info, script)
        self.release = threading.Event()
        self.started = threading.Event()
        self.refuse = set(refuse)
        self.levels: list[int] = []  # each call's level, in the order they reached it
        self._order = threading.Lock()

    def sleep(self, level: int, timeout_s: float) -> None:
        with self._order:
            call = len(self.levels)
            self.levels.append(level)
            self.started.set()
            self.release.wait(30)
            if call in self.refuse:
                raise UpdateTimeout(f"{UpdateTimeout.PREFIX} 1 sequence(s) still running")
            super().sleep(level, timeout_s)


async def _sleep_states_on(live) -> list[str]:
    got = samples((await live.get("/metrics"))[2].decode())
    return [dict(labels)["sleep_state"] for (name, labels), value in got.items()
            if name == "rltserve:engine_sleep_state" and value == 1.0]  # fmt: skip


@pytest.mark.parametrize(("refuse", "statuses", "label"), [
    ((), [200, 200], "discard_all"),  # level 2 dropped the weights; level 1 found them asleep
    ((0,), [409, 200], "weights_offloaded"),  # level 2 refused: level 1 put them to sleep
])  # fmt: skip
async def test_a_sleep_sent_while_another_waits_shows_the_level_the_stage_slept_at(
    ckpt, refuse, statuses, label
):
    """A level-1 sleep sent while a level-2 one still waits (for running requests): the
    label follows the stage's order, not the order the calls arrived in (the second showed
    level 1 over the weights the first dropped, or, where the first timed out, its restored
    label hid the second's)."""
    stage = _OrderedSleeps(scripted_info(ckpt), Script([5]), refuse)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        first = asyncio.ensure_future(live.post("/sleep?level=2", None))
        await asyncio.to_thread(stage.started.wait, 10)
        second = asyncio.ensure_future(live.post("/sleep?level=1", None))
        await wait_for(lambda: live.state.sleeps_pending == 2)
        stage.release.set()
        assert [(await first)[0], (await second)[0]] == statuses
        assert stage.levels == [2, 1] and await _sleeping(live)
        assert await _sleep_states_on(live) == [label]


async def test_a_sleep_waiting_behind_another_times_out_in_its_own_timeout(ckpt):
    """A sleep that waits for an earlier one counts that wait in its ``timeout`` (the stage
    counts it from a command's arrival): a 409 naming timeout, never sent to the stage."""
    stage = _OrderedSleeps(scripted_info(ckpt), Script([5]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        first = asyncio.ensure_future(live.post("/sleep?level=2", None))
        await asyncio.to_thread(stage.started.wait, 10)
        status, _, raw = await live.post("/sleep?level=1&timeout=0", None)
        assert status == 409 and error_of(raw) == {
            "message": "timeout: an earlier sleep still waiting after 0 s",
            "type": "conflict_error", "param": "timeout", "code": 409,
        }  # fmt: skip
        assert await _sleep_states_on(live) == ["awake"]
        stage.release.set()
        assert (await first)[0] == 200
        assert stage.levels == [2] and await _sleep_states_on(live) == ["discard_all"]
