"""Prefill/decode disaggregation's commands on both stages (``core/pd.py``): weight updates
(the decode stage first; a failed one changes nothing, one the prefill stage fails to load
stops transfers; the prefill stage aborts its prefills, which move on unless the update aborts),
sleep (a failed one wakes the stage that slept), the watchdog's view of stats, and the ``LLM``
front end's commands reaching both stages."""

from __future__ import annotations

import pytest
from engine_util import decode_took, stream_all
from test_pd import BS, GREEDY, _client

from rltserve.config import EngineConfig
from rltserve.core.engine_info import EngineStats
from rltserve.core.pd import PDClient, _Handoff
from rltserve.llm import LLM
from rltserve.sampling import SamplingParams


def test_a_failed_update_changes_nothing_and_a_half_applied_one_stops_transfers(
    ckpts, monkeypatch, caplog
):
    from rltserve.updates import UpdateTimeout

    client = _client(ckpts["ouro"])
    prompt = list(range(10, 40))
    try:
        real = client.decode.update_weights

        def times_out(*args):
            raise UpdateTimeout("timeout: requests still running")

        # The decode stage goes first: when it fails nothing is applied, and KV still moves.
        monkeypatch.setattr(client.decode, "update_weights", times_out)
        with pytest.raises(UpdateTimeout):
            client.update_weights([str(ckpts["ouro"])], False, 1.0)
        assert (client.prefill.weight_version, client.decode.weight_version) == (0, 0)
        stream_all(client, [prompt], [GREEDY])
        assert decode_took(client) == 28
        monkeypatch.setattr(client.decode, "update_weights", real)
        assert client.update_weights([str(ckpts["ouro"])], False, 10.0) == 1
        assert client.prefill.weight_version == 1
        stream_all(client, [prompt], [GREEDY])
        assert decode_took(client) == 28 + 28  # (a new version: moved again)

        def fails(*args):
            raise ValueError("cannot load")

        # Applied where the outputs come from; the prefill stage, left behind, moves no KV.
        monkeypatch.setattr(client.prefill, "update_weights", fails)
        assert client.update_weights([str(ckpts["ouro"])], False, 10.0) == 2
        assert "applied on the decode stage only" in caplog.text
        stream_all(client, [list(range(50, 80))], [GREEDY])
        assert decode_took(client) == 56
        assert client.decode.stats.num_steps > 0
    finally:
        client.close()


def test_a_failed_sleep_wakes_the_stage_that_slept(ckpts, monkeypatch):
    client = _client(ckpts["ouro"])
    try:

        def times_out(*args):
            raise ValueError("timeout: requests still running")

        monkeypatch.setattr(client.decode, "sleep", times_out)
        with pytest.raises(ValueError, match="timeout"):
            client.sleep(1, 1.0)
        assert not client.sleeping and not client.prefill.sleeping
        stream_all(client, [list(range(10, 40))], [GREEDY])
    finally:
        client.close()


class _FakeStage:
    """What ``PDClient.stats`` and its commands use of a stage client, calls recorded."""

    calls: list = []

    def __init__(self, config, role=None) -> None:
        self.stats = None
        self.alive = True
        self.error = None
        self.weight_version = 0

    def update_weights(self, paths, abort, timeout_s) -> int:
        _FakeStage.calls.append(("update", id(self), abort))
        self.weight_version += 1
        return self.weight_version

    def close(self, timeout=None) -> None:
        pass


def test_an_update_goes_to_the_decode_stage_first():
    """There a timeout is likely (it then leaves both stages as they were), and requests added
    meanwhile wait for the update instead of being aborted by it. The prefill stage never
    waits: it aborts its prefills, which move on to the decode stage unless the update aborts
    running requests."""
    client = PDClient(EngineConfig.from_flat(disaggregate=True), _FakeStage)
    try:
        for abort in (False, True):
            _FakeStage.calls = []
            handoff = client._open["x"] = _Handoff([1], GREEDY, print, None, "f")
            assert client.update_weights(["dir"], abort, 1.0) == (2 if abort else 1)
            calls = [(who, aborts) for _, who, aborts in _FakeStage.calls]
            assert calls == [(id(client.decode), abort), (id(client.prefill), True)]
            assert handoff.reroute is not abort
            del client._open["x"]
        assert client._in_sync
    finally:
        client.close()


def _stats(running: int, steps: int) -> EngineStats:
    return EngineStats(running, 0, 0.0, steps, 0, 0, 0.0)


def test_stats_show_progress_only_once_every_busy_stage_moved():
    """The server's watchdog reads a new stats object as progress: a decode stage stuck with
    requests while the prefill stage keeps stepping must not look alive."""
    client = PDClient(EngineConfig.from_flat(disaggregate=True), _FakeStage)
    try:
        client.decode.stats = _stats(running=2, steps=1)
        first = client.stats
        assert first.num_running == 2
        client.prefill.stats = _stats(running=1, steps=1)  # the prefill stage moves
        client._open["p"] = None  # (one request in its prefill)
        assert client.stats is first  # the busy decode stage did not
        client.decode.stats = _stats(running=2, steps=2)
        second = client.stats
        assert second is not first and second.num_waiting == 1  # in their prefill: waiting
        client.prefill.stats = _stats(running=1, steps=2)
        client.decode.stats = _stats(running=0, steps=3)  # idle now
        third = client.stats
        client._open.clear()
        client.prefill.stats = _stats(running=0, steps=3)
        assert client.stats is not third  # an idle decode stage does not hold progress back
    finally:
        client.close()


def test_stats_show_no_progress_while_a_decode_stage_that_hung_idle_holds_requests():
    """A decode stage that hung while idle sends no stats again: its last ones say it has no
    request, yet the client handed it some (straight, or after their prefill). The prefill
    stage stepping on through a burst must not keep the watchdog from noticing."""
    client = PDClient(EngineConfig.from_flat(disaggregate=True), _FakeStage)
    try:
        client.prefill.stats = _stats(running=1, steps=1)
        client.decode.stats = _stats(running=0, steps=1)  # its last stats: idle
        first = client.stats
        client._ids.update({"moved", "p"})  # one on the decode stage, one in its prefill
        client._open["p"] = None
        client.prefill.stats = _stats(running=1, steps=2)
        assert client.stats is first
        assert client.stalled_stage() == "decode"
        client.decode.stats = _stats(running=1, steps=2)
        assert client.stats is not first
    finally:
        client.close()


def test_llm_sleep_update_and_reset_reach_both_stages(tiny, tmp_path):
    from rltserve.models.presets import make_model

    other = make_model("ouro-tiny", tmp_path / "other", seed=5)
    prompts = ["a prompt long enough to fill a few KV blocks of four tokens"] * 2
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    with LLM(str(other), in_process=True, num_blocks=128, block_size=BS) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts[:1], greedy)]
    with LLM(str(tiny), in_process=True, num_blocks=128, block_size=BS, disaggregate=True) as llm:
        before = llm.generate(prompts[:1], greedy)[0]
        # Moved from the prefill stage, which computed it: no cached tokens.
        assert before.num_cached_tokens == 0 and llm._client.decode.stats.kv_transfer_hits > 0
        assert llm.update_weights(other) == 1
        assert llm._client.prefill.weight_version == 1
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], greedy)] == expected
        llm.sleep(level=1)
        assert llm.is_sleeping() and llm._client.prefill.sleeping
        llm.wake_up()
        assert not llm.is_sleeping()
        llm.reset_prefix_cache()
        after = llm.generate(prompts[:1], greedy)[0]
        assert after.outputs[0].token_ids == expected[0] and after.num_cached_tokens == 0


def test_cached_tokens_count_reuse_not_moved_blocks(tiny):
    """The decode stage finds a moved prompt's blocks in its prefix cache, but the prefill
    stage computed them: on a cold server two distinct prompts report no cached tokens and a
    repeat reports what the prefill stage reused, as one stage reports for the same requests,
    and so do the prefix-cache counters (the moved tokens count in ``kv_transfer_hits``)."""
    from engine_util import wait_pd_idle

    a = [(7 * i) % 500 + 3 for i in range(41)]  # 10 full blocks before the last token
    b = [(13 * i + 5) % 500 + 3 for i in range(41)]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    seen = []
    for disaggregate in (False, True):
        kw = {"num_blocks": 256, "block_size": BS, "disaggregate": disaggregate}
        with LLM(str(tiny), in_process=True, **kw) as llm:
            outs = [llm.generate([{"prompt_token_ids": p}], greedy)[0] for p in (a, b, a)]
            if disaggregate:
                wait_pd_idle(llm._client)  # (the stats of the last steps)
            stats = llm._client.stats
            seen.append(
                (
                    [o.num_cached_tokens for o in outs],
                    [o.outputs[0].token_ids for o in outs],
                    (stats.prefix_cache_queries, stats.prefix_cache_hits),
                )
            )
            moved = stats.kv_transfer_hits
    assert seen[0][0] == [0, 0, 40]
    assert seen[1] == seen[0]
    assert seen[0][2] == (3 * 41, 40)
    assert moved == 2 * 40  # the cold prompts' blocks; the repeat's were reused


def test_a_sweep_removes_only_transfer_directories(tmp_path):
    """Another program's directory with a free ``owner.lock`` is not a transfer directory."""
    from rltserve.core import transfer_dir

    for name in ("rltserve-pd-dead", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "owner.lock").write_bytes(b"")
    transfer_dir.sweep(str(tmp_path))
    assert not (tmp_path / "rltserve-pd-dead").exists() and (tmp_path / "other").exists()


def test_a_dead_process_transfer_directory_is_swept(tmp_path, monkeypatch):
    """A process killed before its cleanup leaves its transfer directory (in shared memory):
    the next client removes those whose owner lock is free, and no other."""
    import fcntl
    import os

    from rltserve.core import transfer_dir

    dead, alive, unlocked = (tmp_path / f"rltserve-pd-{n}" for n in ("dead", "alive", "new"))
    for d in (dead, alive, unlocked):
        d.mkdir()
        (d / "0.safetensors").write_bytes(b"x")
    (dead / "owner.lock").write_bytes(b"")
    (alive / "owner.lock").write_bytes(b"")
    holder = os.open(alive / "owner.lock", os.O_RDWR)  # (its owner, alive)
    fcntl.flock(holder, fcntl.LOCK_EX)
    monkeypatch.setattr(transfer_dir, "file_dir", lambda: str(tmp_path))
    try:
        client = PDClient(EngineConfig.from_flat(disaggregate=True), _FakeStage)
        try:
            assert not dead.exists() and alive.exists() and unlocked.exists()
            mine = client._files.dir
            assert os.path.exists(os.path.join(mine, "owner.lock"))
            other = PDClient(EngineConfig.from_flat(disaggregate=True), _FakeStage)
            other.close()
            assert os.path.exists(mine)  # (a live client's directory survives a sweep)
        finally:
            client.close()
        assert not os.path.exists(mine)
    finally:
        os.close(holder)


def test_no_kv_moves_while_an_update_waits_nor_after_a_failed_deep_sleep(ckpts, monkeypatch):
    """A request added while the decode stage waits to apply an update goes to it directly (its
    prompt is computed under the weights it will decode with), as does one after a level-2
    sleep that failed on the decode stage (the prefill stage's weights are to be loaded again),
    until an update succeeds on both stages."""
    client = _client(ckpts["ouro"])
    prompt = list(range(10, 40))
    prefills = []
    real_add = client.prefill.add_request
    monkeypatch.setattr(
        client.prefill, "add_request", lambda *a: prefills.append(a[0]) or real_add(*a)
    )
    try:
        real_update = client.decode.update_weights

        def adding_meanwhile(*args):
            stream_all(client, [prompt], [GREEDY])
            return real_update(*args)

        monkeypatch.setattr(client.decode, "update_weights", adding_meanwhile)
        assert client.update_weights([str(ckpts["ouro"])], False, 10.0) == 1
        assert prefills == []
        monkeypatch.setattr(client.decode, "update_weights", real_update)
        stream_all(client, [prompt], [GREEDY])
        assert prefills == ["r0"]

        def times_out(*args):
            raise ValueError("timeout: requests still running")

        real_sleep = client.decode.sleep
        monkeypatch.setattr(client.decode, "sleep", times_out)
        with pytest.raises(ValueError, match="timeout"):
            client.sleep(2, 1.0)
        monkeypatch.setattr(client.decode, "sleep", real_sleep)
        stream_all(client, [prompt], [GREEDY])
        assert prefills == ["r0"]
        assert client.update_weights([str(ckpts["ouro"])], False, 10.0) == 2
        stream_all(client, [prompt], [GREEDY])
        assert prefills == ["r0", "r0"]
    finally:
        client.close()


def test_stats_count_samples_waiting_for_their_groups_prefill_as_waiting():
    client = PDClient(EngineConfig.from_flat(disaggregate=True), _FakeStage)
    try:
        client.prefill.stats = _stats(running=1, steps=1)
        client.decode.stats = _stats(running=2, steps=1)
        client._open["p"] = None
        client._following["f1"] = client._following["f2"] = None
        stats = client.stats
        assert (stats.num_running, stats.num_waiting) == (2, 3)
    finally:
        client.close()


def test_transfer_files_go_to_shared_memory_only_where_it_holds_a_gigabyte(monkeypatch):
    import shutil
    from collections import namedtuple

    from rltserve.core import transfer_dir

    usage = namedtuple("usage", "total used free")
    for free, where in ((1 << 30, "/dev/shm"), ((1 << 30) - 1, None)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(0, 0, free))
        assert transfer_dir.file_dir() == where

    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(shutil, "disk_usage", missing)
    assert transfer_dir.file_dir() is None


def test_reset_prefix_cache_empties_the_prefill_stages_cache_too(ckpts):
    from engine_util import wait_pd_idle

    client = _client(ckpts["ouro"])
    prompt = list(range(10, 40))
    try:
        for _ in range(2):  # the second prefill finds the first's blocks on its own stage
            stream_all(client, [prompt], [GREEDY])
            wait_pd_idle(client)
        assert client.prefill.stats.prefix_cache_hits == 28
        client.reset_prefix_cache()
        stream_all(client, [prompt], [GREEDY])
        wait_pd_idle(client)
        assert client.prefill.stats.prefix_cache_hits == 28  # computed again
        assert decode_took(client) == 3 * 28  # (moved each time)
        # Only the second request's prompt was reused (found on the prefill stage).
        assert client.decode.stats.prefix_cache_hits == 28
    finally:
        client.close()


def test_stats_show_no_progress_while_a_busy_prefill_stage_is_stuck():
    client = PDClient(EngineConfig.from_flat(disaggregate=True), _FakeStage)
    try:
        client.prefill.stats = _stats(running=1, steps=1)
        client.decode.stats = _stats(running=1, steps=1)
        first = client.stats
        client._open["p"] = None  # (a request in its prefill, whose stage no longer steps)
        client.decode.stats = _stats(running=1, steps=2)
        assert client.stats is first
        client.prefill.stats = _stats(running=1, steps=2)
        assert client.stats is not first
    finally:
        client.close()


def test_a_closed_client_is_not_alive_and_refuses_requests():
    """(The stages here stay alive: the client's own flag decides.)"""
    from rltserve.core.stage import StageError

    client = PDClient(EngineConfig.from_flat(disaggregate=True), _FakeStage)
    assert client.alive and client.error is None
    client.close()
    assert not client.alive and client.error == "closed"
    with pytest.raises(StageError, match="stage is not running: closed"):
        client.add_request("x", [1, 2], GREEDY, print)
