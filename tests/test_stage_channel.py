"""The channel to a stage worker (``core/worker_process.py``, ``core/guide_registry.py``) with
messages that do not cross: one that does not pickle fails its add alone and leaves no request
behind, an object of the caller's ``__main__`` (which the worker does not run) is refused
before it is sent, and one the worker cannot read fails the stage with its cause instead of
leaving the worker deaf to every later command. Every wait is bounded."""

from __future__ import annotations

import pickle
import sys
import threading

import pytest
from test_stage_lifecycle import WAIT_S

from rltserve import SamplingParams
from rltserve.config import EngineConfig
from rltserve.core.guide_registry import GuidePickler
from rltserve.core.request import FinishReason
from rltserve.core.stage import StageClient, StageError


class _Unreadable:
    """Pickles here; unpickling it raises, as an object of a class the worker cannot import
    (one from a module next to the caller's script) does."""

    def __reduce__(self) -> tuple:
        return int, ("not a number",)


def _params(extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4, extra_args={"x": extra})


@pytest.fixture(scope="module")
def client(tiny):
    client = StageClient(EngineConfig.from_flat(model=str(tiny), num_blocks=1024))
    client.wait_ready(WAIT_S)
    yield client
    client.close()


def _final(client, request_id: str, params: SamplingParams):
    done, box = threading.Event(), {}

    def sink(update):
        if update.finish_reason is not None:
            box.setdefault("final", update)
            done.set()

    client.add_request(request_id, [1, 2, 3], params, sink)
    assert done.wait(WAIT_S), f"{request_id} never ended"
    return box["final"]


def test_a_message_that_does_not_pickle_fails_its_add_alone(client):
    ended: list = []
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        client.add_request("r", [1, 2, 3], _params(lambda: 0), ended.append)
    # The id is free again, the stage serves, and the failed add's sink never hears of it.
    assert _final(client, "r", _params(1)).finish_reason is FinishReason.LENGTH
    assert ended == []


def test_an_object_of_the_callers_main_is_refused_before_it_is_sent(monkeypatch):
    """A script's own class pickles by name here, and the worker, whose ``__main__`` is not the
    script, could not read it (the stage would fail): the add raises instead."""
    namespace: dict = {"__name__": "__main__"}
    exec("class Tag:\n    pass\n\ndef hook():\n    pass\n", namespace)
    for name in ("Tag", "hook"):  # (where a script's own would be)
        monkeypatch.setattr(sys.modules["__main__"], name, namespace[name], raising=False)
    sender = GuidePickler()
    for obj in (namespace["Tag"](), namespace["hook"]):
        with pytest.raises(pickle.PicklingError, match=r"defined in __main__, which the stage"):
            sender.dumps(("add", "r", [1], _params(obj)))
    pickle.loads(sender.dumps(("add", "r", [1], _params(_Unreadable))))  # (by name: readable)


def test_a_message_the_worker_cannot_read_fails_the_stage_with_its_cause(tiny):
    client = StageClient(EngineConfig.from_flat(model=str(tiny), num_blocks=1024))
    try:
        client.wait_ready(WAIT_S)
        final = _final(client, "bad", _params(_Unreadable()))
        assert final.finish_reason is FinishReason.ERROR
        cause = "a message from the client could not be read: ValueError: invalid literal"
        assert cause in final.error
        with pytest.raises(StageError, match="could not be read"):
            client.add_request("next", [1, 2], _params(1), lambda u: None)
    finally:
        client.close()
