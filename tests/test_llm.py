"""The offline LLM API over a stage (spawned process and in-process), and failure handling."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from engine_util import make_core, oracle_run, run_core
from recipe import load_vectors

from rltserve import LLM, SamplingParams
from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.core.request import FinishReason
from rltserve.core.stage import InProcessStageClient, StageClient, StageError

VECTORS = load_vectors()
PROMPTS = VECTORS["prompts"]


@pytest.fixture(scope="module")
def spawned(ouro_rv1):
    with LLM(str(ouro_rv1), kv_policy="full", num_blocks=64) as llm:
        yield llm


def test_spawned_stage_reproduces_vectors_in_input_order(spawned):
    case = VECTORS["cases"]["ouro_threshold_0.5"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, exit_threshold=0.5)
    outputs = spawned.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == case["tokens"]
    assert [o.exit_depths for o in outputs] == case["exit_depths"]
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert all(o.finish_reason == "length" for o in outputs)
    assert len({o.request_id for o in outputs}) == len(PROMPTS)


def test_per_prompt_params_and_logprobs(spawned, ouro_ref):
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    a, b = spawned.generate([PROMPTS[0], PROMPTS[1]], params)
    want_a = oracle_run(ouro_ref, PROMPTS[0], params[0], kv_policy="full")
    want_b = oracle_run(ouro_ref, PROMPTS[1], params[1], kv_policy="full")
    sa, sb = a.outputs[0], b.outputs[0]
    assert sa.token_ids == want_a.tokens and sb.token_ids == want_b.tokens
    assert sb.logprobs is None and sb.cumulative_logprob is None
    # vLLM's form: per token {token_id: Logprob}, the sampled token first, then the top-k.
    assert [next(iter(lp)) for lp in sa.logprobs] == sa.token_ids
    total = 0.0
    for lp, token, logits in zip(sa.logprobs, want_a.tokens, want_a.logits, strict=True):
        logp = torch.log_softmax(logits.double(), dim=-1)
        assert lp[token].logprob == pytest.approx(float(logp[token]), abs=1e-4)
        total += float(logp[token])
        values, ids = logp.topk(2)
        assert list(lp)[:2] == ids.tolist()[:2]  # greedy: the sampled token is the top-1
        assert [lp[t].rank for t in ids.tolist()] == [1, 2]
        assert [lp[t].logprob for t in ids.tolist()] == pytest.approx(values.tolist(), abs=1e-4)
        assert lp[token].decoded_token is None  # this checkpoint has no tokenizer
    assert sa.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_invalid_requests_raise_value_error(spawned):
    with pytest.raises(ValueError, match="vocabulary"):
        spawned.generate([[999]])
    with pytest.raises(ValueError, match="maximum context length"):
        spawned.generate([[1] * 600])
    # 64 blocks of 16 over 4 planes: a context of 257 tokens at the default depth ...
    with pytest.raises(
        ValueError,
        match=r"300 tokens exceed the maximum context length of 257 tokens \(what the KV pool",
    ):
        spawned.generate([[1] * 300], SamplingParams(temperature=0.0, max_tokens=200))
    # ... and at 8 loops (8 planes) half as many.
    with pytest.raises(ValueError, match="KV blocks"):
        spawned.generate([[1] * 200], SamplingParams(temperature=0.0, max_tokens=50, max_loops=8))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(temperature=0.0, max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(temperature=0.0, max_tokens=2.0)
    assert (
        SamplingParams(temperature=0.0, max_tokens=None, min_tokens=5).max_tokens is None
    )  # up to the context
    with pytest.raises(ValueError, match="no tokenizer"):
        spawned.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match="chat needs the checkpoint's tokenizer"):
        spawned.chat([{"role": "user", "content": "hi"}])
    # In a batch the refusal names its prompt's index (alone, there is nothing to find).
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, \d+\) \(prompt index 2\)$"):
        spawned.generate([[5], [6], [999], [7]])
    with pytest.raises(ValueError, match=r"length of 257 tokens .*\) \(prompt index 1\)$"):
        spawned.generate([[5], [1] * 300], SamplingParams(temperature=0.0, max_tokens=200))
    with pytest.raises(ValueError, match="max_loops") as err:  # (the settings': no index)
        spawned.generate([[5], [6]], SamplingParams(temperature=0.0, max_tokens=2, max_loops=99))
    assert "prompt index" not in str(err.value)
    with pytest.raises(ValueError, match="prompt_logprobs") as err:  # (a setting, too)
        spawned.generate([[5], [6]], SamplingParams(max_tokens=2, prompt_logprobs=10**6))
    assert "prompt index" not in str(err.value)
    with pytest.raises(ValueError, match=r"outside the vocabulary .*\(prompt index 0\)$"):
        spawned.generate([[999], [6]])
    # The stage keeps serving after rejections.
    assert (
        len(spawned.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=2))[0].token_ids)
        == 2
    )


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

        client.add_request(
            "long",
            [1, 2, 3],
            SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
            sink,
        )
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
    core.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    updates = []
    while core.has_work():
        updates.extend(core.step())
    assert updates[-1].finish_reason is FinishReason.ERROR
    assert "injected failure" in updates[-1].error
    core.kv.check_no_leaks()
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
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

        client.add_request(
            "x", [4, 5], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), sink
        )
        client.abort("x")
        assert done.wait(30)
        assert got[-1].finish_reason is FinishReason.ABORT
        with pytest.raises(ValueError, match="already in use"):
            client.add_request("y", [1], SamplingParams(temperature=0.0), sink)
            client.add_request("y", [1], SamplingParams(temperature=0.0), sink)
    finally:
        client.close()
    assert client.stats is not None and client.stats.kv_usage == 0.0


def _unbuildable(src, dst):
    """A copy of ``src`` whose config.json names a model type no family has."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f.resolve())
    (dst / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "nope"}))
    return dst


@pytest.mark.parametrize("client_cls", [InProcessStageClient, StageClient])
def test_stage_build_error_reaches_the_caller(ouro_rv1, tmp_path, client_cls):
    bad = _unbuildable(ouro_rv1, tmp_path / "bad")
    client = client_cls(EngineConfig.from_flat(model=str(bad), num_blocks=64))
    try:
        with pytest.raises(StageError, match="nope") as refused:
            client.wait_ready(120)
        # (a checkpoint the loader refuses: a ValueError too, in the loader's words)
        assert isinstance(refused.value, ValueError), refused.value
        assert not str(refused.value).startswith("stage failed"), refused.value
        assert not client.alive
        with pytest.raises(StageError, match="not running"):
            client.add_request("x", [1], SamplingParams(temperature=0.0), lambda u: None)
    finally:
        client.close()


def test_engine_loop_crash_fails_requests_and_the_stage(ouro_rv1, monkeypatch):
    # Not a failed step (that fails only its requests): the loop itself raises.
    calls = {"n": 0}
    apply = EngineCore.apply

    def crashing(self, plan, result):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("apply exploded")
        return apply(self, plan, result)

    monkeypatch.setattr(EngineCore, "apply", crashing)
    client = InProcessStageClient(EngineConfig.from_flat(model=str(ouro_rv1), num_blocks=256))
    try:
        client.wait_ready(60)
        done = threading.Event()
        got = []

        def sink(update):
            got.append(update)
            if update.finish_reason is not None:
                done.set()

        client.add_request(
            "x", [4, 5], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), sink
        )
        assert done.wait(30), "request hung after the engine loop crashed"
        assert got[-1].finish_reason is FinishReason.ERROR
        assert "stage died" in got[-1].error and "apply exploded" in got[-1].error
        assert not client.alive
        with pytest.raises(StageError):
            client.add_request("y", [1], SamplingParams(temperature=0.0), sink)
    finally:
        client.close()


def test_shutdown_with_steps_in_flight_aborts_every_request(ouro_rv1):
    config = EngineConfig.from_flat(
        model=str(ouro_rv1), num_blocks=256, async_scheduling=True, exit_mode="delayed"
    )
    client = InProcessStageClient(config)
    client.wait_ready(60)
    finished: dict[str, FinishReason] = {}
    counts = {f"r{i}": 0 for i in range(4)}
    started = threading.Event()
    all_done = threading.Event()

    def sink(update):
        counts[update.request_id] += len(update.new_token_ids)
        if sum(counts.values()) >= 8:
            started.set()
        if update.finish_reason is not None:
            finished[update.request_id] = update.finish_reason
            if len(finished) == len(counts):
                all_done.set()

    for rid in counts:
        client.add_request(
            rid, [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), sink
        )
    assert started.wait(60), "no tokens arrived"
    client.close(timeout=30)
    assert not client._thread.is_alive(), "the stage thread did not end"
    assert all_done.wait(5), finished
    assert set(finished.values()) == {FinishReason.ABORT}
    assert all(n < 400 for n in counts.values())  # ended by the shutdown, not by length
    assert client.stats.kv_usage == 0.0 and client.stats.num_running == 0


def test_a_missing_checkpoint_or_device_is_a_value_error_before_any_stage(tmp_path, ouro_rv1):
    with pytest.raises(ValueError, match=r"model='/no/such/dir': no such checkpoint directory"):
        LLM("/no/such/dir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path / "empty"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda': CUDA is not available"):
            LLM(str(ouro_rv1), device="cuda")


def test_a_failed_start_stops_the_stage_it_started(tiny, monkeypatch):
    """The stage starts before the tokenizer loads: a load that fails (or a Ctrl-C then) must
    not leave it running."""
    import rltserve.llm as llm_module

    started = []
    make_client = llm_module.stage_client
    monkeypatch.setattr(
        llm_module, "stage_client", lambda *a: started.append(make_client(*a)) or started[-1]
    )

    def broken(path):
        raise RuntimeError("the tokenizer broke")

    monkeypatch.setattr(llm_module, "load_tokenizer", broken)
    with pytest.raises(RuntimeError, match="the tokenizer broke"):
        LLM(str(tiny), in_process=True, num_blocks=64)
    (client,) = started
    client._thread.join(60)
    assert not client._thread.is_alive()


def test_a_rejected_prompt_aborts_the_requests_of_its_batch(tiny):
    slow = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with LLM(str(tiny), in_process=True, num_blocks=64, max_model_len=256) as llm:
        with pytest.raises(ValueError, match="maximum context length"):
            llm.generate([[1, 2], [1] * 300], slow)
        # The first prompt's request was aborted before the error came: none is left running.
        llm.sleep(timeout=0)
        assert llm.is_sleeping()


def test_a_closed_llm_says_so(tiny):
    llm = LLM(str(tiny), in_process=True, num_blocks=64, max_model_len=128)
    llm.close()
    for call in (
        lambda: llm.generate([[1, 2]], SamplingParams(max_tokens=2)),
        llm.sleep,
        llm.wake_up,
        llm.reset_prefix_cache,
        lambda: llm.llm_engine.reset_prefix_cache(),
    ):
        with pytest.raises(StageError, match=r"^this LLM is closed \(close\(\) was called\)$"):
            call()


def test_a_prompt_that_fills_the_context_gets_one_token_whatever_max_tokens(tiny):
    """vLLM's offline check refuses only a prompt longer than the context: one that fills it
    gets the one token its last position predicts, ending "length"."""
    with LLM(str(tiny), in_process=True, max_model_len=32) as llm:
        for max_tokens in (1, 2, None, 5):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            out = llm.generate([[1] * 32], params)[0].outputs[0]
            assert (len(out.token_ids), out.finish_reason) == (1, "length"), max_tokens
        with pytest.raises(ValueError, match="^prompt: 33 tokens exceed the maximum context "):
            llm.generate([[1] * 33], params)
