"""Prefill/decode disaggregation when things go wrong (``core/pd.py``): aborts during prefill,
during a move and of waiting samples, a failed group leader, refused requests, a dead prefill
stage, a failed hand-over and closing mid-prefill end each request once, as with one stage, and
leave no blocks or files behind. Modes and the oracle: ``test_pd.py``."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from engine_util import decode_took, oracle_run, stream_all, wait_pd_idle
from test_pd import GREEDY, _client, _collect

from rltserve.core import pd_prefill
from rltserve.core.pd import _Handoff
from rltserve.core.stage import StageClient, StageError
from rltserve.sampling import SamplingParams
from rltserve.updates import FinishReason, RequestUpdate


def test_abort_during_prefill_and_during_decode(ckpts):
    client = _client(ckpts["ouro"], async_scheduling=True, exit_mode="delayed")
    try:
        long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        updates, ended, sink = _collect()
        client.add_request("a", list(range(10, 60)), long, sink)
        client.abort("a")  # still on the prefill stage (or just handed over)
        assert ended.wait(60)
        assert updates["a"][-1].finish_reason is FinishReason.ABORT
        updates, ended, sink = _collect()
        client.add_request("b", list(range(10, 60)), long, sink)
        while not any(u.new_token_ids for u in updates.get("b", [])):
            assert not ended.wait(0.01)
        client.abort("b")  # decoding
        assert ended.wait(60)
        assert updates["b"][-1].finish_reason is FinishReason.ABORT
        wait_pd_idle(client)
    finally:
        client.close()
    assert not Path(client._files.dir).exists()


def test_a_waiting_sample_aborts_alone_and_a_rerouted_prefill_is_served(
    ckpts, ouro_ref, monkeypatch
):
    client = _client(ckpts["ouro"])
    prompt = list(range(10, 40))
    try:
        updates, ended, sink = _collect()
        held = []  # the first sample's prefill, held back: the others wait for it
        real_add = client.prefill.add_request
        monkeypatch.setattr(client.prefill, "add_request", lambda *a: held.append(a))
        for rid in ("a", "b", "c"):
            client.add_request(rid, prompt, GREEDY, sink, group="g")
        assert len(held) == 1 and set(client._following) == {"b", "c"}
        client.abort("b")
        real_add(*held[0])
        assert updates["b"][-1].finish_reason is FinishReason.ABORT and "b" not in client._ids
        while len([r for r in ("a", "c") if updates.get(r) and updates[r][-1].finish_reason]) < 2:
            time.sleep(0.01)
        want = oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited").tokens
        for rid in ("a", "c"):
            assert [t for u in updates[rid] for t in u.new_token_ids] == want
        # A prefill a weight update aborted (one that does not abort running requests): the
        # decode stage computes its prompt and serves it.
        updates, ended, sink = _collect()
        client._open["d"] = _Handoff(prompt, GREEDY, client._ending("d", sink), None, "f")
        client._open["d"].reroute = True
        client._ids.add("d")
        client._prefilled("d", RequestUpdate("d", finish_reason=FinishReason.ABORT))
        assert ended.wait(60)
        assert [t for u in updates["d"] for t in u.new_token_ids] == want
        wait_pd_idle(client)
    finally:
        client.close()


def test_followers_of_a_failed_leader_and_an_abort_during_a_move(ckpts, ouro_ref, monkeypatch):
    client = _client(ckpts["ouro"])
    prompt = list(range(10, 40))
    want = oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited").tokens
    try:
        updates, ended, sink = _collect()

        def joins_then_fails(*args):  # a sample joins the leader, whose prefill then fails
            client.add_request("b", prompt, GREEDY, sink, group="g")
            raise RuntimeError("prefill stage gone")

        monkeypatch.setattr(client.prefill, "add_request", joins_then_fails)
        with pytest.raises(RuntimeError):
            client.add_request("a", prompt, GREEDY, sink, group="g")
        while not (updates.get("b") and updates["b"][-1].finish_reason):
            time.sleep(0.01)
        assert [t for u in updates["b"] for t in u.new_token_ids] == want  # (served, alone)
        assert not client._following and "a" not in client._ids
        # An abort that arrives while a request is being added to the decode stage.
        updates, ended, sink = _collect()
        real_add = client.decode.add_request

        def aborted_meanwhile(request_id, *args):
            client.abort(request_id)
            real_add(request_id, *args)

        monkeypatch.setattr(client.decode, "add_request", aborted_meanwhile)
        client._open["c"] = _Handoff(prompt, GREEDY, client._ending("c", sink), None, "f")
        client._ids.add("c")
        client._prefilled("c", RequestUpdate("c", finish_reason=FinishReason.LENGTH))
        assert ended.wait(60) and updates["c"][-1].finish_reason is FinishReason.ABORT
        wait_pd_idle(client)
    finally:
        client.close()


def test_bad_requests_are_refused_as_by_one_stage(ckpts, monkeypatch):
    client = _client(ckpts["ouro"], max_model_len=64)
    prefills = []
    real_add = client.prefill.add_request
    monkeypatch.setattr(
        client.prefill, "add_request", lambda *a: prefills.append(a[0]) or real_add(*a)
    )
    try:
        updates, ended, sink = _collect()
        refused = SamplingParams(temperature=0.0, logprobs=50)  # the decode stage refuses
        client.add_request("x", list(range(10, 40)), refused, sink)
        assert ended.wait(60)
        last = updates["x"][-1]
        assert last.finish_reason is FinishReason.ERROR and "logprobs" in last.error
        assert last.rejected
        updates, ended, sink = _collect()
        client.add_request("y", [1] * 70, SamplingParams(max_tokens=1), sink)
        assert ended.wait(60)
        assert updates["y"][-1].finish_reason is FinishReason.ERROR and updates["y"][-1].rejected
        updates, ended, sink = _collect()
        client.add_request("z", list(range(10, 40)), SamplingParams(min_loops=7), sink)
        assert ended.wait(60)
        assert updates["z"][-1].error.startswith("min_loops=7: above the 4 loops")
        assert prefills == []  # none of them ran a prefill first
        wait_pd_idle(client)
    finally:
        client.close()


def _ended(updates, rids) -> bool:
    return all(updates.get(r) and updates[r][-1].finish_reason for r in rids)


def test_a_dead_prefill_stage_fails_nothing_and_is_started_again(ckpts, ouro_ref, monkeypatch):
    """Killed under requests (in their prefill, decoding, decode-only; greedy and seeded): each
    is served as by one stage (without a file, the decode stage computes the prompt); the
    client stays alive, starts the prefill stage again (its worker named on its command line)
    and moves KV again."""
    monkeypatch.setattr(pd_prefill, "RESTARTS", replace(pd_prefill.RESTARTS, backoff_s=0.05))
    client = _client(ckpts["ouro"], cls=StageClient)
    try:
        old = client.prefill
        assert "--role prefill" in _cmdline(old.pid)
        assert "--role decode" in _cmdline(client.decode.pid)
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        seeded = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=5)
        runs = {
            "k": (list(range(10, 90)), long),
            "s": (list(range(20, 70)), seeded),
            "d": ([5, 6, 7], long),  # no full block: straight to the decode stage
        }
        updates, ended, sink = _collect()
        for rid, (prompt, params) in runs.items():
            client.add_request(rid, prompt, params, sink)
        old.kill()
        deadline = time.monotonic() + 120  # (hang guard)
        while not _ended(updates, runs):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for rid in runs:
            assert updates[rid][-1].finish_reason is FinishReason.LENGTH, rid
        for rid in ("k", "d"):
            want = oracle_run(ouro_ref, runs[rid][0], long, kv_policy="last_exited").tokens
            assert [t for u in updates[rid] for t in u.new_token_ids] == want, rid
        assert client.alive and client.error is None
        while client.prefill is old or client.prefill_down is not None:
            assert time.monotonic() < deadline, client.prefill_down
            time.sleep(0.05)
        assert "--role prefill" in _cmdline(client.prefill.pid)
        prompt = list(range(100, 130))
        run = stream_all(client, [prompt], [GREEDY])
        assert (
            run.tokens["r0"] == oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited").tokens
        )
        assert decode_took(client) > 0  # the restarted stage moved the prompt's blocks
        # The seeded request again, its prompt moved as by an intact pair (one stage's output:
        # test_pd.py): the same tokens.
        again = stream_all(client, [runs["s"][0]], [seeded])
        assert [t for u in updates["s"] for t in u.new_token_ids] == again.tokens["r0"]
        wait_pd_idle(client)
    finally:
        client.kill()
        client.close(timeout=5)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_a_prefill_stage_that_cannot_come_back_leaves_the_decode_stage_serving(
    ckpts, ouro_ref, monkeypatch, caplog
):
    monkeypatch.setattr(pd_prefill, "RESTARTS", replace(pd_prefill.RESTARTS, backoff_s=0.0))
    client = _client(ckpts["ouro"])
    try:
        dead = client.prefill

        def cannot_start():
            raise StageError("no device left")

        client._prefill._start = cannot_start
        dead._die("injected")
        deadline = time.monotonic() + 60  # (hang guard)
        while not (client.prefill_down or "").startswith("not restarted after 3 attempt(s)"):
            assert time.monotonic() < deadline, client.prefill_down
            time.sleep(0.02)
        assert "giving up on the prefill stage" in caplog.text
        assert client.alive
        client.reset_prefix_cache()  # (the commands skip the missing stage)
        prompt = list(range(10, 40))
        run = stream_all(client, [prompt], [GREEDY])  # to the decode stage directly
        assert (
            run.tokens["r0"] == oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited").tokens
        )
        assert decode_took(client) == 0 and not client._open
        wait_pd_idle(client)
    finally:
        client.close()


def test_a_restart_after_superseded_updates_moves_kv_the_decode_stage_uses(ckpts, monkeypatch):
    """Two updates that each rewrite every tensor: the restarted stage applies the last one only
    (the log dropped the first), yet its block hashes carry the decode stage's version, so the
    decode stage finds every block it moves."""
    monkeypatch.setattr(pd_prefill, "RESTARTS", replace(pd_prefill.RESTARTS, backoff_s=0.0))
    client = _client(ckpts["ouro"])
    try:
        for _ in range(2):
            client.update_weights([str(ckpts["ouro"])], False, 30.0)
        assert len(client._updates) == 1
        old = client.prefill
        old._die("injected")
        deadline = time.monotonic() + 120  # (hang guard)
        while client.prefill is old or client.prefill_down is not None:
            assert time.monotonic() < deadline, client.prefill_down
            time.sleep(0.05)
        assert client.prefill.weight_version == client.decode.weight_version == 2
        stream_all(client, [list(range(100, 130))], [GREEDY])
        wait_pd_idle(client)
        stats = client.decode.stats
        assert (stats.kv_transfer_hits, stats.kv_transfer_unused) == (28, 0)
        with pytest.raises(ValueError, match="below"):  # (blocks of older weights would hit)
            client.prefill.set_weight_version(1)
    finally:
        client.close()


def test_a_dead_decode_stage_names_itself(ckpts):
    client = _client(ckpts["ouro"], cls=StageClient)
    try:
        updates, ended, sink = _collect()
        long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
        client.add_request("d", [5, 6, 7], long, sink)
        client.decode.kill()
        assert ended.wait(60)
        last = updates["d"][-1]
        assert last.finish_reason is FinishReason.ERROR
        assert last.error == "stage died: decode stage: worker process killed by signal 9"
        assert not client.alive
        assert client.error == "decode stage: worker process killed by signal 9"
    finally:
        client.kill()
        client.close(timeout=5)


def test_a_failed_hand_over_ends_the_request_and_leaves_nothing(ckpts, monkeypatch):
    client = _client(ckpts["ouro"])
    try:

        def broken(*args, **kwargs):
            raise RuntimeError("cannot send")

        monkeypatch.setattr(client.decode, "add_request", broken)
        updates, ended, sink = _collect()
        client.add_request("h", list(range(10, 40)), GREEDY, sink)
        assert ended.wait(60)
        last = updates["h"][-1]
        assert last.finish_reason is FinishReason.ERROR
        assert last.error == "decode stage: RuntimeError: cannot send"
        assert not client._ids and not client._open
        wait_pd_idle(client)
    finally:
        client.close()


def test_an_aborted_waiting_sample_gets_one_final_update(ckpts, monkeypatch):
    client = _client(ckpts["ouro"])
    prompt = list(range(10, 40))
    try:
        updates, ended, sink = _collect()
        held = []
        real_add = client.prefill.add_request
        monkeypatch.setattr(client.prefill, "add_request", lambda *a: held.append(a))
        client.add_request("a", prompt, GREEDY, sink, group="g")
        client.add_request("b", prompt, GREEDY, sink, group="g")
        client.abort("b")
        assert client._open["a"].followers == []
        real_add(*held[0])
        while not (updates.get("a") and updates["a"][-1].finish_reason):
            time.sleep(0.01)
        wait_pd_idle(client)
        assert [(u.new_token_ids, u.finish_reason) for u in updates["b"]] == [
            ([], FinishReason.ABORT)
        ]
    finally:
        client.close()


def test_closing_during_a_prefill_ends_it_and_its_waiting_samples_as_closed(ckpts, monkeypatch):
    client = _client(ckpts["ouro"])
    prompt = list(range(10, 40))
    updates, ended, sink = _collect()
    held = []
    monkeypatch.setattr(client.prefill, "add_request", lambda *a: held.append(a))
    client.add_request("a", prompt, GREEDY, sink, group="g")
    client.add_request("b", prompt, GREEDY, sink, group="g")
    client.close()
    held[0][3](RequestUpdate("a", finish_reason=FinishReason.ABORT))  # (the prefill stage's)
    for rid in ("a", "b"):
        assert [(u.finish_reason, u.error) for u in updates[rid]] == [
            (FinishReason.ABORT, "stage closed before the request finished")
        ]
    assert not client._ids
