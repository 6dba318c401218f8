"""The stage clients' and the step thread's boundaries on unhappy paths that the lifecycle tests
leave out: a failing sink's request leaves the engine, a command waiting for its reply ends when
the stage dies or the client closes, one raising sink at a failure does not keep the others
waiting, ``wait_ready`` ends at close, a worker that does not stop is killed, a worker that stops
reading never blocks a sender, and the step thread survives a raising idle hook and a cancelled
job. Every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import pytest
from test_stage_lifecycle import LONG, WAIT_S, bounded

from rltserve import SamplingParams
from rltserve.config import EngineConfig
from rltserve.core import stage
from rltserve.core.executor import StepThread
from rltserve.core.request import FinishReason
from rltserve.core.stage import InProcessStageClient, StageClient, StageConfigError, StageError

BOUND_S = 20  # a regression hangs; the pristine code answers within a second or two


def _config(tiny) -> EngineConfig:
    return EngineConfig.from_flat(model=str(tiny), num_blocks=1024)


def _wait_running(client, n: int = 1) -> None:
    event = threading.Event()
    for _ in range(WAIT_S * 100):
        stats = client.stats
        if stats is not None and stats.num_running >= n:
            return
        event.wait(0.01)
    pytest.fail("the request never started running")


def _finals(done: threading.Event, finals: dict, name: str, want: int):
    def sink(update):
        if update.finish_reason is not None:
            finals[name] = update
            if len(finals) == want:
                done.set()

    return sink


def _pending_update(client, tiny) -> tuple[threading.Thread, dict]:
    """An update_weights call that waits (a LONG request runs) on a thread of its own."""
    box: dict = {}

    def call():
        try:
            box["value"] = client.update_weights([str(tiny)], False, 600.0)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    for _ in range(WAIT_S * 100):
        if client._replies:  # the call waits for its reply
            break
        thread.join(0.01)
    return thread, box


@pytest.mark.parametrize("client_cls", [StageClient, InProcessStageClient])
def test_a_failing_sink_aborts_its_request_in_the_engine(tiny, client_cls):
    client = client_cls(_config(tiny))
    try:
        client.wait_ready(WAIT_S)
        failed = threading.Event()

        def explode(update):
            if update.finish_reason is not None:
                failed.set()  # the final error update, sent after the abort
                return
            raise RuntimeError("sink exploded")

        client.add_request("culprit", [4, 5], LONG, explode)
        assert failed.wait(WAIT_S)
        done, finals = threading.Event(), {}
        probe = SamplingParams(temperature=0.0, max_tokens=1)
        client.add_request("probe", [7, 8], probe, _finals(done, finals, "p", 1))
        assert done.wait(WAIT_S)
        assert finals["p"].finish_reason is FinishReason.LENGTH
        # The abort reached the stage before the probe: nothing else runs or holds KV.
        assert client.stats.num_running == 0 and client.stats.num_waiting == 0
        assert client.stats.kv_usage == 0.0
    finally:
        client.close()


@pytest.mark.parametrize("client_cls", [StageClient, InProcessStageClient])
def test_a_config_the_engine_refuses_is_a_value_error_with_its_reason(tiny, client_cls):
    client = client_cls(EngineConfig.from_flat(model=str(tiny), num_blocks=64, kv_policy="ring:2"))
    try:
        with pytest.raises(StageConfigError, match=r"^kv_policy='ring:2': ring:K is for Huginn"):
            client.wait_ready(WAIT_S)
        assert not client.alive
    finally:
        client.close()


def test_a_command_waiting_for_its_reply_fails_when_the_stage_dies(tiny):
    client = StageClient(_config(tiny))
    pid = client.pid
    try:
        client.wait_ready(WAIT_S)
        client.add_request("long", [1, 2, 3], LONG, lambda update: None)
        _wait_running(client)
        thread, box = _pending_update(client, tiny)
        client.kill()
        thread.join(BOUND_S)
        assert not thread.is_alive(), "update_weights still waiting after the stage died"
        assert isinstance(box.get("error"), StageError), box
        assert "stage died" in str(box["error"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        client.close()


@pytest.mark.parametrize("client_cls", [StageClient, InProcessStageClient])
def test_close_ends_a_command_waiting_for_its_reply(tiny, client_cls):
    client = client_cls(_config(tiny))
    try:
        client.wait_ready(WAIT_S)
        client.add_request("long", [1, 2, 3], LONG, lambda update: None)
        _wait_running(client)
        thread, box = _pending_update(client, tiny)
        bounded(client.close, timeout=BOUND_S)
        thread.join(BOUND_S)
        assert not thread.is_alive(), "update_weights still waiting after close()"
        assert isinstance(box.get("error"), StageError) and "closed" in str(box["error"]), box
        assert client.weight_version == 0
    finally:
        client.close()


def test_commands_on_a_closed_in_process_client_raise(tiny):
    client = InProcessStageClient(_config(tiny))
    client.wait_ready(WAIT_S)
    client.close()
    calls = (lambda: client.sleep(1, 0.0), client.reset_prefix_cache, lambda: client.wake_up([]))
    for call in calls:
        with pytest.raises(StageError, match="closed"):
            bounded(call, timeout=BOUND_S)
    with pytest.raises(StageError, match="closed"):  # ready once, closed now
        client.wait_ready(WAIT_S)


def test_a_request_id_in_use_is_refused_and_the_first_request_keeps_its_sink(tiny):
    client = InProcessStageClient(_config(tiny))
    try:
        client.wait_ready(WAIT_S)
        done, finals = threading.Event(), {}
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        client.add_request("dup", [1, 2, 3], params, _finals(done, finals, "first", 1))
        with pytest.raises(ValueError, match="request_id='dup': already in use"):
            client.add_request("dup", [4, 5], params, _finals(done, finals, "second", 1))
        assert done.wait(WAIT_S)
        assert list(finals) == ["first"]
        assert finals["first"].finish_reason is FinishReason.LENGTH
    finally:
        client.close()


def test_a_request_whose_add_cannot_be_sent_raises_and_leaves_no_sink(tiny):
    client = InProcessStageClient(_config(tiny))
    try:
        client.wait_ready(WAIT_S)
        send = client._send

        def refuse_adds(message):
            if message[0] == "add":
                raise StageError("stage is not running: injected")
            send(message)

        client._send = refuse_adds
        with pytest.raises(StageError, match="injected"):
            client.add_request("r", [1, 2], SamplingParams(temperature=0.0), lambda u: None)
        assert "r" not in client._sinks
        client._send = send
        done, finals = threading.Event(), {}
        probe = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        client.add_request("r", [1, 2], probe, _finals(done, finals, "r", 1))  # the id is free
        assert done.wait(WAIT_S) and finals["r"].finish_reason is FinishReason.LENGTH
    finally:
        client.close()


def test_the_samples_of_a_group_share_their_prompt_through_the_client(tiny):
    """(Caching off: only the group key lets the second sample reuse the first's prompt.)"""
    config = EngineConfig.from_flat(
        model=str(tiny), num_blocks=256, kv_policy="last_exited", enable_prefix_caching=False
    )
    client = InProcessStageClient(config)
    try:
        client.wait_ready(WAIT_S)
        done, cached, waited = threading.Event(), {}, {}
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        prompt = list(range(1, 41))
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

        def sink_for(rid):
            def sink(update):
                tokens[rid] += update.new_token_ids
                if update.num_cached_tokens is not None:
                    cached.setdefault(rid, update.num_cached_tokens)
                    waited[rid] = update.queued_s  # (beside it: the wait before scheduling)
                if (
                    update.finish_reason is not None
                    and len(cached) == 2
                    and all(len(t) == 3 for t in tokens.values())
                ):
                    done.set()

            return sink

        client.add_request("a", prompt, params, sink_for("a"), group="g")
        client.add_request("b", prompt, params, sink_for("b"), group="g")
        assert done.wait(WAIT_S)
        assert tokens["a"] == tokens["b"]
        assert cached["a"] == 0 and cached["b"] > 0, cached
        assert all(type(w) is float and w >= 0.0 for w in waited.values()) and len(waited) == 2
    finally:
        client.close()


def test_one_raising_sink_does_not_keep_the_others_waiting_when_the_stage_dies(tiny):
    client = StageClient(_config(tiny))
    pid = client.pid
    try:
        client.wait_ready(WAIT_S)
        done, finals = threading.Event(), {}

        def raising(update):
            if update.finish_reason is not None:
                raise RuntimeError("this sink raises on its final update")

        client.add_request("first", [1, 2, 3], LONG, raising)
        client.add_request("second", [4, 5], LONG, _finals(done, finals, "second", 1))
        _wait_running(client, 2)
        client.kill()
        assert done.wait(BOUND_S), "the second request never ended"
        assert finals["second"].finish_reason is FinishReason.ERROR
        assert "stage died" in finals["second"].error
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        client.close()


def test_close_wakes_a_thread_waiting_for_a_stage_that_is_not_ready(tiny, monkeypatch):
    def never_ready(config, recv, send, on_idle=None, role=None):
        # a stage that is still starting when close() comes (serve's signature)
        while recv()[0] != "shutdown":
            pass

    monkeypatch.setattr(stage, "serve", never_ready)
    client = InProcessStageClient(_config(tiny))
    box: dict = {}

    def wait():
        try:
            client.wait_ready(WAIT_S)
        except StageError as exc:
            box["error"] = exc

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    client.close()
    thread.join(BOUND_S)
    assert not thread.is_alive(), "wait_ready() still waiting after close()"
    assert "closed" in str(box["error"])


def test_close_kills_and_reaps_a_worker_that_does_not_stop(tiny):
    client = StageClient(_config(tiny))
    pid = client.pid
    try:
        client.wait_ready(WAIT_S)
        os.kill(pid, signal.SIGSTOP)
        bounded(client.close, 1.0, timeout=BOUND_S)
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left stopped
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        client.close()


def test_requests_to_a_worker_that_stopped_reading_never_block_the_sender(tiny):
    """A burst past what the channel buffers, while the worker does not read (stopped, frozen):
    each add and abort returns at once (the server sends them from its event loop, where its
    watchdog runs too), and the requests end once the client closes."""
    client = StageClient(_config(tiny))
    pid = client.pid
    finals: list = []
    prompt = list(range(3, 4003))  # (about 12 KB a message: 100 of them fill any buffer)
    try:
        client.wait_ready(WAIT_S)
        os.kill(pid, signal.SIGSTOP)

        def burst() -> None:
            for i in range(100):
                client.add_request(f"r{i}", prompt, LONG, finals.append)
                client.abort(f"r{i}")

        bounded(burst, timeout=BOUND_S)
        bounded(client.close, 1.0, timeout=BOUND_S)
        assert sorted(u.request_id for u in finals) == sorted(f"r{i}" for i in range(100))
        assert {u.finish_reason for u in finals} == {FinishReason.ABORT}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        client.close()


# ---------------------------------------------------------------- the step thread


def test_an_idle_hook_that_raises_does_not_stop_the_step_thread():
    thread = StepThread()
    calls = {"n": 0}

    def hook() -> bool:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("idle hook failed")
        return False

    try:
        thread.set_idle(hook)
        thread.submit(lambda: None).result(timeout=BOUND_S)
        assert thread.submit(lambda: 7).result(timeout=BOUND_S) == 7
        assert calls["n"] >= 1 and thread.alive
    finally:
        thread.set_idle(None)
        thread.stop()


def test_call_from_the_step_thread_itself_runs_inline():
    thread = StepThread()
    try:
        assert thread.submit(thread.call, lambda: 5).result(timeout=BOUND_S) == 5
    finally:
        thread.stop()


def test_a_cancelled_job_is_skipped_and_the_step_thread_goes_on():
    thread = StepThread()
    release = threading.Event()
    ran: list[str] = []
    try:
        first = thread.submit(release.wait, BOUND_S)
        second = thread.submit(ran.append, "cancelled")
        assert second.cancel()  # still queued behind the first
        release.set()
        assert first.result(timeout=BOUND_S)
        assert thread.submit(lambda: 7).result(timeout=BOUND_S) == 7
        assert ran == [] and thread.alive
    finally:
        release.set()
        thread.stop()


def test_closing_an_in_process_client_stops_its_step_thread(tiny):
    """(Async scheduling: the engine's step thread ends with the stage, not at some later
    garbage collection.)"""

    def step_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "rltserve-step" and t.is_alive()}

    before = step_threads()  # (other tests' engines may still be going)
    config = EngineConfig.from_flat(
        model=str(tiny), num_blocks=64, async_scheduling=True, exit_mode="delayed"
    )
    client = InProcessStageClient(config)
    try:
        client.wait_ready(WAIT_S)
        ours = step_threads() - before
        assert len(ours) == 1
    finally:
        client.close()
    assert not ours.pop().is_alive()
