"""Prefill/decode disaggregation (``core/pd.py``): a prompt computed on a prefill stage and
decoded on a decode stage gives the oracle's (and one stage's) token ids and exit depths in
every engine mode, greedy and seeded, with adaptive exits, capped and traced depths, Huginn's
initial states, groups and preemption; the decode stage really reuses the moved blocks; ids are
unique across stages; nothing leaks (blocks, files). Aborts, rejections, a failed hand-over and
a dead stage: ``test_pd_failures.py``; the file itself, engine to engine:
``test_kv_transfer.py``."""

from __future__ import annotations

import random
import threading
import time

import orjson
import pytest
from engine_util import (
    ENGINE_MODES,
    decode_took,
    oracle_run,
    stream_all,
    tight_blocks,
    wait_pd_idle,
)

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.core.pd import PDClient, stage_configs
from rltserve.core.stage import InProcessStageClient
from rltserve.sampling import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _workload(seed: int, n: int = 6, thresholds=(1.0, 0.5, 0.3)):
    rng = random.Random(seed)
    base = [rng.randrange(384) for _ in range(13)]
    prompts = [base + [rng.randrange(384) for _ in range(rng.randint(0, 9))] for _ in range(n)]
    prompts[1] = [rng.randrange(384) for _ in range(3)]  # no full block: straight to decode
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(3, 7),
            ignore_eos=True,
            exit_threshold=thresholds[i % len(thresholds)],
        )
        for i in range(n)
    ]
    return prompts, params


def _client(path, cls=InProcessStageClient, **engine) -> PDClient:
    engine.setdefault("num_blocks", 512)
    engine.setdefault("block_size", BS)
    config = EngineConfig.from_flat(model=str(path), disaggregate=True, **engine)
    client = PDClient(config, cls)
    client.wait_ready(120)
    return client


def _oracle(ref, run, prompts, params, **kw) -> None:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ref, prompt, p, **kw)
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"


def _moved(prompts: list[list[int]]) -> int:
    """Prompt tokens whose blocks move: the full blocks before each prompt's last token."""
    return sum((len(p) - 1) // BS * BS for p in prompts)


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_every_mode_matches_the_oracle_and_reuses_moved_blocks(ckpts, ouro_ref, mode):
    prompts, params = _workload(3)
    engine = {"kv_policy": "last_exited", **ENGINE_MODES[mode]}
    exit_mode = "gate"
    if engine.get("async_scheduling"):
        exit_mode = engine["exit_mode"]
    if "preemption_mode" in engine:  # the decode pool preempts again and again
        engine["num_blocks"] = tight_blocks(ckpts["ouro"], prompts, params)
    client = _client(ckpts["ouro"], **engine)
    try:
        run = stream_all(client, prompts, params)
        _oracle(ouro_ref, run, prompts, params, kv_policy="last_exited", exit_mode=exit_mode)
        moved = _moved(prompts)
        assert decode_took(client) >= moved // 2
        if "preemption_mode" not in engine:  # (a preempted request may hit again)
            assert decode_took(client) == moved
        wait_pd_idle(client)
    finally:
        client.close()


@pytest.mark.parametrize("kv_policy", ["full", "last_exited"])
def test_seeded_sampling_and_groups_equal_one_stage(ckpts, kv_policy, monkeypatch):
    import rltserve.core.engine as engine_module

    exports = []
    real_export = engine_module.export_prompt

    def counting(*args):
        exports.append(args)
        return real_export(*args)

    monkeypatch.setattr(engine_module, "export_prompt", counting)
    prompts, _ = _workload(5, n=4)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=6, seed=40 + i, exit_threshold=0.5)
        for i in range(len(prompts))
    ]
    results = []
    for disaggregate in (False, True):
        config = EngineConfig.from_flat(
            model=str(ckpts["ouro"]),
            num_blocks=256,
            block_size=BS,
            kv_policy=kv_policy,
            disaggregate=disaggregate,
        )
        client = PDClient(config, InProcessStageClient) if disaggregate else None
        client = client or InProcessStageClient(config)
        client.wait_ready(120)
        try:
            results.append(_groups(client, prompts, params))
            if disaggregate:
                wait_pd_idle(client)
                # Every sample's prompt blocks came from the prefill stage (as group hits).
                moved = _moved(prompts)
                assert decode_took(client) >= 2 * moved
                # One transfer per group: the second samples waited for the first's.
                assert len(exports) == len(prompts) - 1  # (prompts[1] has no full block)
        finally:
            client.close()
    assert results[0] == results[1]


def _groups(client, prompts, params) -> dict:
    """Every prompt as a group of two samples (seeds s, s + 1), all at once."""
    out: dict[str, list] = {}
    done = threading.Semaphore(0)

    def sink(update):
        out.setdefault(update.request_id, []).append(
            (update.new_token_ids, update.new_exit_depths, update.error)
        )
        if update.finish_reason is not None:
            done.release()

    for i, (prompt, p) in enumerate(zip(prompts, params)):
        for j in range(2):
            sample = p.replace(seed=p.seed + j)
            client.add_request(f"r{i}-{j}", prompt, sample, sink, group=f"g{i}")
    for _ in range(2 * len(prompts)):
        assert done.acquire(timeout=120)
    return {rid: [t for u in ups for t in u[0]] for rid, ups in out.items()} | {
        rid + "/depths": [d for u in ups for d in u[1]] for rid, ups in out.items()
    }


@pytest.mark.parametrize("init_state", ["zero", "random"])
def test_huginn_matches_the_oracle(ckpts, huginn_ref, init_state):
    prompts, params = _workload(9, n=4, thresholds=(1.0,))
    params = [
        p.replace(init_state=init_state, seed=11 + i, max_loops=3) for i, p in enumerate(params)
    ]
    client = _client(ckpts["huginn"], kv_policy="full")
    try:
        run = stream_all(client, prompts, params)
        _oracle(huginn_ref, run, prompts, params, kv_policy="full")
        moved = _moved(prompts)
        assert decode_took(client) == moved
        wait_pd_idle(client)
    finally:
        client.close()


def test_ouro_below_its_depth_and_traced_exits_move_their_blocks(ckpts, ouro_ref, huginn_ref):
    """A gated request capped below the model's loops still runs every loop on its prompt (the
    prefill request goes to the full depth), and traced exits (Huginn, whose first output may
    exit before the prompt's last loop) move theirs too."""
    prompts, params = _workload(4, n=4, thresholds=(1.0, 0.5))
    params = [p.replace(max_loops=2 + i % 2) for i, p in enumerate(params)]
    client = _client(ckpts["ouro"])
    try:
        run = stream_all(client, prompts, params)
        _oracle(ouro_ref, run, prompts, params, kv_policy="last_exited")
        assert decode_took(client) == sum((len(p) - 1) // BS * BS for p in prompts)
    finally:
        client.close()
    traces = [[1, 3, 2], [3, 1, 3], [2, 2, 1], [3, 3, 3]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, max_loops=3,
                       init_state="zero", trace_depths=trace)
        for trace in traces
    ]  # fmt: skip
    client = _client(ckpts["huginn"], kv_policy="full", exit_mode="trace")
    try:
        run = stream_all(client, prompts, params)
        _oracle(huginn_ref, run, prompts, params, kv_policy="full", exit_mode="trace")
        assert decode_took(client) == sum((len(p) - 1) // BS * BS for p in prompts)
        wait_pd_idle(client)
    finally:
        client.close()


def test_what_goes_straight_to_the_decode_stage(ckpts, huginn_ref):
    """Prompts without a full block before their last token, prompt scoring, and unseeded
    random-state Huginn requests (their KV depends on the decode stage's seed) skip the
    prefill stage."""
    client = _client(ckpts["huginn"], kv_policy="full")
    try:
        prompt = list(range(20, 40))
        params = [
            SamplingParams(temperature=0.0, max_tokens=3, init_state="random"),
            SamplingParams(temperature=0.0, max_tokens=3, init_state="zero", prompt_logprobs=1),
        ]
        stream_all(client, [prompt, prompt], params)
        stream_all(client, [[1, 2, 3]], [SamplingParams(temperature=0.0, max_tokens=3)])
        assert client.prefill.stats is None or client.prefill.stats.num_steps == 0
        assert decode_took(client) == 0
        wait_pd_idle(client)
    finally:
        client.close()


# ---------------------------------------------------------------- lifecycle


def _collect():
    updates: dict[str, list] = {}
    ended = threading.Event()

    def sink(update):
        updates.setdefault(update.request_id, []).append(update)
        if update.finish_reason is not None:
            ended.set()

    return updates, ended, sink


def test_request_ids_are_unique_across_both_stages(ckpts):
    client = _client(ckpts["ouro"])
    try:
        updates, ended, sink = _collect()
        slow = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        client.add_request("x", list(range(10, 40)), slow, sink)  # through the prefill stage
        with pytest.raises(ValueError, match="already in use"):
            client.add_request("x", [1, 2], GREEDY, sink)  # would go to the decode stage
        client.abort("x")
        assert ended.wait(60)
        client.add_request("x", [1, 2], GREEDY, sink)  # free again once it ended
        wait_pd_idle(client)
    finally:
        client.close()


def test_config_refuses_what_cannot_move_kv():
    with pytest.raises(ValueError, match="disaggregate=True: kv_policy='shared'"):
        EngineConfig.from_flat(disaggregate=True, kv_policy="shared")
    with pytest.raises(ValueError, match="disaggregate=True: needs prefix caching"):
        EngineConfig.from_flat(disaggregate=True, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefill_device='cpu': only with disaggregate"):
        EngineConfig.from_flat(prefill_device="cpu")
    with pytest.raises(ValueError, match="prefill_device='gpu'"):
        EngineConfig.from_flat(disaggregate=True, prefill_device="gpu")
    prefill, decode = stage_configs(
        EngineConfig.from_flat(disaggregate=True, prefill_device="cpu", cuda_graphs=False)
    )
    assert not prefill.execution.disaggregate and not decode.execution.disaggregate
    assert prefill.cache.prefix_caching and decode.cache.prefix_caching
    with pytest.raises(ValueError, match="an EngineCore runs one stage"):
        EngineCore(EngineConfig.from_flat(disaggregate=True))


async def test_the_server_serves_through_two_stages(tmp_path_factory):
    from test_http_harness import running, tiny_checkpoint

    body = {"prompt": list(range(5, 19)), "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    outputs = []
    for disaggregate in (False, True):
        engine = {"block_size": BS, "disaggregate": disaggregate}
        factory = (lambda config: PDClient(config, InProcessStageClient)) if disaggregate else None
        kw = {"client_factory": factory} if factory else {}
        async with running(tiny_checkpoint(tmp_path_factory), engine=engine, **kw) as server:
            status, _, raw = await server.post("/v1/completions", body)
            assert status == 200, raw
            outputs.append(orjson.loads(raw))
            _, _, exposition = await server.get("/metrics")
            prefill = {
                line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in exposition.decode().splitlines()
                if line.startswith("rltserve:prefill_stage_")
            }
            # Two stages: the prefill stage's own series (it ran the prompt; idle now).
            assert bool(prefill) == disaggregate
            assert prefill.get("rltserve:prefill_stage_engine_steps_total", 1) > 0
            if disaggregate:
                assert prefill["rltserve:prefill_stage_kv_cache_usage_perc"] == 0.0
                assert prefill["rltserve:prefill_stage_prefix_cache_queries_total"] == 14
    assert outputs[1]["choices"][0]["token_ids"] == outputs[0]["choices"][0]["token_ids"]
    # The decode stage found the prompt's blocks (12 of 14 tokens) moved from the prefill stage:
    # computed there, so not cached tokens (a cold server reports none, as one stage does).
    assert outputs[1]["usage"] == outputs[0]["usage"]
    assert "prompt_tokens_details" not in outputs[1]["usage"]


def test_a_truncated_prompt_moves_the_blocks_it_runs(ckpts, ouro_ref):
    """``truncate_prompt_tokens``: the prefill stage computes the prompt the decode stage runs
    (its last k tokens), whose blocks the decode stage then reuses."""
    client = _client(ckpts["ouro"], kv_policy="last_exited")
    try:
        prompt = [(5 * i) % 384 for i in range(40)]
        params = GREEDY.replace(truncate_prompt_tokens=21)
        run = stream_all(client, [prompt], [params])
        _oracle(ouro_ref, run, [prompt[-21:]], [GREEDY], kv_policy="last_exited")
        assert decode_took(client) == _moved([prompt[-21:]]) == 20
        wait_pd_idle(client)
    finally:
        client.close()


def test_a_salted_prompt_moves_its_blocks(ckpts):
    """``cache_salt``: the prefill stage hashes the prompt's blocks with the request's salt, so
    the decode stage finds them."""
    client = _client(ckpts["ouro"], kv_policy="last_exited")
    try:
        prompt = [(3 * i) % 384 for i in range(21)]
        stream_all(client, [prompt], [GREEDY.replace(cache_salt="tenant")])
        assert decode_took(client) == _moved([prompt]) == 20
        wait_pd_idle(client)
    finally:
        client.close()


def test_stage_configs_put_the_prefill_stage_on_its_device_without_graphs():
    config = EngineConfig.from_flat(
        disaggregate=True, device="cuda", prefill_device="cpu", cuda_graphs=True
    )
    prefill, decode = stage_configs(config)
    assert (prefill.model.device, decode.model.device) == ("cpu", "cuda")
    assert (prefill.execution.cuda_graphs, decode.execution.cuda_graphs) == (False, True)
    assert prefill.execution.prefill_device is None and decode.execution.prefill_device is None


def test_a_prompt_of_one_block_goes_straight_and_one_token_more_moves_it(ckpts, ouro_ref):
    """A prompt whose last token starts its second block has one full block to move; one of
    exactly a block has none before its last token (the decode stage computes it alone)."""
    client = _client(ckpts["ouro"])
    prefills = []
    real_add = client.prefill.add_request
    client.prefill.add_request = lambda *a: prefills.append(a[0]) or real_add(*a)
    try:
        prompts = [list(range(20, 20 + BS)), list(range(30, 31 + BS))]
        run = stream_all(client, prompts, [GREEDY, GREEDY])
        _oracle(ouro_ref, run, prompts, [GREEDY, GREEDY], kv_policy="last_exited")
        assert prefills == ["r1"]
        assert decode_took(client) == BS
        wait_pd_idle(client)
    finally:
        client.close()


def test_a_request_kv_policy_is_the_prefill_requests(ckpts, ouro_ref):
    """A request asking for another KV policy than the engine's gets its prompt computed under
    it on the prefill stage: the decode stage finds every moved block."""
    client = _client(ckpts["ouro"], kv_policy="last_exited")
    try:
        prompts, params = [list(range(10, 33))], [GREEDY.replace(kv_policy="full")]
        run = stream_all(client, prompts, params)
        _oracle(ouro_ref, run, prompts, params, kv_policy="full")
        assert decode_took(client) == _moved(prompts)
        wait_pd_idle(client)
    finally:
        client.close()


def test_group_members_with_another_prompt_run_their_own_prefill(ckpts, ouro_ref, monkeypatch):
    client = _client(ckpts["ouro"])
    prompts = [list(range(10, 40)), list(range(11, 41))]
    try:
        updates, ended, sink = _collect()
        held = []
        real_add = client.prefill.add_request
        monkeypatch.setattr(client.prefill, "add_request", lambda *a: held.append(a))
        for rid, prompt in zip(("a", "b"), prompts):
            client.add_request(rid, prompt, GREEDY, sink, group="g")
        assert [a[0] for a in held] == ["a", "b"] and not client._following
        for args in held:
            real_add(*args)
        while len([r for r in ("a", "b") if updates.get(r) and updates[r][-1].finish_reason]) < 2:
            time.sleep(0.01)
        for rid, prompt in zip(("a", "b"), prompts):
            want = oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited").tokens
            assert [t for u in updates[rid] for t in u.new_token_ids] == want
        assert decode_took(client) == _moved(prompts)
        wait_pd_idle(client)
    finally:
        client.close()


def test_a_group_key_used_again_after_its_leader_moved_leads_anew(ckpts, ouro_ref):
    client = _client(ckpts["ouro"])
    prompt = list(range(10, 40))
    want = oracle_run(ouro_ref, prompt, GREEDY, kv_policy="last_exited").tokens
    try:
        for rid in ("a", "b"):
            updates, ended, sink = _collect()
            client.add_request(rid, prompt, GREEDY, sink, group="g")
            assert ended.wait(20), f"{rid} was never served"
            assert [t for u in updates[rid] for t in u.new_token_ids] == want
        assert not client._leaders and not client._following
        wait_pd_idle(client)
    finally:
        client.close()
