"""Socket-free units of the server: the admission gate, schema parsing and the
request -> SamplingParams mapping."""

from __future__ import annotations

import asyncio
import dataclasses
import typing

import pytest

from rltserve.http.admission import AdmissionGate, Overloaded
from rltserve.http.errors import error_body
from rltserve.http.schemas import ChatCompletionRequest, CompletionRequest, sampling_params
from rltserve.http.validation import SchemaError, describe, loads, param_of, parse_object


async def test_admission_gate_fifo_and_limits():
    gate = AdmissionGate(max_concurrent=3, max_queued=2)
    order: list[str] = []
    release = {name: asyncio.Event() for name in "abcd"}

    async def hold(name: str, weight: int) -> None:
        async with gate.slots(weight):
            order.append(name)
            await release[name].wait()

    a = asyncio.create_task(hold("a", 2))
    await asyncio.sleep(0)
    b = asyncio.create_task(hold("b", 2))  # does not fit next to a: queued
    c = asyncio.create_task(hold("c", 1))  # would fit, but must not overtake b
    await asyncio.sleep(0)
    assert order == ["a"] and gate.num_queued == 2
    with pytest.raises(Overloaded):
        async with gate.slots(1):
            pass
    release["a"].set()
    await asyncio.sleep(0.01)
    assert order == ["a", "b", "c"] and gate.in_use == 3
    d = asyncio.create_task(hold("d", 1))
    await asyncio.sleep(0)
    d.cancel()  # a waiter that goes away leaves no trace
    await asyncio.sleep(0)
    assert gate.num_queued == 0
    release["b"].set()
    release["c"].set()
    await asyncio.gather(a, b, c)
    assert d.cancelled() and gate.in_use == 0


async def test_a_full_admission_queue_gives_a_worse_waiters_place_to_a_better_request():
    """A queue full of batch requests (priority 10) does not turn an interactive one (priority
    0) away: the latest worst waiter gets the 503 instead. An equal or worse priority is
    refused as before."""
    gate = AdmissionGate(max_concurrent=1, max_queued=2)
    order: list[str] = []

    async def hold(name: str, priority: int) -> None:
        async with gate.slots(1, priority):
            order.append(name)

    async with gate.slots(1):
        a = asyncio.create_task(hold("a", 10))
        b = asyncio.create_task(hold("b", 10))
        await asyncio.sleep(0)
        for worse_or_equal in (10, 11):
            with pytest.raises(Overloaded, match="queue is full"):
                async with gate.slots(1, worse_or_equal):
                    pass
        c = asyncio.create_task(hold("c", 0))
        await asyncio.sleep(0)
        assert gate.num_queued == 2
        with pytest.raises(Overloaded, match="a better priority took its place"):
            await b
    await asyncio.gather(a, c)
    assert order == ["c", "a"] and gate.in_use == 0 and gate.num_queued == 0


async def test_a_better_priority_that_fits_is_let_in_past_a_head_too_big_for_the_free_slots():
    """A batch request of n=4 waits for 4 slots (1 is taken); an interactive request of n=1
    queued ahead of it by priority fits in the 3 free ones: it is let in at once, not only at
    the next release (a whole generation later)."""
    gate = AdmissionGate(max_concurrent=4, max_queued=4)
    granted: list[str] = []
    done = asyncio.Event()

    async def hold(name: str, weight: int, priority: int) -> None:
        async with gate.slots(weight, priority):
            granted.append(name)
            await done.wait()

    async with gate.slots(1):
        batch = asyncio.create_task(hold("batch", 4, 10))
        await asyncio.sleep(0)
        interactive = asyncio.create_task(hold("interactive", 1, 0))
        await asyncio.sleep(0.01)
        assert granted == ["interactive"] and gate.in_use == 2 and gate.num_queued == 1
        done.set()
    await asyncio.gather(batch, interactive)
    assert granted == ["interactive", "batch"] and gate.in_use == 0 and gate.num_queued == 0


async def test_a_closed_admission_gate_refuses_its_waiters_at_once():
    gate = AdmissionGate(max_concurrent=1, max_queued=4)
    release = asyncio.Event()

    async def hold() -> None:
        async with gate.slots(1):
            await release.wait()

    held = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(hold()) for _ in range(2)]
    await asyncio.sleep(0)
    assert gate.num_queued == 2
    gate.close("the server is shutting down")
    for waiter in waiters:
        with pytest.raises(Overloaded, match="the server is shutting down"):
            await waiter
    with pytest.raises(Overloaded, match="the server is shutting down"):
        async with gate.slots(1):
            pass
    assert gate.num_queued == 0 and gate.in_use == 1  # (the running request keeps its slot)
    release.set()
    await held
    assert gate.in_use == 0


async def test_admission_gate_survives_a_cancel_racing_a_release():
    """A waiter cancelled (client gone) in the same loop turn as a release: the release must
    neither grant the cancelled waiter (its future cannot take a result) nor fail, and the
    cancelled waiter's own clean-up must not fail either; the slot goes to the next waiter."""
    gate = AdmissionGate(max_concurrent=1, max_queued=2)
    granted: list[str] = []

    async def wait(name: str) -> None:
        async with gate.slots(1):
            granted.append(name)

    async with gate.slots(1):  # the one slot, held here
        b = asyncio.create_task(wait("b"))
        c = asyncio.create_task(wait("c"))
        await asyncio.sleep(0)
        assert gate.num_queued == 2
        b.cancel()  # b's future is cancelled now; its except clause runs on a later turn
    # Leaving the block released the slot in the same turn, b's cancelled waiter at the head.
    await asyncio.gather(b, c, return_exceptions=True)
    assert b.cancelled() and granted == ["c"]
    assert gate.in_use == 0 and gate.num_queued == 0


def test_schema_parsing_is_strict_and_names_fields():
    req = parse_object(CompletionRequest, {"prompt": [[1, 2], [3]], "stop": None, "n": 2})
    assert req.prompt == [[1, 2], [3]] and req.stop is None and req.max_tokens is None
    cases = [
        ({"prompt": "x", "n": True}, "n"),  # a bool is not an int
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ]
    for body, param in cases:
        with pytest.raises(SchemaError) as err:
            parse_object(CompletionRequest, body)
        assert err.value.param == param
    chat = parse_object(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]}]},
    )  # fmt: skip
    assert chat.template_messages() == [{"role": "user", "content": "a\nb"}]
    assert describe(typing.get_type_hints(CompletionRequest)["prompt"]) == (
        "a string, an array of integers, an array of strings or an array of arrays of integers"
    )


@dataclasses.dataclass(frozen=True)
class _Tags:
    names: list[str] = dataclasses.field(default_factory=list)


def test_a_body_nested_deeper_than_the_standard_decoder_goes_is_read_as_orjson_reads_it():
    """A body with a long run of digits is read again by json, whose recursive decoder gives
    out before orjson's 1024 levels: orjson's reading stands (not a 500)."""
    from rltserve.http.validation import loads

    deep = b"[" * 1000 + b"1234567890123456789012" + b"]" * 1000
    value = loads(b'{"x": ' + deep + b"}")["x"]
    for _ in range(1000):
        (value,) = value
    assert value == 1.2345678901234568e21  # (orjson's float: the depth kept json out)
    assert loads(b'{"x": [1234567890123456789012]}') == {"x": [1234567890123456789012]}


def test_schema_numbers_and_optional_factories():
    # JSON true is no number, though Python's bool is an int.
    with pytest.raises(SchemaError) as err:
        parse_object(CompletionRequest, {"prompt": "x", "temperature": True})
    assert err.value.param == "temperature"
    # An integer beyond 64 bits is quoted as sent (``loads`` keeps it exact, where orjson
    # reads it as a float), with the range; a float is no integer, however large.
    int64 = "[-9223372036854775808, 9223372036854775807]"
    refused = {
        b'"priority": 99999999999999999999': "priority=99999999999999999999 (beyond 64-bit "
        f"integers): must be an integer in {int64}",
        b'"seed": -9223372036854775809': "seed=-9223372036854775809 (beyond 64-bit integers): "
        f"must be an integer in {int64}",
        # (orjson's largest: an integer, out of the range)
        b'"seed": 18446744073709551615': "seed=18446744073709551615: must be an integer in "
        f"{int64}",
        b'"n": 123456789012345678901234567890': "n=123456789012345678901234567890 (beyond 64-bit "
        "integers): must be an integer",
        b'"max_tokens": 1e20': "max_tokens=1e+20: must be an integer",
        b'"priority": 1.0': f"priority=1.0: must be an integer in {int64}",
        b'"priority": "1"': f"priority: must be an integer in {int64}",
        b'"stop_token_ids": [99999999999999999999]': "stop_token_ids: must be an array of integers",
    }
    for field, message in refused.items():
        with pytest.raises(SchemaError) as err:
            parse_object(CompletionRequest, loads(b'{"prompt": "x", ' + field + b"}"))
        assert err.value.message == message, field
    assert loads(b'{"a": [99999999999999999999, 1e20, "12345678901234567890"]}') == {
        "a": [99999999999999999999, 1e20, "12345678901234567890"]
    }
    # A number field takes such an integer as the float it is near (as orjson reads it).
    big = parse_object(
        CompletionRequest, loads(b'{"prompt": "x", "temperature": 1' + b"0" * 30 + b"}")
    )
    assert big.temperature == 1e30 and type(big.temperature) is float
    # A field with a default_factory is optional, like one with a default.
    assert parse_object(_Tags, {}) == _Tags([])
    assert parse_object(_Tags, {"names": ["a"]}) == _Tags(["a"])


def test_request_to_sampling_params():
    req = parse_object(
        CompletionRequest,
        {"prompt": "x", "stop": "END", "seed": 7, "num_steps": 3, "top_k": 5,
         "exit_threshold": 0.8, "priority": -1, "stop_token_ids": [9]},
    )  # fmt: skip
    params = sampling_params(req, max_tokens=10, logprobs=2, sample_index=2)
    assert params.stop == ["END"] and params.seed == 9 and params.max_loops == 3
    assert (params.top_k, params.exit_threshold, params.priority) == (5, 0.8, -1)
    assert params.stop_token_ids == [9] and params.logprobs == 2 and params.temperature == 1.0
    # vLLM's seed -1 is no seed, for every sample (sample 1 is not seeded 0).
    unseeded = parse_object(CompletionRequest, {"prompt": "x", "seed": -1, "n": 2})
    seeds = [sampling_params(unseeded, max_tokens=1, logprobs=None, sample_index=j).seed
             for j in (0, 1)]  # fmt: skip
    assert seeds == [None, None]
    bad = parse_object(CompletionRequest, {"prompt": "x", "repetition_penalty": 0})
    with pytest.raises(SchemaError) as err:
        sampling_params(bad, max_tokens=1, logprobs=None, sample_index=0)
    assert err.value.param == "repetition_penalty"


def test_error_helpers():
    assert param_of("max_tokens=0: must be >= 1") == "max_tokens"
    assert param_of("the request needs 9 KV blocks (...)") is None
    assert error_body(429, "slow down") == {
        "error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": 429}
    }


@pytest.mark.parametrize(
    ("error", "rejected", "status"),
    [
        ("the engine is asleep (kv_cache put to sleep): wake_up() first", True, 503),
        ("max_tokens=9: too many", True, 400),
        ("stage died: exit 9", False, 503),
        ("engine error while planning a step: boom", False, 500),
        # (only a refusal says the engine sleeps: a failure worded alike is still a failure)
        ("the engine is asleep, it said as it failed", False, 500),
    ],
)
def test_an_ended_choice_is_the_error_its_engine_update_stands_for(error, rejected, status):
    from rltserve.http.generation import ChoiceEvent, failure
    from rltserve.outputs import TextDelta

    delta = TextDelta("", [], [], [], "error", error=error)
    got = failure(ChoiceEvent(0, delta, None, rejected), closing=False, retry_after_s=2)
    assert got is not None and got.status == status
    # A stage that died is restarted: another try may succeed (so may one after /wake_up).
    retry = {"Retry-After": "2"} if status == 503 else {}
    assert dict(got.headers or {}) == retry
