"""The bound on a disaggregated engine's transfer files (``core/transfer_files.py``,
``kv_transfer_gb``): a transfer past it is not made and the decode stage computes that prompt
(same tokens), ``kv_transfer_skipped`` counts it, and every file's bytes come back whichever way
its request ends (read by the decode stage, aborted while it waits there, a dead decode stage).
Also the stage names of the "max_model_len lowered" warning."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
from engine_util import oracle_run, stream_all, wait_pd_idle
from test_pd import BS, GREEDY, _client, _collect, _moved

from rltserve.config import EngineConfig
from rltserve.core.stage import InProcessStageClient, StageClient
from rltserve.core.transfer_files import TransferFiles, transfer_size
from rltserve.sampling import SamplingParams
from rltserve.updates import FinishReason

LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)


def _files(client) -> list[str]:
    return sorted(set(os.listdir(client._files.dir)) - {"owner.lock"})


def _wait(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _settled(client) -> None:
    """Idle, no file left and no byte held."""
    wait_pd_idle(client)
    assert client._files.held_bytes == 0 and not client._files._held


def test_the_bound_is_a_config_field_for_disaggregation_only():
    config = EngineConfig.from_flat(disaggregate=True, kv_transfer_gb=0.5)
    assert config.execution.kv_transfer_gb == 0.5
    with pytest.raises(ValueError, match="kv_transfer_gb=1: only with disaggregate=True"):
        EngineConfig.from_flat(kv_transfer_gb=1)
    for bad in (-1, True, "1", float("inf"), float("nan")):  # (inf: OverflowError at start)
        with pytest.raises(ValueError, match="must be None or a finite number >= 0"):
            EngineConfig.from_flat(disaggregate=True, kv_transfer_gb=bad)


def test_claims_past_the_limit_are_skipped_and_released_bytes_come_back(tmp_path, monkeypatch):
    monkeypatch.setattr("rltserve.core.transfer_dir.file_dir", lambda: str(tmp_path))
    files = TransferFiles(100 / 2**30)
    try:
        assert files.limit == 100
        first = files.claim(60, 8)
        assert first is not None and files.claim(60, 8) is None and files.skipped_tokens == 8
        Path(first).write_bytes(b"x" * 30)  # written: its real size is held from now on
        files.settle(first)
        second = files.claim(60, 8)
        assert files.held_bytes == 90 and second is not None
        files.release(first)
        files.release(first)  # (once only)
        assert not Path(first).exists() and files.held_bytes == 60
        files.release(second)  # (never written: nothing to delete, its bytes still come back)
        assert files.held_bytes == 0 and not files._held
    finally:
        files.close()
    default = TransferFiles(None)
    try:  # (half the directory's free space)
        assert 0 < default.limit <= shutil.disk_usage(default.dir).free
    finally:
        default.close()


def test_no_room_computes_every_prompt_on_the_decode_stage(ckpts, ouro_ref):
    prompts = [list(range(10, 40)), list(range(50, 71)), [3, 4]]
    params = [GREEDY] * 3
    client = _client(ckpts["ouro"], kv_transfer_gb=0)
    try:
        run = stream_all(client, prompts, params)
        for i, prompt in enumerate(prompts):
            want = oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited").tokens
            assert run.tokens[f"r{i}"] == want
        _settled(client)
        stats = client.stats
        assert stats.kv_transfer_hits == 0 and stats.kv_transfer_skipped == _moved(prompts[:2])
        assert client.prefill.stats is None or client.prefill.stats.num_steps == 0
    finally:
        client.close()


def test_a_transfer_past_the_bound_is_skipped_while_another_file_waits(
    ckpts, ouro_ref, monkeypatch
):
    """Room for one file: while the first request's file waits for the decode stage, a second
    long prompt is computed there instead; once the first is read, its bytes come back."""
    a, b = list(range(10, 40)), list(range(100, 130))
    probe = _client(ckpts["ouro"])
    try:
        size, _ = transfer_size(probe.info, a, GREEDY)
    finally:
        probe.close()
    assert size > 0
    client = _client(ckpts["ouro"], kv_transfer_gb=size * 1.5 / 2**30)
    try:
        held = []
        real_add = client.decode.add_request

        def holds_a(request_id, *args):  # the decode stage has not taken "a" yet
            if request_id == "a":
                held.append((request_id, *args))
            else:
                real_add(request_id, *args)

        monkeypatch.setattr(client.decode, "add_request", holds_a)
        updates, ended, sink = _collect()
        client.add_request("a", a, GREEDY, sink)
        _wait(lambda: held)
        assert len(_files(client)) == 1 and client._files.held_bytes > size  # (its real size)
        client.add_request("b", b, GREEDY, sink)
        _wait(lambda: updates.get("b") and updates["b"][-1].finish_reason)
        assert client._files.skipped_tokens == (len(b) - 1) // BS * BS
        real_add(*held[0])
        _wait(lambda: updates.get("a") and updates["a"][-1].finish_reason)
        for rid, prompt in (("a", a), ("b", b)):
            want = oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited").tokens
            assert [t for u in updates[rid] for t in u.new_token_ids] == want
        _settled(client)
        stats = client.stats
        assert stats.kv_transfer_hits == (len(a) - 1) // BS * BS
        assert stats.kv_transfer_skipped == (len(b) - 1) // BS * BS
    finally:
        client.close()


def test_a_file_waiting_on_the_decode_stage_goes_with_its_aborted_request(ckpts):
    """One seat on the decode stage, taken: the moved request waits there with its file; a
    client's abort (a disconnect) deletes it and gives its bytes back."""
    client = _client(ckpts["ouro"], max_num_seqs=1)
    try:
        updates, ended, sink = _collect()
        client.add_request("busy", [5, 6, 7], LONG, sink)  # (no full block: decode directly)
        _wait(lambda: updates.get("busy"))
        client.add_request("q", list(range(10, 40)), GREEDY, sink)
        _wait(lambda: "q" not in client._open and not client._moving)
        assert len(_files(client)) == 1 and client._files.held_bytes > 0
        client.abort("q")
        _wait(lambda: updates.get("q") and updates["q"][-1].finish_reason)
        assert updates["q"][-1].finish_reason is FinishReason.ABORT
        assert not _files(client) and client._files.held_bytes == 0
        client.abort("busy")
        _settled(client)
    finally:
        client.close()
    assert not Path(client._files.dir).exists()


def test_a_dead_decode_stage_leaves_no_file(ckpts):
    client = _client(ckpts["ouro"], cls=StageClient, max_num_seqs=1)
    try:
        updates, ended, sink = _collect()
        client.add_request("busy", [5, 6, 7], LONG, sink)
        _wait(lambda: updates.get("busy"))
        client.add_request("q", list(range(10, 40)), GREEDY, sink)
        _wait(lambda: "q" not in client._open and not client._moving)
        assert len(_files(client)) == 1
        client.decode.kill()
        _wait(lambda: all(updates[r][-1].finish_reason for r in ("busy", "q")))
        assert updates["q"][-1].finish_reason is FinishReason.ERROR
        assert not _files(client) and client._files.held_bytes == 0
    finally:
        client.kill()
        client.close(timeout=5)
    assert not Path(client._files.dir).exists()


def test_the_lowered_context_warning_names_the_stage(ckpts, caplog):
    config = EngineConfig.from_flat(model=str(ckpts["ouro"]), num_blocks=8, block_size=BS)
    with caplog.at_level(logging.WARNING, logger="rltserve.core.kv_sizing"):
        client = InProcessStageClient(config, role="prefill")
        try:
            client.wait_ready(120)
        finally:
            client.close()
    lowered = [r.getMessage() for r in caplog.records if "max_model_len lowered" in r.getMessage()]
    assert lowered and all(m.startswith("prefill stage: max_model_len lowered") for m in lowered)


def test_the_start_up_log_gives_the_bound_and_a_fallback_to_disk(monkeypatch, caplog):
    """A container's /dev/shm is 64 MiB unless the operator mounts a larger one: the files then
    go to disk, which the log says, with what to change."""
    from rltserve.core import transfer_dir

    caplog.set_level(logging.INFO, logger="rltserve.core.transfer_files")
    monkeypatch.setattr(transfer_dir, "shm_free", lambda: 64 * 2**20)
    files = TransferFiles(0.5)
    try:
        info, warning = (r.getMessage() for r in caplog.records)
        assert info == f"KV transfer files: at most 0.50 GiB in {files.dir} (--kv-transfer-gb)"
        assert warning.startswith("KV transfer files go to ") and "(disk), not /dev/shm" in warning
        assert "64 MiB free" in warning and "--shm-size" in warning and "medium: Memory" in warning
    finally:
        files.close()
    caplog.clear()
    TransferFiles(0).close()  # (--kv-transfer-gb 0 writes no file: no disk to warn of)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    caplog.clear()
    monkeypatch.setattr(transfer_dir, "file_dir", lambda: None)
    files = TransferFiles(None)
    try:
        assert (
            caplog.records[0].getMessage().endswith("(--kv-transfer-gb: half the space free there)")
        )
    finally:
        files.close()
    # (in shared memory, or on a host without any: nothing to warn of)
    assert transfer_dir.fallback_warning("/dev/shm/rltserve-pd-x") is None
    monkeypatch.setattr(transfer_dir, "shm_free", lambda: None)
    assert transfer_dir.fallback_warning("/tmp/rltserve-pd-x") is None
