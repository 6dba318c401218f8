"""The engine reproduces the Hugging Face vectors and the dense oracle (float32, tiny models)
in every scheduling configuration, with zero leaked KV blocks after every run."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from engine_util import make_core, oracle_run, run_core, with_eos
from recipe import build_nanbeige, load_vectors
from reference import Reference

from rltserve.core.engine_info import STEP_ROW_BUCKETS
from rltserve.sampling import SamplingParams

VECTORS = load_vectors()
PROMPTS = VECTORS["prompts"]

OURO_CASES = {
    "ouro_full_depth": ({}, {}),
    "ouro_threshold_0.5": ({"exit_threshold": 0.5}, {"kv_policy": "full"}),
    "ouro_threshold_0.3": ({"exit_threshold": 0.3}, {"kv_policy": "full"}),
    "ouro_exit_at_depth_2": ({"max_loops": 2}, {"kv_policy": "full"}),
}


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("case", sorted(OURO_CASES))
def test_hf_vectors_ouro_batched(ckpts, case):
    params_kw, engine_kw = OURO_CASES[case]
    core = make_core(ckpts["ouro"], **engine_kw)
    expected = VECTORS["cases"][case]
    run = run_core(core, PROMPTS, [greedy(16, **params_kw)] * len(PROMPTS))
    for i in range(len(PROMPTS)):
        assert run.tokens[f"r{i}"] == expected["tokens"][i], f"prompt {i}"
        assert run.depths[f"r{i}"] == expected["exit_depths"][i], f"prompt {i}"


@pytest.mark.parametrize("kv_policy", ["full", "last_exited"])
def test_hf_vectors_huginn_batched(ckpts, kv_policy):
    core = make_core(ckpts["huginn"], kv_policy=kv_policy)
    expected = VECTORS["cases"]["huginn_4_loops_zero_state"]
    params = greedy(12, max_loops=4, init_state="zero")
    run = run_core(core, PROMPTS, [params] * len(PROMPTS))
    for i in range(len(PROMPTS)):
        assert run.tokens[f"r{i}"] == expected["tokens"][i], f"prompt {i}"
        assert run.depths[f"r{i}"] == [4] * 12


def _mixed_workload(n: int, seed: int, thresholds=(1.0, 0.3, 0.5, 0.7)):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append([rng.randrange(384) for _ in range(rng.randint(1, 40))])
        params.append(
            greedy(
                rng.randint(1, 12),
                exit_threshold=thresholds[i % len(thresholds)],
                min_loops=rng.choice([1, 1, 2]),
            )
        )
    return prompts, params


def _check_against_oracle(ref, run, prompts, params, kv_policy, exit_mode="gate", chunk=None):
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        starts = list(range(0, len(prompt), chunk)) if chunk else None
        want = oracle_run(
            ref, prompt, p, kv_policy=kv_policy, exit_mode=exit_mode, prompt_chunks=starts
        )
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"


@pytest.mark.parametrize("kv_policy", ["full", "last_exited"])
@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize(
    "budget",
    [
        {"prefill_chunk_size": 512, "max_num_batched_tokens": 2048, "max_num_seqs": 64},
        {"prefill_chunk_size": 7, "max_num_batched_tokens": 16, "max_num_seqs": 5},
        {"prefill_chunk_size": 1, "max_num_batched_tokens": 3, "max_num_seqs": 2},
    ],
    ids=["roomy", "chunk7", "chunk1"],
)
def test_matches_oracle(ckpts, ouro_ref, kv_policy, scheduling, budget):
    # crc32, unlike hash(str), does not change with PYTHONHASHSEED: the same workload every run.
    prompts, params = _mixed_workload(12, seed=zlib.crc32(f"{kv_policy}/{scheduling}".encode()))
    core = make_core(ckpts["ouro"], kv_policy=kv_policy, scheduling=scheduling, **budget)
    run = run_core(core, prompts, params)
    _check_against_oracle(ouro_ref, run, prompts, params, kv_policy)


def test_shared_policy_matches_oracle(ckpts, ouro_ref):
    # `shared` is chunking-dependent by nature (a later chunk reads an earlier chunk's final
    # version), so it is compared with the oracle's whole-prompt prefill.
    prompts, params = _mixed_workload(8, seed=5)
    core = make_core(ckpts["ouro"], kv_policy="shared")
    run = run_core(core, prompts, params)
    _check_against_oracle(ouro_ref, run, prompts, params, "shared")


@pytest.mark.parametrize(
    "family,kv_policy", [("ouro", "shared"), ("huginn", "shared"), ("huginn", "ring:2")]
)
def test_chunked_shared_and_ring_match_the_chunked_oracle_whatever_else_runs(
    ckpts, ouro_ref, huginn_ref, family, kv_policy
):
    # Under shared/ring a chunk reads an earlier chunk's last versions, so the oracle runs the
    # same chunks: the engine cuts them at multiples of prefill_chunk_size even where the step
    # has less budget left (the chunk waits), so the batch never changes a request's output.
    rng = random.Random(7)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(5, 14))] for _ in range(6)]
    if family == "ouro":
        params = [greedy(rng.randint(2, 6), exit_threshold=0.5) for _ in prompts]
    else:
        params = [
            greedy(rng.randint(2, 6), max_loops=rng.choice([2, 3, 4]), init_state="random", seed=i)
            for i in range(len(prompts))
        ]
    ref = ouro_ref if family == "ouro" else huginn_ref
    # (Cut every 4 tokens: the budget holds a chunk beside max_num_seqs - 1 decode rows.)
    budget = {"prefill_chunk_size": 4, "max_num_batched_tokens": 6, "max_num_seqs": 3}
    core = make_core(ckpts[family], kv_policy=kv_policy, **budget)
    run = run_core(core, prompts, params, arrivals=[0, 0, 1, 1, 2, 3])
    assert any(len(p) % 4 and len(p) > 4 for p in prompts)  # (a short last chunk)
    _check_against_oracle(ref, run, prompts, params, kv_policy, chunk=4)
    for i in (0, 3):  # (each alone: the same)
        core = make_core(ckpts[family], kv_policy=kv_policy, **budget)
        alone = run_core(core, [prompts[i]], [params[i]])
        assert (alone.tokens["r0"], alone.depths["r0"]) == (
            run.tokens[f"r{i}"],
            run.depths[f"r{i}"],
        )


def test_a_shared_prompt_does_not_wait_for_running_decodes_to_end(ckpts):
    # Whole chunks (above) fit beside the other requests' decode rows: with the budget equal to
    # prefill_chunk_size a late prompt would otherwise wait for every decode to finish.
    core = make_core(
        ckpts["ouro"], kv_policy="shared", prefill_chunk_size=8, max_num_batched_tokens=8,
        max_num_seqs=4,
    )  # fmt: skip
    assert core.config.scheduler.whole_chunk_size == 5
    for i in range(3):
        core.add_request(f"d{i}", [1 + i, 2, 3], greedy(60))
    first, step = {}, 0
    while core.scheduler.running or core.scheduler.waiting:
        if step == 10:
            core.add_request("late", list(range(10, 30)), greedy(2))
        step += 1
        for update in core.step():
            if update.new_token_ids:
                first.setdefault(update.request_id, step)
    core.shutdown()
    assert first["late"] < 60 < step  # (20 tokens: 4 chunks of at most 4 loops each)


def test_32_concurrent_staggered_arrivals(ckpts, ouro_ref):
    prompts, params = _mixed_workload(32, seed=11)
    rng = random.Random(3)
    arrivals = [rng.randint(0, 30) for _ in prompts]
    assert len(set(arrivals)) >= 16  # requests really arrive over many different steps
    core = make_core(ckpts["ouro"], max_num_batched_tokens=64, prefill_chunk_size=16)
    joined_running = []
    add = core.add_request

    def add_and_note(rid, prompt, p):  # late arrivals must join a batch that is decoding
        joined_running.append(any(r.output_token_ids for r in core.scheduler.running))
        add(rid, prompt, p)

    core.add_request = add_and_note
    run = run_core(core, prompts, params, arrivals=arrivals)
    _check_against_oracle(ouro_ref, run, prompts, params, "last_exited")
    assert sum(joined_running) >= 8, joined_running
    assert run.max_rows > 8  # many requests shared steps
    # Every step counted once in the rows-per-step histogram, the largest in its bucket.
    stats = core.stats()
    assert sum(stats.step_rows_counts) == stats.num_steps
    top = max(i for i, n in enumerate(stats.step_rows_counts) if n)
    assert STEP_ROW_BUCKETS[top - 1] < run.max_rows <= STEP_ROW_BUCKETS[top]
    # vLLM's iteration tokens: every step has its entry, and they add up to the prompt
    # tokens (counted at the first token) and the tokens output.
    assert sum(stats.step_tokens_counts) == stats.num_steps
    outputs = sum(map(len, run.tokens.values()))
    assert stats.num_step_tokens == sum(map(len, prompts)) + outputs
    assert stats.num_step_tokens < stats.num_rows  # (a token runs a row at each loop)


@pytest.mark.parametrize("exit_mode", ["delayed", "trace"])
def test_exit_modes_match_oracle(ckpts, ouro_ref, exit_mode):
    prompts, params = _mixed_workload(10, seed=7, thresholds=(0.3, 0.5, 0.7))
    if exit_mode == "trace":
        rng = random.Random(1)
        params = [
            p.replace(trace_depths=[rng.randint(p.min_loops, 4) for _ in range(12)]) for p in params
        ]
    core = make_core(ckpts["ouro"], exit_mode=exit_mode)
    run = run_core(core, prompts, params)
    _check_against_oracle(ouro_ref, run, prompts, params, "last_exited", exit_mode)


def test_aborts_mid_flight(ckpts, ouro_ref):
    prompts, params = _mixed_workload(10, seed=13)
    params = [p.replace(max_tokens=12) for p in params]
    core = make_core(ckpts["ouro"], prefill_chunk_size=8, max_num_batched_tokens=24)
    aborts = {0: 0, 3: 2, 5: 7, 8: 15}
    run = run_core(core, prompts, params, aborts=aborts)
    for i in range(len(prompts)):
        want = oracle_run(ouro_ref, prompts[i], params[i], kv_policy="last_exited")
        got = run.tokens[f"r{i}"]
        if i in aborts:
            assert run.finish[f"r{i}"] == "abort"
            assert got == want.tokens[: len(got)]
        else:
            assert got == want.tokens


@pytest.mark.parametrize(
    "kv_policy,chunk", [("full", 512), ("last_exited", 512), ("ring:2", 512), ("full", 5)]
)
def test_huginn_matches_oracle(ckpts, huginn_ref, kv_policy, chunk):
    rng = random.Random(2)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    params = [
        greedy(rng.randint(1, 8), max_loops=rng.choice([2, 3, 4]), init_state="random", seed=i)
        for i in range(6)
    ]
    # ring:K, like shared, makes a later chunk read an earlier chunk's final version, so it is
    # compared with the oracle's whole-prompt prefill only.
    core = make_core(ckpts["huginn"], kv_policy=kv_policy, prefill_chunk_size=chunk)
    run = run_core(core, prompts, params)
    _check_against_oracle(huginn_ref, run, prompts, params, kv_policy)


def _huginn_traces(n: int, seed: int, max_prompt: int = 14):
    """Huginn requests whose outputs exit at traced depths, the first output below the
    request's loops in most of them (its coda waits for the prompt's last loop)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)]
    params = []
    for i in range(n):
        loops, k = rng.choice([2, 3, 4]), rng.randint(2, 9)
        trace = [rng.randint(1, loops) for _ in range(k)]
        trace[0] = min(trace[0], loops - 1) if i % 4 else loops
        init = "random" if i % 2 else "zero"
        params.append(greedy(k, max_loops=loops, trace_depths=trace, init_state=init, seed=i))
    return prompts, params


@pytest.mark.parametrize(
    "kv_policy,engine",
    [
        ("full", {}),
        ("full", {"carry_decode": False, "prefill_chunk_size": 3}),
        ("last_exited", {}),
        ("last_exited", {"carry_decode": False, "prefill_chunk_size": 3}),
        ("ring:2", {}),
        ("ring:3", {"carry_decode": False}),
    ],
)
def test_huginn_traced_exits_match_oracle(ckpts, huginn_ref, kv_policy, engine):
    """Early exits on a model with coda attention: each position's coda runs once, on its exit
    state (under ``full`` a token loops on without a second coda), and a first output exiting
    before the prompt's last loop is sampled at that loop, reading every other prompt
    position's full-depth coda K/V (DESIGN §4). Under ``ring:k`` a token exiting before loop k
    fills the planes it never wrote with its exit version."""
    prompts, params = _huginn_traces(8, seed=5)
    core = make_core(ckpts["huginn"], kv_policy=kv_policy, exit_mode="trace", **engine)
    run = run_core(core, prompts, params)
    _check_against_oracle(huginn_ref, run, prompts, params, kv_policy, "trace")
    core.shutdown()


def test_seeded_sampling_same_alone_and_batched(ckpts):
    core = make_core(ckpts["ouro"])
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = run_core(core, [[5, 6, 7]], [p]).tokens["r0"]
    prompts, params = _mixed_workload(8, seed=3)
    params = [q.replace(temperature=0.8, seed=None) for q in params]
    run = run_core(make_core(ckpts["ouro"]), [[5, 6, 7]] + prompts, [p] + params)
    assert run.tokens["r0"] == alone


def test_stop_tokens(ckpts, ouro_ref):
    want = ouro_ref.generate(PROMPTS[1], 16).tokens
    stop = want[3]
    core = make_core(ckpts["ouro"])
    p = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(stop,), ignore_eos=True)
    run = run_core(core, [PROMPTS[1]], [p])
    assert run.tokens["r0"] == want[: want.index(stop) + 1]
    assert run.finish["r0"] == "stop"


@pytest.mark.parametrize("kv_policy,chunk", [("last_exited", 6), ("full", 512)])
def test_nanbeige_matches_oracle(tmp_path, kv_policy, chunk):
    # Built from MODELS.md's tensor table by the oracle's side (recipe.py), not from the
    # engine's layout table, so a wrong name or shape there cannot pass unnoticed.
    path = build_nanbeige(tmp_path / "nanbeige")
    ref = Reference.load(path)
    rng = random.Random(4)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 25))] for _ in range(6)]
    params = [greedy(rng.randint(1, 8)) for _ in prompts]
    run = run_core(make_core(path, kv_policy=kv_policy, prefill_chunk_size=chunk), prompts, params)
    _check_against_oracle(ref, run, prompts, params, kv_policy)
    assert all(d == 2 for depths in run.depths.values() for d in depths)


def _eos_workload(ref: Reference, n: int, seed: int):
    """Prompts whose greedy outputs (without EOS) contain the chosen EOS ids mid-generation."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    free = [ref.generate(prompt, 12).tokens for prompt in prompts]
    eos = sorted({free[i][3 + i % 5] for i in range(0, n, 2)})
    return prompts, free, eos


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_real_eos_and_min_tokens_match_oracle(tmp_path, ckpts, ouro_ref, kv_policy):
    prompts, free, eos = _eos_workload(ouro_ref, 10, seed=17)
    path = with_eos(ckpts["ouro"], tmp_path / "ouro_eos", eos)
    ref = Reference.load(path)
    assert set(eos) <= set(ref.eos_token_ids)
    # Thirds: plain EOS, EOS held back by min_tokens, EOS ignored.
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=12, min_tokens=(0, 8, 0)[i % 3], ignore_eos=i % 3 == 2
        )
        for i in range(len(prompts))
    ]
    core = make_core(path, kv_policy=kv_policy, prefill_chunk_size=8, max_num_batched_tokens=24)
    run = run_core(core, prompts, params)
    held_back = 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ref, prompt, p, kv_policy=kv_policy)
        rid = f"r{i}"
        assert run.tokens[rid] == want.tokens, f"request {i}"
        assert run.depths[rid] == want.exit_depths, f"request {i}"
        ended_on_eos = len(want.tokens) < 12
        assert run.finish[rid] == ("stop" if ended_on_eos else "length"), f"request {i}"
        if ended_on_eos:
            assert want.tokens[-1] in ref.eos_token_ids and len(want.tokens) >= p.min_tokens
        if p.ignore_eos:
            assert run.tokens[rid] == free[i]
        first_eos = next((k for k, t in enumerate(free[i]) if t in eos), None)
        if p.min_tokens:  # EOS is not even sampled before min_tokens (vLLM's rule)
            assert not set(run.tokens[rid][: p.min_tokens]) & set(ref.eos_token_ids)
            if first_eos is not None and first_eos < p.min_tokens:
                held_back += 1
                assert run.tokens[rid][:first_eos] == free[i][:first_eos]
    stopped = [rid for rid, f in run.finish.items() if f == "stop"]
    assert len(stopped) >= 3, run.finish  # EOS really ended requests mid-generation
    assert held_back >= 1  # and min_tokens really held one back


def test_logprobs_match_oracle_logits(ckpts, ouro_ref):
    rng = random.Random(23)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=6,
            ignore_eos=True,
            logprobs=(0, 3, 5)[i % 3],
            exit_threshold=t,
        )
        for i, t in enumerate((1.0, 0.5, 1.0, 0.3, 1.0))
    ]
    core = make_core(ckpts["ouro"], kv_policy="full", prefill_chunk_size=6)
    run = run_core(core, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="full")
        rid = f"r{i}"
        assert run.tokens[rid] == want.tokens
        for k, logits in enumerate(want.logits):
            lp = torch.log_softmax(logits.double(), dim=-1)
            assert run.logprobs[rid][k] == pytest.approx(float(lp[want.tokens[k]]), abs=1e-4)
            top = run.top_logprobs[rid][k] or []
            assert len(top) == p.logprobs
            values, ids = lp.topk(p.logprobs) if p.logprobs else (lp[:0], lp[:0].long())
            assert [t for t, _ in top] == ids.tolist(), f"request {i} token {k}"
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)


def test_ring_policy_is_refused_for_non_huginn_models(ckpts, tmp_path):
    with pytest.raises(ValueError, match=r"kv_policy='ring:2': ring:K is for Huginn only"):
        make_core(ckpts["ouro"], kv_policy="ring:2")
    with pytest.raises(ValueError, match="ring:K is for Huginn only"):
        make_core(build_nanbeige(tmp_path / "nanbeige"), kv_policy="ring:1")
    make_core(ckpts["huginn"], kv_policy="ring:2")  # Huginn takes it


def test_context_limit_truncates_with_length(ckpts, ouro_ref):
    prompts = [list(range(1, 21)), list(range(30, 33))]
    params = [greedy(10), greedy(10)]
    run = run_core(make_core(ckpts["ouro"], max_model_len=24), prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited").tokens
        n = min(p.max_tokens, 24 - len(prompt))  # prompt + output fill the context at most
        assert run.tokens[f"r{i}"] == want[:n], f"request {i}"
        assert run.finish[f"r{i}"] == "length"
    assert len(run.tokens["r0"]) == 4


@pytest.mark.parametrize(
    "engine,blocks",
    [
        # 1 MiB / (2 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 bytes) = 128 blocks
        ({"kv_cache_gb": 1 / 1024}, 128),
        # capped by 2 requests x ceil(64 / 16) blocks x 8 planes (max_loops = 2 x 4)
        ({"kv_cache_gb": 1.0, "max_num_seqs": 2, "max_model_len": 64}, 64),
    ],
    ids=["memory", "ceiling"],
)
def test_automatic_kv_pool_size(ckpts, ouro_ref, engine, blocks):
    core = make_core(ckpts["ouro"], num_blocks=None, **engine)
    assert core.kv.pool.num_total == blocks
    prompts, params = _mixed_workload(6, seed=29)
    run = run_core(core, prompts, params)
    _check_against_oracle(ouro_ref, run, prompts, params, "last_exited")
    if blocks == 128:  # 510 tokens x 8 loops need 256 blocks: refused, naming the pool size
        with pytest.raises(ValueError, match="needs 256 KV blocks .* the pool has 128"):
            core.add_request("big", list(range(60)), greedy(450, max_loops=8))


def test_priority_orders_admission_then_fifo(ckpts, ouro_ref):
    # Under "priority" lower values go first, FIFO among equals.
    expected = ["d", "b", "a", "c"]
    core = make_core(ckpts["ouro"], max_num_seqs=1, scheduling_policy="priority")
    priorities = {"a": 1, "b": 0, "c": 1, "d": -1}
    prompts = {rid: [10 + i, 20 + i] for i, rid in enumerate(priorities)}
    for rid, priority in priorities.items():
        core.add_request(rid, prompts[rid], greedy(3, priority=priority))
    order, tokens = [], {rid: [] for rid in priorities}
    while core.has_work():
        for u in core.step():
            tokens[u.request_id].extend(u.new_token_ids)
            if u.finish_reason is not None:
                order.append(u.request_id)
    assert order == expected
    for rid, prompt in prompts.items():
        assert (
            tokens[rid] == oracle_run(ouro_ref, prompt, greedy(3), kv_policy="last_exited").tokens
        )
    core.kv.check_no_leaks()


def test_fcfs_refuses_a_priority_it_would_ignore(ckpts):
    # "fcfs" (the default, as in vLLM) admits by arrival alone, so a priority other than 0 is
    # refused, as vLLM refuses it, rather than dropped silently.
    core = make_core(ckpts["ouro"])
    for priority in (1, -1):
        with pytest.raises(ValueError) as err:
            core.add_request("p", [5, 6], greedy(2, priority=priority))
        assert str(err.value) == (
            f"priority={priority}: priority scheduling is not enabled (this engine runs "
            "scheduling_policy='fcfs'; start it with scheduling_policy='priority')"
        )
    core.add_request("zero", [5, 6], greedy(2, priority=0))
    while core.has_work():
        core.step()
    core.kv.check_no_leaks()


def test_requests_added_without_an_id_get_fresh_ones(ckpts):
    core = make_core(ckpts["ouro"])
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ids = [core.add_request(None, [5, 6], p) for _ in range(2)]
    assert all(isinstance(rid, str) and rid for rid in ids) and ids[0] != ids[1]
    finished = set()
    while core.has_work():
        finished |= {u.request_id for u in core.step() if u.finish_reason is not None}
    assert finished == set(ids)
