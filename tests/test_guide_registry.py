"""A compiled constraint crosses a worker channel once (``core/guide_registry.py``): in full the
first time, by reference after, the worker holding exactly what the sender's record says (the
oldest dropped on both sides past ``kept``), a message that fails to pickle changing nothing;
and masks come from outlines-core's bitmask, equal to its list of allowed ids, with ids past
the vocabulary's count kept (``core/guide.py``)."""

from __future__ import annotations

import pickle

import pytest
import torch

from rltserve.core import guide_registry
from rltserve.core.guide import Guide, GuideMasks
from rltserve.core.guide_registry import GuidePickler
from rltserve.guide_index import (
    END_ID,
    END_MARK,
    GuideCompiler,
    GuideIndex,
    _mask_size,
    _with_end_mark,
)
from rltserve.models.tokenizer import load_tokenizer
from rltserve.sampling import SamplingParams
from rltserve.structured import StructuredOutputsParams, outlines_core

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture(scope="module")
def compiler(tiny):
    return GuideCompiler(load_tokenizer(tiny))


@pytest.fixture
def worker(monkeypatch):
    """This process as the worker: a registry of its own."""
    monkeypatch.setattr(guide_registry, "registry", {})
    return guide_registry


def add(index: GuideIndex) -> tuple:
    structured = StructuredOutputsParams(regex=index.pattern)
    object.__setattr__(structured, "_index", index)
    return ("add", "r", [1, 2, 3], SamplingParams(structured_outputs=structured))


def test_an_index_crosses_in_full_once_then_by_reference(compiler, worker):
    index = compiler.compile(StructuredOutputsParams(json=SCHEMA).pattern())
    sender = GuidePickler()
    first, second = sender.dumps(add(index)), sender.dumps(add(index))
    assert len(second) < len(pickle.dumps(index)) < len(first)
    got = [pickle.loads(m)[3].structured_outputs._index for m in (first, second)]
    assert got[0] is got[1] and got[0].pattern == index.pattern and got[0].eos == index.eos
    assert got[0].index.get_transitions() == index.index.get_transitions()
    assert len(worker.registry) == 1 and len(sender) == 1


def test_the_worker_drops_what_the_sender_forgets(compiler, worker):
    indexes = [compiler.compile(f"[a-z]{{{k}}}") for k in range(1, 5)]
    sender = GuidePickler(kept=2)
    for index in indexes:
        pickle.loads(sender.dumps(add(index)))
    assert len(worker.registry) == 2 and len(sender) == 2
    assert {i.pattern for i in worker.registry.values()} == {"[a-z]{3}", "[a-z]{4}"}
    again = sender.dumps(add(indexes[0]))  # (forgotten: in full again)
    assert len(again) > len(sender.dumps(add(indexes[0])))
    assert pickle.loads(again)[3].structured_outputs._index.pattern == "[a-z]{1}"


def test_an_index_in_use_outlives_older_ones(compiler, worker):
    """The least recently sent index is the one forgotten: a constraint every request uses
    keeps crossing by reference however many others come and go."""
    hot, *others = [compiler.compile(f"[0-9]{{{k}}}") for k in range(1, 5)]
    sender = GuidePickler(kept=2)
    pickle.loads(sender.dumps(add(hot)))
    by_reference = len(sender.dumps(add(hot)))
    for other in others:
        pickle.loads(sender.dumps(add(other)))
        again = sender.dumps(add(hot))
        assert len(again) == by_reference  # (the worker still holds it)
        assert pickle.loads(again)[3].structured_outputs._index.pattern == hot.pattern
    assert {i.pattern for i in worker.registry.values()} == {hot.pattern, others[-1].pattern}


def test_a_message_that_fails_to_pickle_changes_no_record(compiler, worker):
    index, other = compiler.compile("[0-9]{2}"), compiler.compile("[0-9]{3}")
    sender = GuidePickler()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        sender.dumps((add(index), add(other), lambda: None))  # (two new indexes, then a failure)
    assert len(sender) == 0
    message = pickle.loads(sender.dumps(add(index)))  # (in full: the worker never had it)
    assert message[3].structured_outputs._index.pattern == "[0-9]{2}"


def test_masks_equal_the_allowed_ids_along_a_walk(compiler, monkeypatch):
    """Built from the bitmask, never from the list of allowed ids (up to the whole vocabulary
    at each cache miss): the same masks."""
    index = compiler.compile(StructuredOutputsParams(json=SCHEMA).pattern())
    guide, masks, rng = Guide(index), GuideMasks(), torch.Generator().manual_seed(0)
    allowed = Guide.allowed
    monkeypatch.setattr(Guide, "allowed", lambda self: pytest.fail("the list was built"))
    for _ in range(30):
        ids = allowed(guide)
        want = torch.zeros(600, dtype=torch.bool)
        want[ids] = True
        assert torch.equal(masks.mask(guide, 600, torch.device("cpu")), want)
        assert torch.equal(masks.mask(guide, 100, torch.device("cpu")), want[:100])
        if guide.state is None:
            break
        guide.advance(ids[int(torch.randint(len(ids), (1,), generator=rng))])


def test_a_mask_keeps_ids_past_the_vocabulary_count():
    """outlines-core sizes a bitmask by its number of ids: the end and an id far past that
    count are still allowed; the end mark is never (the end id's bit stands for it)."""
    core = outlines_core()
    table = {b"a": [100], b"b": [3]}
    size = _mask_size(table, 5)
    vocabulary = core.Vocabulary(5, {**table, END_MARK.encode(): [END_ID]})
    index = GuideIndex("(a|b)b?", core.Index(_with_end_mark("(a|b)b?"), vocabulary), 5, size)
    guide = Guide(index)
    assert size == 101 and guide.mask(128).nonzero().flatten().tolist() == [3, 100]
    guide.advance(100)
    assert guide.mask(128).nonzero().flatten().tolist() == [3, 5]  # (may end or go on)
    guide.advance(3)
    assert guide.mask(128).nonzero().flatten().tolist() == [5]
    guide.advance(5)
    assert guide.state is None and guide.mask(4).tolist() == [False] * 4
    assert guide.mask(8).nonzero().flatten().tolist() == [5]


def test_a_mask_covers_the_vocabulary_not_the_end_mark(compiler, monkeypatch):
    """The end mark's id is 2**31 - 1: a bitmask sized to cover it would be 256 MB. The buffer
    covers the real ids, and a mask is [V] bools."""
    index = compiler.compile("[0-9]+")
    assert index.size <= 1024
    sizes = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda n, **kw: sizes.append(n) or empty(n, **kw))
    guide = Guide(index)
    guide.advance(guide.allowed()[0])
    mask = guide.mask(600)
    assert sizes and max(sizes) * 4 <= 1024 // 8 + 4
    assert mask.numel() * mask.element_size() == 600 and mask[index.eos]
