"""Prefill/decode disaggregation when things go wrong (``core/pd.py``): aborts during prefill,
during a move and of waiting samples, a failed group leader, refused requests, a dead prefill
stage, a failed hand-over and closing mid-prefill end each request once, as with one stage, and
leave no blocks or files behind. Modes and the oracle: ``test_pd.py``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from engine_util import oracle_run, stream_all, wait_pd_idle
from test_pd import GREEDY, _client, _collect

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
    assert not Path(client._dir).exists()


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


def test_a_dead_prefill_stage_costs_only_the_transfer(ckpts, ouro_ref):
    """Killed under a request (in its prefill or already decoding): the request is still served
    (without a file, the decode stage computes the prompt); then the client is not alive and
    refuses new requests, naming the stage."""
    client = _client(ckpts["ouro"], cls=StageClient)
    try:
        run = stream_all(client, [list(range(10, 40))], [GREEDY])  # through both processes
        assert len(run.tokens["r0"]) == 4
        updates, ended, sink = _collect()
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        client.add_request("k", list(range(10, 90)), long, sink)
        client.prefill.kill()
        assert ended.wait(60)
        want = oracle_run(ouro_ref, list(range(10, 90)), long, kv_policy="last_exited")
        assert [t for u in updates["k"] for t in u.new_token_ids] == want.tokens
        assert updates["k"][-1].finish_reason is FinishReason.LENGTH
        deadline = time.monotonic() + 30
        while client.alive:
            assert time.monotonic() < deadline, "the client did not notice the dead stage"
            time.sleep(0.05)
        assert client.error.startswith("prefill stage: ")
        with pytest.raises(StageError):
            client.add_request("k", list(range(10, 40)), GREEDY, lambda update: None)
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
