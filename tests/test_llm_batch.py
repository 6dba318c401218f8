"""PendingBatch, the requests of one ``LLM.generate`` call: a failed request wakes the caller at
once with the others left to abort; a request that ends on a stop string is aborted at the
stage and later updates of it change nothing; an assembling error fails only its request."""

from __future__ import annotations

import threading

import pytest

from rltserve.core.request import FinishReason
from rltserve.llm_batch import PendingBatch
from rltserve.models.tokenizer import load_tokenizer
from rltserve.outputs import OutputAssembler
from rltserve.updates import RequestUpdate


def _batch(*rids: str) -> tuple[PendingBatch, dict, list[str]]:
    """A batch of one-sample prompts without text, their sinks and the ids they aborted."""
    pending, sinks, aborted = PendingBatch(), {}, []
    for index, rid in enumerate(rids):
        asm = OutputAssembler(rid, [1, 2])
        pending.add(asm, index)
        sinks[rid] = pending.sink(asm, aborted.append)
    return pending, sinks, aborted


def test_a_failed_request_wakes_the_caller_with_the_rest_unfinished():
    pending, sinks, aborted = _batch("0", "1", "2")
    sinks["0"](RequestUpdate("0", [5], [4], finish_reason=FinishReason.LENGTH))
    sinks["1"](RequestUpdate("1", [6], [4]))  # still running
    sinks["2"](RequestUpdate("2", finish_reason=FinishReason.ERROR, error="boom"))
    waiter = threading.Thread(target=pending.wait, daemon=True)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive()  # without waiting for "1"
    assert pending.failed and pending.unfinished() == ["1"]
    assert not aborted  # (the caller aborts the rest, knowing why)


def test_an_assembling_error_fails_only_its_request():
    pending, sinks, _ = _batch("0", "1")
    bad = RequestUpdate("0", [5], [4], new_logprobs=None)  # (not a list: zip raises)
    pending.assemblers[0].output.logprobs = []
    sinks["0"](bad)
    first = pending.assemblers[0].output
    assert first.finish_reason == "error" and first.error.startswith("TypeError while assembling")
    assert pending.failed and pending.unfinished() == ["1"]


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny)


def test_a_stop_string_aborts_the_request_once_and_later_updates_change_nothing(tokenizer):
    token = next(t for t in range(100, 500) if len(tokenizer.decode([t]).strip()) >= 2)
    stop = tokenizer.decode([token]).strip()
    asm = OutputAssembler("0", [1, 2], tokenizer, [stop])
    pending, aborted = PendingBatch(), []
    pending.add(asm, 0)
    sink = pending.sink(asm, aborted.append)
    sink(RequestUpdate("0", [token], [4]))  # the engine knows no stop strings: still running
    assert aborted == ["0"] and pending.unfinished() == []
    done = (asm.output.finish_reason, asm.output.stop_reason, list(asm.output.token_ids))
    assert done == ("stop", stop, [token])
    # What the stage sent before it saw the abort, then the abort's final update.
    sink(RequestUpdate("0", [token + 1], [4]))
    sink(RequestUpdate("0", finish_reason=FinishReason.ABORT))
    assert (asm.output.finish_reason, asm.output.stop_reason, asm.output.token_ids) == done
    assert aborted == ["0"]
