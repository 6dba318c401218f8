"""The context limit follows the KV pool: one request of ``max_model_len`` tokens at the
model's default depth fits in the whole pool (vLLM's rule), so a request that asks for the
whole context (a chat request without max_tokens) is admitted and ends at the limit. The model's
own limit is lowered to the pool's (logged); an explicit max_model_len past it fails at start.
A request that takes more planes than the default depth can still be too big for the pool."""

from __future__ import annotations

import logging

import pytest
from engine_util import make_core, oracle_run, run_core

from rltserve.sampling import SamplingParams

# ouro rv1: 4 loops by default (8 at most), per-depth planes under last_exited, a context of 512.


def test_the_model_limit_is_lowered_to_what_the_pool_holds(ckpts, ouro_ref, caplog):
    with caplog.at_level(logging.WARNING, logger="rltserve.core.kv_sizing"):
        core = make_core(ckpts["ouro"], num_blocks=8, block_size=4)
    # 8 blocks over 4 planes: 2 blocks of 4 positions each; the last token writes no KV.
    assert core.max_model_len == core.info.max_model_len == 9
    assert "max_model_len lowered to 9 (the model's: 512)" in caplog.text
    assert "a request at 4 loops takes 4 planes) holds a context of at most 9" in caplog.text
    # Asking for the whole context (max_tokens past it, or None: vLLM's "up to the context"):
    # admitted, ends at the limit with the oracle's tokens.
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    whole = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, min_tokens=2)
    run = run_core(core, [prompt, prompt], [params, whole])
    want = oracle_run(
        ouro_ref, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    for rid in ("r0", "r1"):
        assert run.tokens[rid] == want.tokens and run.finish[rid] == "length"
    with pytest.raises(
        ValueError, match=r"maximum context length of 9 tokens \(what the KV pool holds"
    ):
        core.make_request(None, list(range(9)), params)


def test_a_pool_that_holds_the_model_limit_leaves_it(ckpts):
    core = make_core(ckpts["ouro"], num_blocks=4 * 32, block_size=16)
    assert core.max_model_len == 512
    # (What the server logs: 4 planes a token, so 128 blocks of 16 hold 512 tokens, one
    # request of the whole context.)
    assert (core.info.kv_planes, core.info.kv_capacity_tokens) == (4, 512)
    assert core.info.max_concurrency == 1.0
    assert make_core(ckpts["ouro"], num_blocks=4 * 31, block_size=16).max_model_len == 497


def test_a_shared_plane_is_named_in_the_singular(ckpts, caplog):
    with caplog.at_level(logging.WARNING, logger="rltserve.core.kv_sizing"):
        core = make_core(ckpts["ouro"], num_blocks=8, block_size=4, kv_policy="shared")
    assert core.max_model_len == 33  # one plane: all 8 blocks hold the context
    assert "a request at 4 loops takes 1 plane) holds a context of at most 33" in caplog.text


def test_an_explicit_limit_past_the_pool_fails_at_start(ckpts):
    with pytest.raises(ValueError, match=r"max_model_len=64: the KV pool \(8 blocks of 4 "):
        make_core(ckpts["ouro"], num_blocks=8, block_size=4, max_model_len=64)
    assert make_core(ckpts["ouro"], num_blocks=8, block_size=4, max_model_len=9).max_model_len == 9
    with pytest.raises(ValueError, match="num_blocks=3: the KV pool"):
        make_core(ckpts["ouro"], num_blocks=3, block_size=4)  # (not one block per plane)
    with pytest.raises(ValueError, match="max_model_len=513: the model's context is 512 tokens"):
        make_core(ckpts["ouro"], max_model_len=513)


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "worker"])
def test_llm_raises_the_refusal_as_a_value_error(ckpts, in_process):
    """The stage builds the engine; a config it refuses reaches the caller as a ValueError
    (``StageConfigError``), not as a stage failure."""
    from rltserve import LLM
    from rltserve.core.stage import StageConfigError, StageError

    with pytest.raises(ValueError, match=r"^max_model_len=64: the KV pool \(8 blocks") as info:
        LLM(str(ckpts["ouro"]), num_blocks=8, block_size=4, max_model_len=64, in_process=in_process)
    assert isinstance(info.value, StageConfigError) and isinstance(info.value, StageError)


def test_more_loops_than_the_default_can_still_be_too_big(ckpts):
    core = make_core(ckpts["ouro"], num_blocks=8, block_size=4)
    deep = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, max_loops=8)  # 8 planes
    with pytest.raises(ValueError, match="KV blocks .* lower max_tokens or max_loops"):
        core.add_request("deep", [5, 6, 7], deep)


def test_a_pool_sized_from_kv_cache_gb_bounds_the_context_too(ckpts):
    from rltserve.core.kv_sizing import block_bytes

    probe = make_core(ckpts["ouro"])
    gb = 10.5 * block_bytes(probe.spec, probe.config) / 2**30  # room for 10 blocks
    core = make_core(ckpts["ouro"], num_blocks=None, kv_cache_gb=gb)
    assert core.info.num_blocks == 10
    assert core.max_model_len == 10 // 4 * 16 + 1  # 2 blocks of 16 per plane, on 4 planes


def test_a_pool_from_kv_cache_gb_fits_it_where_the_boundary_layers_outnumber_the_core(tmp_path):
    """huginn-tiny: 2 prelude + 2 coda layers on the boundary plane, 2 core layers. Both kinds
    of plane draw from one pool, so a block holds the larger count's K/V: the KV storage the
    runner allocates stays within kv_cache_gb."""
    from rltserve.models.presets import make_model

    path = make_model("huginn-tiny", tmp_path / "huginn")
    probe = make_core(path)
    assert probe.spec.num_boundary_layers > probe.spec.num_core_layers
    kv = probe.runner.kv  # [layers, 2, slots, heads, head_dim]: one pool for every plane
    per_block = kv[:, :, : probe.config.cache.block_size].numel() * kv.element_size()
    gb = 10.5 * per_block / 2**30  # room for 10 blocks of the runner's KV storage
    core = make_core(path, num_blocks=None, kv_cache_gb=gb)
    assert core.info.num_blocks == 10


def test_a_pool_from_kv_cache_gb_holds_no_more_than_every_seat_at_full_context(ckpts):
    """A kv_cache_gb far past need: blocks for ``max_num_seqs`` requests of the whole context
    at the model's most loops (ouro rv1: 8 planes), the context rounded up to whole blocks."""
    core = make_core(
        ckpts["ouro"],
        num_blocks=None,
        kv_cache_gb=1.0,
        block_size=4,
        max_num_seqs=2,
        max_model_len=10,
    )
    assert core.info.num_blocks == 2 * 3 * 8 and core.max_model_len == 10


def test_the_boundary_plane_counts_in_what_the_pool_holds(ckpts):
    """Coda attention (huginn): a request takes a plane per loop and the boundary plane."""
    core = make_core(ckpts["huginn"], num_blocks=40, block_size=4)
    planes = core.spec.num_loops + 1
    assert core.max_model_len == 40 // planes * 4 + 1
    assert core.info.kv_planes == planes


def test_an_explicit_limit_of_the_models_context_is_kept(ckpts):
    assert make_core(ckpts["ouro"], max_model_len=512).max_model_len == 512


def test_a_request_without_max_tokens_runs_to_what_the_pool_holds_at_its_depth(ckpts, huginn_ref):
    """Huginn at 8 loops (4 by default) takes more planes than the pool holds the whole
    context on: a request without max_tokens gets what the pool holds for it alone at that
    depth, and ends "length" there with the tokens of a run the pool does not bound. An
    explicit max_tokens past it, and a prompt the pool cannot hold at that depth, are still
    refused."""
    core = make_core(ckpts["huginn"], num_blocks=40, block_size=4)
    deep = 8
    held = 40 // (deep + 1) * 4 + 1  # a plane per loop, and the boundary plane: 17
    assert held < core.max_model_len and core.info.context_alone(deep) == held
    assert core.info.context_alone(None) == core.max_model_len
    prompt = [5, 6, 7]
    params = SamplingParams(
        temperature=0.0, max_tokens=None, ignore_eos=True, max_loops=deep, seed=1
    )
    run = run_core(core, [prompt], [params])
    unbounded = params.replace(max_tokens=core.max_model_len - len(prompt))
    want = oracle_run(huginn_ref, prompt, unbounded, kv_policy="last_exited")
    n = held - len(prompt)
    assert (run.tokens["r0"], run.depths["r0"]) == (want.tokens[:n], want.exit_depths[:n])
    assert run.finish["r0"] == "length"
    with pytest.raises(ValueError, match="KV blocks .* lower max_tokens or max_loops"):
        core.add_request("asked", prompt, params.replace(max_tokens=n + 1))
    with pytest.raises(ValueError, match=f"needs .* KV blocks \\({held} tokens of prompt"):
        core.add_request("long", list(range(5, 5 + held)), params)
