"""A compiled constraint crosses to each replica once (``ray/guides.py``), without Ray: the front
end puts an index in the object store once however many calls and samples carry it, and sends a
small ref in its place; a replica fetches a key the first time it sees it, keeps the last
``kept``, and hands its engine the params with the index, their other marks kept."""

from __future__ import annotations

import asyncio
import gc
import pickle

import pytest
from test_ray_relay import FakeCall, FakeStage, FakeStream, _batch, _client, _replica

from rltserve.guide_index import GuideCompiler, after_reasoning, compiled_index, with_index
from rltserve.models.tokenizer import load_tokenizer
from rltserve.ray.guides import GuideRef, GuideShipper, GuideStore
from rltserve.sampling import SamplingParams
from rltserve.structured import StructuredOutputsParams
from rltserve.updates import FinishReason, RequestUpdate

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture(scope="module")
def compiler(tiny):
    return GuideCompiler(load_tokenizer(tiny))


def guided(compiler, structured: StructuredOutputsParams, **kw) -> SamplingParams:
    index = compiler.compile(structured.pattern())
    return SamplingParams(structured_outputs=with_index(structured, index), **kw)


OBJECTS: dict[int, object] = {}  # (the fake object store's content)


class Store:
    """Ray's object store as ``ray.put`` and an awaited ref see it: a ref pickles as its
    number and is awaitable."""

    def __init__(self) -> None:
        self.puts = 0

    def put(self, value):
        self.puts += 1
        OBJECTS[id(value)] = value
        return Ref(id(value))


class Ref:
    def __init__(self, number: int) -> None:
        self.number = number

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return OBJECTS[self.number]


def test_an_index_is_put_once_and_calls_carry_a_small_ref(compiler):
    store = Store()
    shipper = GuideShipper(put=store.put)
    params = guided(compiler, StructuredOutputsParams(json=SCHEMA), n=4, seed=1)
    index = compiled_index(params.structured_outputs)
    sent = [shipper.detach(params) for _ in range(4)]  # (each sample of n=4 is a call)
    assert store.puts == 1 and len(shipper) == 1
    refs = [compiled_index(p.structured_outputs) for p in sent]
    assert all(isinstance(r, GuideRef) for r in refs) and len({id(r.ref) for r in refs}) == 1
    assert refs[0].key == (index.pattern, index.eos, index.size)
    # What a call pickles: the params without the index's bytes.
    data = index.__reduce__()[1][-1]
    assert data in pickle.dumps(params) and data not in pickle.dumps(sent[0])
    assert compiled_index(params.structured_outputs) is index  # (the caller's params unchanged)
    assert sent[0].n == 4 and sent[0].seed == 1
    unguided = SamplingParams(max_tokens=3)
    assert shipper.detach(unguided) is unguided and store.puts == 1


def test_the_front_end_holds_an_index_object_only_while_the_index_lives(tiny):
    shipper = GuideShipper(put=lambda index: object())  # (Ray's ref holds no Python object)
    own = GuideCompiler(load_tokenizer(tiny), cache_size=1)
    shipper.detach(guided(own, StructuredOutputsParams(regex="[a-c]{2}")))
    assert len(shipper) == 1
    own.compile("[d-f]{2}")  # pushes the first out of the compiler's cache: nothing holds it
    gc.collect()
    assert len(shipper) == 0


async def test_a_replica_fetches_a_key_once_and_keeps_the_last_kept(compiler):
    store, replica = Store(), GuideStore(kept=2)
    shipper = GuideShipper(put=store.put)
    regexes = ["[a-c]{2}", "[d-f]{2}", "[g-i]{2}"]
    params = [guided(compiler, StructuredOutputsParams(regex=r)) for r in regexes]
    for p in (params[0], params[0], params[1], params[0]):
        got = await replica.attach(shipper.detach(p))
        assert compiled_index(got.structured_outputs) is compiled_index(p.structured_outputs)
    assert replica.fetches == 2
    await replica.attach(shipper.detach(params[2]))  # pushes out the least recently used: [1]
    await replica.attach(shipper.detach(params[0]))
    assert replica.fetches == 3 and len(replica) == 2
    await replica.attach(shipper.detach(params[1]))
    assert replica.fetches == 4
    unguided = SamplingParams(max_tokens=3)
    assert await replica.attach(unguided) is unguided


async def test_a_constraint_after_the_thinking_span_keeps_its_mark(compiler):
    params = guided(compiler, StructuredOutputsParams(choice=["yes", "no"]))
    params = params.replace(structured_outputs=after_reasoning(params.structured_outputs, 4))
    shipper = GuideShipper(put=Store().put)
    got = await GuideStore().attach(pickle.loads(pickle.dumps(shipper.detach(params))))
    assert got.structured_outputs._reasoning_end == 4
    assert compiled_index(got.structured_outputs).pattern == params.structured_outputs.pattern()


class RecordingStream(FakeStream):
    def __init__(self, call: FakeCall) -> None:
        super().__init__(call)
        self.args: list[tuple] = []

    def remote(self, *args):
        self.args.append(args)
        return self.call


async def test_a_guided_request_reaches_the_replicas_engine_with_its_index(compiler):
    """Through the relay: the call carries the ref, the replica's engine gets the index."""
    params = guided(compiler, StructuredOutputsParams(json=SCHEMA), n=2)
    final = RequestUpdate("r", [5], finish_reason=FinishReason.STOP)
    client = _client(None)
    client._stream = stream = RecordingStream(FakeCall([_batch(final)]))
    client._guides = GuideShipper(put=Store().put)
    for rid in ("r-0", "r-1"):
        client.add_request(rid, [1, 2], params, lambda update: None, group="g")
        await asyncio.wait_for(client._tasks[rid], 10)
    sent = [args[2] for args in stream.args]
    assert all(isinstance(compiled_index(p.structured_outputs), GuideRef) for p in sent)
    stage = RecordingStage([final])
    replica = _replica(stage)
    for p in sent:
        [_ async for _ in replica.generate("r", [1, 2], pickle.loads(pickle.dumps(p)), "g")]
    index = compiled_index(params.structured_outputs)
    got = [compiled_index(p.structured_outputs) for p in stage.params]
    assert got[0] is got[1] and replica._guides.fetches == 1  # (one copy for both samples)
    assert got[0].pattern == index.pattern and got[0].eos == index.eos


class RecordingStage(FakeStage):
    def __init__(self, updates) -> None:
        super().__init__(updates)
        self.params: list[SamplingParams] = []

    def add_request(self, rid, prompt, params, sink, group=None):
        self.params.append(params)
        super().add_request(rid, prompt, params, sink, group)
