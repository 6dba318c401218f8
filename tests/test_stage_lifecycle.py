"""Request and process lifecycle of the LLM API and the stage clients on unhappy paths: bad
token ids, failures on the delivering thread, start-up errors, close with a stuck worker,
signals aimed at the worker, garbage collection, and generate() failing part-way. Every wait is
bounded so that a regression fails instead of hanging."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from multiprocessing import Pipe

import pytest
from test_llm_script import assert_gone

from rltserve import LLM, SamplingParams
from rltserve.config import EngineConfig
from rltserve.core.request import FinishReason
from rltserve.core.stage import InProcessStageClient, StageCheckpointError, StageClient, StageError
from rltserve.core.worker_process import WorkerProcess
from rltserve.outputs import OutputAssembler

WAIT_S = 60
LONG = SamplingParams(
    temperature=0.0, max_tokens=1500, ignore_eos=True
)  # runs for many steps on ouro-tiny


@pytest.fixture(scope="module", params=["spawned", "in_process"])
def llm(request, tiny):
    with LLM(str(tiny), num_blocks=1024, in_process=request.param == "in_process") as llm:
        yield llm


def bounded(fn, *args, timeout: float = WAIT_S):
    """Runs ``fn`` on a thread; returns its result or re-raises its exception; fails the test
    if it has not returned within ``timeout`` seconds."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still waiting after {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def assert_idle(llm: LLM) -> None:
    """Nothing left running in the engine: a fresh request's final stats show no other request
    and no KV in use (commands reach the stage in order, so earlier aborts came first)."""
    out = bounded(llm.generate, [[7, 8]], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert out.finish_reason == "length"
    stats = llm._client.stats
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_usage == 0.0


# ---------------------------------------------------------------- token ids out of range


@pytest.mark.parametrize("bad", [-3, 512, 2**32, 2**70])
def test_token_id_outside_vocabulary_raises_and_llm_keeps_working(llm, bad):
    with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 512\)"):
        bounded(llm.generate, [[bad]], SamplingParams(temperature=0.0, max_tokens=2))
    out = bounded(
        llm.generate, [[5, 6]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    assert len(out[0].token_ids) == 2


def test_rejection_of_undecodable_prompt_does_not_break_the_assembler(tiny):
    # The server assembles engine rejections too: the prompt ids must not be decoded.
    from rltserve.models.tokenizer import load_tokenizer
    from rltserve.updates import RequestUpdate

    asm = OutputAssembler("r", [-3], load_tokenizer(tiny))
    error = "prompt: token id -3 is outside the vocabulary [0, 512)"
    asm.add(RequestUpdate("r", finish_reason=FinishReason.ERROR, error=error, rejected=True))
    assert asm.rejected and asm.output.error == error and asm.output.text == ""


# ---------------------------------------------------------------- failures while delivering


def test_output_assembly_failure_fails_the_request_not_the_llm(llm, monkeypatch):
    real = OutputAssembler.add

    def boom(self, update):
        monkeypatch.setattr(OutputAssembler, "add", real)
        raise OverflowError("out of range integral type conversion attempted")

    monkeypatch.setattr(OutputAssembler, "add", boom)
    with pytest.raises(RuntimeError, match="OverflowError while assembling output"):
        bounded(llm.generate, [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    assert_idle(llm)


@pytest.mark.parametrize("client_cls", [StageClient, InProcessStageClient])
def test_sink_failure_fails_only_its_request(tiny, client_cls):
    client = client_cls(EngineConfig.from_flat(model=str(tiny), num_blocks=1024))
    try:
        client.wait_ready(WAIT_S)
        finals: dict = {}
        done = threading.Event()
        calls: list = []

        def record(name):
            def sink(update):
                if update.finish_reason is not None:
                    finals[name] = update
                    if len(finals) == 2:
                        done.set()

            return sink

        def explode(update):
            calls.append(update)
            if len(calls) == 1:
                raise RuntimeError("sink exploded")
            record("culprit")(update)

        client.add_request(
            "culprit", [4, 5], SamplingParams(temperature=0.0, max_tokens=8), explode
        )
        client.add_request(
            "victim",
            [1, 2, 3],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            record("victim"),
        )
        assert done.wait(WAIT_S), "an open request was left waiting"
        assert finals["culprit"].finish_reason is FinishReason.ERROR
        assert "RuntimeError while delivering output: sink exploded" in finals["culprit"].error
        assert finals["victim"].finish_reason is FinishReason.LENGTH
        assert len(calls) == 2  # the failing update, then one final error; nothing after
        assert client.alive
        client.add_request(
            "later", [1], SamplingParams(temperature=0.0, max_tokens=2), record("later")
        )
    finally:
        client.close()


# ---------------------------------------------------------------- start-up errors


def broken_checkpoint(tiny, tmp_path, kind: str):
    path = tmp_path / kind
    shutil.copytree(tiny, path)
    if kind == "unknown_model_type":
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
        return path, r".*'llama'.*supported: huginn_raven, nanbeige, ouro"
    (path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{")
    return path, r".*corrupt"


@pytest.mark.parametrize("kind", ["unknown_model_type", "corrupt_safetensors"])
def test_startup_error_is_the_checkpoint_error_every_time(tiny, tmp_path, kind):
    path, expected = broken_checkpoint(tiny, tmp_path, kind)
    for _ in range(2):
        with pytest.raises(StageCheckpointError, match=f"^{expected}") as info:
            bounded(LLM, str(path))
        assert "code None" not in str(info.value)
    # After the worker has exited and the reader has seen the channel close, the client still
    # reports the checkpoint error, not the exit.
    client = StageClient(EngineConfig.from_flat(model=str(path)))
    try:
        with pytest.raises(StageCheckpointError, match=f"^{expected}"):
            client.wait_ready(WAIT_S)
        client._reader.join(WAIT_S)
        with pytest.raises(StageError, match=f"not running: CheckpointError: {expected}"):
            client.add_request("r", [1], SamplingParams(temperature=0.0), lambda update: None)
    finally:
        client.close()


@pytest.mark.parametrize("in_process", [True, False])
def test_a_config_the_loader_refuses_is_a_value_error_in_its_own_words(tmp_path, in_process):
    """vLLM raises a ValueError for a model config it does not support; so does LLM(), with
    the loader's message and no "stage failed: CheckpointError:" in front of it."""
    from rltserve.models.presets import make_model

    path = make_model("nanbeige-tiny", tmp_path / "n")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "skip_loop_final_norm": True}))
    with pytest.raises(ValueError) as info:
        bounded(lambda: LLM(str(path), in_process=in_process))
    assert isinstance(info.value, StageCheckpointError)
    assert str(info.value) == (
        f"{path / 'config.json'}: nanbeige config: skip_loop_final_norm=True: "
        "only False is supported"
    )


def test_worker_that_dies_before_reporting_is_described_by_its_error_output(tiny, monkeypatch):
    from rltserve.core import worker_process

    monkeypatch.setattr(worker_process, "WORKER_MODULE", "rltserve.core.no_such_worker")
    client = StageClient(EngineConfig.from_flat(model=str(tiny)))
    try:
        with pytest.raises(StageError) as info:
            client.wait_ready(WAIT_S)
    finally:
        client.close()
    assert str(info.value) == (
        "stage failed: worker process exited (code 1): ModuleNotFoundError: No module named "
        "'rltserve.core.no_such_worker'"
    )


_STALE_WARNING = (
    "import sys; sys.stderr.write('WARNING stale startup line\\n'); sys.stderr.flush()\n"
)
_HANDLED = (
    "import logging; logging.basicConfig()\n"
    "try:\n    1 / 0\nexcept ZeroDivisionError:\n    logging.exception('handled')\n"
)
_KILLED = "import os; os.kill(os.getpid(), 9)"


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        (_STALE_WARNING + _KILLED, "worker process killed by signal 9"),
        (_HANDLED + _KILLED, "worker process killed by signal 9"),
        (_HANDLED + "raise KeyError('k')", "worker process exited (code 1): KeyError: 'k'"),
        (_STALE_WARNING + "raise RuntimeError('boom\\nmore')",
         "worker process exited (code 1): RuntimeError: boom"),
        (_STALE_WARNING, "worker process exited (code 0)"),
    ],
)  # fmt: skip
def test_a_dead_workers_reason_names_only_the_exception_that_ended_it(script, reason, capfd):
    """Not a stale warning (clients see the reason), nor the traceback of an exception that was
    handled; the whole error output is relayed to this process's stderr (the server's log)."""
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    ours, theirs = Pipe()
    worker = WorkerProcess(proc, ours)
    try:
        assert worker.exit_reason() == reason
    finally:
        worker.close()
        theirs.close()
    relayed = capfd.readouterr().err
    assert ("WARNING stale startup line" in relayed) == ("stale" in script)


# ---------------------------------------------------------------- close


def test_close_ends_a_generate_blocked_on_a_stopped_worker(tiny):
    llm = LLM(str(tiny), num_blocks=1024)
    pid = llm._client.pid
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(out=llm.generate([[1, 2, 3]], LONG)))
    thread.daemon = True
    try:
        thread.start()
        wait_running(llm)
        os.kill(pid, signal.SIGSTOP)
        llm.close(timeout=2.0)
        thread.join(WAIT_S)
        assert not thread.is_alive(), "generate() still blocked after close()"
        assert box["out"][0].finish_reason == "abort"
    finally:
        with_suppressed_lookup(os.kill, pid, signal.SIGKILL)
        llm.close()
    assert_gone(pid)


@pytest.mark.parametrize("client_cls", [StageClient, InProcessStageClient])
def test_request_added_while_closing_is_ended(tiny, client_cls):
    client = client_cls(EngineConfig.from_flat(model=str(tiny), num_blocks=1024))
    client.wait_ready(WAIT_S)
    finals: list = []
    send = client._send

    def close_first(message):  # close() runs between the add's check and its send
        if message[0] == "add":
            client.close()
        send(message)

    client._send = close_first
    try:
        client.add_request("late", [1, 2], LONG, finals.append)
    except StageError:
        pass  # refused outright is fine too; being accepted and never ended is not
    else:
        assert [u.finish_reason for u in finals] == [FinishReason.ABORT]
    with pytest.raises(StageError, match="closed"):
        client.add_request("after", [1, 2], LONG, finals.append)


def test_close_aborts_open_requests_in_process(tiny):
    llm = LLM(str(tiny), num_blocks=1024, in_process=True)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(out=llm.generate([[1, 2, 3]], LONG)))
    thread.daemon = True
    thread.start()
    wait_running(llm)
    llm.close()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert box["out"][0].finish_reason == "abort"


# ---------------------------------------------------------------- signals and leaks


def test_worker_ignores_sigint_and_sigterm(llm):
    pid = llm._client.pid if isinstance(llm._client, StageClient) else None
    if pid is None:
        pytest.skip("no worker process in process")
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    out = bounded(
        llm.generate, [[5, 6]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    assert len(out[0].token_ids) == 3


def test_unreferenced_llm_stops_its_worker(tiny):
    llm = LLM(str(tiny), num_blocks=64)
    bounded(llm.generate, [[1, 2]], SamplingParams(temperature=0.0, max_tokens=2))
    pid = llm._client.pid
    del llm
    gc.collect()
    assert_gone(pid)


def test_unreferenced_in_process_llm_stops_its_loop(tiny):
    llm = LLM(str(tiny), num_blocks=64, in_process=True)
    bounded(llm.generate, [[1, 2]], SamplingParams(temperature=0.0, max_tokens=2))
    thread = llm._client._thread
    del llm  # (no cycle holds it: collected at once)
    # The finalizer waits for the loop (~40 ms to tear down): at interpreter exit a loop thread
    # still running would be stopped mid-teardown and the process abort ("terminate called
    # without an active exception").
    assert not thread.is_alive()


def test_bad_prompt_at_index_k_submits_nothing(llm):
    with pytest.raises(ValueError, match="token ids must be ints"):
        llm.generate([[1, 2, 3], [4, 5, 6], [1.5]], LONG)
    assert_idle(llm)


def test_stage_error_part_way_aborts_what_was_submitted(llm, monkeypatch):
    add = llm._client.add_request
    calls = []

    def failing_third(*args):
        calls.append(args[0])
        if len(calls) == 3:
            raise StageError("stage is not running: injected")
        add(*args)

    monkeypatch.setattr(llm._client, "add_request", failing_third)
    with pytest.raises(StageError, match="injected"):
        bounded(llm.generate, [[1, 2, 3], [4, 5, 6], [7, 8]], LONG)
    monkeypatch.undo()
    assert_idle(llm)


def test_rejection_part_way_aborts_the_others_at_once(llm):
    with pytest.raises(ValueError, match="maximum context length of 2048 tokens"):
        bounded(llm.generate, [[1, 2, 3], [4, 5, 6], [7] * 2049], LONG)
    assert_idle(llm)


def wait_running(llm: LLM) -> None:
    event = threading.Event()
    for _ in range(WAIT_S * 100):
        stats = llm._client.stats
        if stats is not None and stats.num_running:
            return
        event.wait(0.01)
    pytest.fail("the request never started running")


def with_suppressed_lookup(fn, *args) -> None:
    with contextlib.suppress(ProcessLookupError):
        fn(*args)


@pytest.mark.parametrize("level", [logging.WARNING, logging.ERROR, 15])  # (15: no name)
def test_the_worker_logs_as_the_parent_set_up_logging(tiny, capfd, level):
    """The server's --log-level and format reach its stage worker (its warnings printed bare
    and ignored the level); a process that set up no logging leaves the worker as it was."""
    from rltserve.core import worker_process

    root = logging.getLogger()
    handler = logging.StreamHandler()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(level)
    try:
        assert worker_process._log_args() == ["--log-level", str(level)]
        client = StageClient(EngineConfig.from_flat(model=str(tiny), num_blocks=16))
        try:
            client.wait_ready(WAIT_S)
        finally:
            client.close()
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    err = capfd.readouterr().err
    lowered = [line for line in err.splitlines() if "max_model_len lowered" in line]
    if level == logging.ERROR:
        assert lowered == []
    else:
        [line] = lowered
        assert " WARNING rltserve." in line  # (the server's format: time, level, logger)


def test_the_worker_logs_through_the_servers_log_config_file(tiny, capfd, tmp_path, monkeypatch):
    """With ``--log-config-file`` the worker loads the same dictConfig file (its engine
    warnings as JSON lines, say, as the server's), not ``--log-level``'s plain format."""
    from rltserve.core import worker_process

    path = tmp_path / "logging.json"
    fmt = '{"level": "%(levelname)s", "logger": "%(name)s", "message": "%(message)s"}'
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "formatters": {"json": {"format": fmt}},
                "handlers": {
                    "err": {
                        "class": "logging.StreamHandler",
                        "formatter": "json",
                        "stream": "ext://sys.stderr",
                    }
                },
                "root": {"level": "INFO", "handlers": ["err"]},
            }
        )
    )
    monkeypatch.setenv(worker_process.LOG_CONFIG_ENV, "")  # (restored after)
    monkeypatch.chdir(tmp_path)
    worker_process.set_log_config_file("logging.json")  # (relative: the worker gets it whole)
    assert worker_process._log_args() == ["--log-config-file", str(path)]
    client = StageClient(EngineConfig.from_flat(model=str(tiny), num_blocks=16))
    try:
        client.wait_ready(WAIT_S)
    finally:
        client.close()
    err = capfd.readouterr().err
    [line] = [line for line in err.splitlines() if "max_model_len lowered" in line]
    record = json.loads(line)
    assert record["level"] == "WARNING" and record["logger"].startswith("rltserve.")
