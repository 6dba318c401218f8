"""The offline LLM API over a stage (spawned process and in-process), and failure handling."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_util import make_core, oracle_run, run_core
from recipe import load_vectors

from rltserve import LLM, SamplingParams
from rltserve.config import EngineConfig
from rltserve.core.request import FinishReason
from rltserve.core.stage import InProcessStageClient, StageClient

VECTORS = load_vectors()
PROMPTS = VECTORS["prompts"]


@pytest.fixture(scope="module")
def spawned(ouro_rv1):
    with LLM(str(ouro_rv1), kv_policy="full", num_blocks=64) as llm:
        yield llm


def test_spawned_stage_reproduces_vectors_in_input_order(spawned):
    case = VECTORS["cases"]["ouro_threshold_0.5"]
    params = SamplingParams(max_tokens=16, ignore_eos=True, exit_threshold=0.5)
    outputs = spawned.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == case["tokens"]
    assert [o.exit_depths for o in outputs] == case["exit_depths"]
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert all(o.finish_reason == "length" for o in outputs)
    assert len({o.request_id for o in outputs}) == len(PROMPTS)


def test_per_prompt_params_and_logprobs(spawned, ouro_ref):
    params = [
        SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=5, ignore_eos=True),
    ]
    a, b = spawned.generate([PROMPTS[0], PROMPTS[1]], params)
    want_a = oracle_run(ouro_ref, PROMPTS[0], params[0], kv_policy="full")
    want_b = oracle_run(ouro_ref, PROMPTS[1], params[1], kv_policy="full")
    assert a.token_ids == want_a.tokens and b.token_ids == want_b.tokens
    assert b.logprobs is None
    assert [lp["token_id"] for lp in a.logprobs] == a.token_ids
    for lp, token, logits in zip(a.logprobs, want_a.tokens, want_a.logits, strict=True):
        logp = torch.log_softmax(logits.double(), dim=-1)
        assert lp["logprob"] == pytest.approx(float(logp[token]), abs=1e-4)
        values, ids = logp.topk(2)
        assert [t for t, _ in lp["top_logprobs"]] == ids.tolist()
        assert [v for _, v in lp["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)


def test_invalid_requests_raise_value_error(spawned):
    with pytest.raises(ValueError, match="vocabulary"):
        spawned.generate([[999]])
    with pytest.raises(ValueError, match="context limit"):
        spawned.generate([[1] * 600])
    with pytest.raises(ValueError, match="KV blocks"):
        spawned.generate([[1] * 300], SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="no tokenizer"):
        spawned.generate("text needs a tokenizer")
    # The stage keeps serving after rejections.
    assert len(spawned.generate([[5, 6]], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_stage_crash_fails_requests_instead_of_hanging(ouro_rv1):
    client = StageClient(EngineConfig.from_flat(model=str(ouro_rv1), num_blocks=64))
    try:
        client.wait_ready(120)
        got: list = []
        done = threading.Event()

        def sink(update):
            got.append(update)
            if update.finish_reason is not None:
                done.set()

        client.add_request("long", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), sink)
        client.kill()
        assert done.wait(30), "request hung after the worker died"
        assert got[-1].finish_reason is FinishReason.ERROR
        assert "stage died" in got[-1].error
        assert not client.alive
    finally:
        client.close()


def test_failed_step_fails_its_requests_and_engine_keeps_serving(ouro_rv1, ouro_ref, monkeypatch):
    core = make_core(ouro_rv1)
    loop = core.model.loop
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return loop(*args)

    monkeypatch.setattr(core.model, "loop", flaky)
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    updates = []
    while core.has_work():
        updates.extend(core.step())
    assert updates[-1].finish_reason is FinishReason.ERROR
    assert "injected failure" in updates[-1].error
    core.kv.check_no_leaks()
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    run = run_core(core, [[1, 2, 3]], [p])
    assert run.tokens["r0"] == oracle_run(ouro_ref, [1, 2, 3], p, kv_policy="last_exited").tokens


def test_in_process_client_and_abort(ouro_rv1):
    client = InProcessStageClient(EngineConfig.from_flat(model=str(ouro_rv1), num_blocks=256))
    try:
        client.wait_ready(60)
        done = threading.Event()
        got: list = []

        def sink(update):
            got.append(update)
            if update.finish_reason is not None:
                done.set()

        client.add_request("x", [4, 5], SamplingParams(max_tokens=200, ignore_eos=True), sink)
        client.abort("x")
        assert done.wait(30)
        assert got[-1].finish_reason is FinishReason.ABORT
        with pytest.raises(ValueError, match="already in use"):
            client.add_request("y", [1], SamplingParams(), sink)
            client.add_request("y", [1], SamplingParams(), sink)
    finally:
        client.close()
    assert client.stats is not None and client.stats.kv_usage == 0.0
