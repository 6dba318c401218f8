"""The rest of vLLM's offline surface: its other LLM methods (each a ValueError saying what to
use), get_metrics (the engine's gauges and counters, and the request series a run counts), and
its exported names and import paths. The API itself: test_llm_vllm."""

from __future__ import annotations

import pytest

from rltserve import LLM, SamplingParams
from rltserve.outputs import CompletionOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny), in_process=True, num_blocks=128, max_model_len=256) as llm:
        yield llm


def test_vllms_other_llm_methods_say_what_to_use_instead(llm):
    for name, message in [
        ("encode", "encode: not supported: rltserve runs generative models"),
        ("embed", "embed: not supported: .*prompt_logprobs"),
        ("score", "score: not supported"),
        ("classify", "classify: not supported"),
        ("reward", "reward: not supported"),
        ("beam_search", "beam_search: not supported: .*cumulative_logprob"),
        ("start_profile", "start_profile: not supported: .*in_process=True"),
        ("stop_profile", "stop_profile: not supported"),
        ("set_tokenizer", r"set_tokenizer: not supported: .*LLM\(model, tokenizer=folder\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            getattr(llm, name)(["x"])


def test_vllms_clean_up_before_a_second_engine_stops_the_first(tiny):
    """The lines scripts run to free the device before building the next engine in the same
    process: no-ops but deleting the executor, which stops the stage as ``close()``."""
    from rltserve.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    first = LLM(str(tiny), in_process=True, num_blocks=64, max_model_len=128)
    destroy_model_parallel()
    destroy_distributed_environment()
    del first.llm_engine.model_executor
    with pytest.raises(RuntimeError):
        first.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del first.llm_engine.model_config
    with LLM(str(tiny), in_process=True, num_blocks=64, max_model_len=128) as second:
        (out,) = second.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_vllms_clean_up_calls_import_from_the_package_too():
    """vLLM's ``vllm.distributed`` holds ``parallel_state``'s names, and scripts import them
    from there (``from vllm.distributed import destroy_model_parallel``)."""
    from rltserve import distributed
    from rltserve.distributed import parallel_state

    assert distributed.destroy_model_parallel is parallel_state.destroy_model_parallel
    assert (
        distributed.destroy_distributed_environment
        is parallel_state.destroy_distributed_environment
    )


def test_get_metrics_are_vllms_gauges_and_counters(llm):
    from rltserve.core.engine_info import EngineStats
    from rltserve.llm_refusals import engine_metrics
    from rltserve.metrics_reader import Counter, Gauge

    stats = EngineStats(2, 1, 0.25, 9, 0, 0, 0.0, num_preemptions=3, prefix_cache_queries=40)
    labels = {"model_name": "m", "engine": "0"}
    assert engine_metrics(stats, "m") == [
        Gauge("vllm:num_requests_running", labels, 2.0),
        Gauge("vllm:num_requests_waiting", labels, 1.0),
        Gauge("vllm:kv_cache_usage_perc", labels, 0.25),
        Counter("vllm:num_preemptions", labels, 3),
        Counter("vllm:prefix_cache_queries", labels, 40),
        Counter("vllm:prefix_cache_hits", labels, 0),
    ]
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    names = [m.name for m in llm.get_metrics()]
    assert names[:3] == ["vllm:num_requests_running", "vllm:num_requests_waiting",
                         "vllm:kv_cache_usage_perc"]  # fmt: skip


def test_vllms_public_names_are_exported():
    import rltserve
    from rltserve.sampling import RequestOutputKind

    assert rltserve.CompletionOutput is CompletionOutput
    assert rltserve.RequestOutputKind is RequestOutputKind
    assert rltserve.TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert rltserve.TextPrompt(prompt="x") == {"prompt": "x"}


def test_vllms_import_paths_hold_the_same_objects():
    """vLLM's module paths of the offline API's names, with the package name changed."""
    import rltserve
    from rltserve import inputs, logprobs, metrics_reader, outputs, prompt_inputs, sampling
    from rltserve import sampling_params as vllm_sampling_params

    assert (inputs.TextPrompt, inputs.TokensPrompt) == (
        prompt_inputs.TextPrompt,
        prompt_inputs.TokensPrompt,
    )
    assert vllm_sampling_params.SamplingParams is sampling.SamplingParams is SamplingParams
    assert vllm_sampling_params.RequestOutputKind is sampling.RequestOutputKind
    assert logprobs.Logprob is outputs.Logprob is rltserve.Logprob
    assert "Logprob" in rltserve.__all__
    assert rltserve.Histogram is metrics_reader.Histogram
    for module in (inputs, vllm_sampling_params, logprobs):
        assert "vLLM's import path" in module.__doc__
        assert all(getattr(module, name) for name in module.__all__)


def test_get_metrics_count_the_requests_run(llm):
    """vLLM's metrics example reads them: every one a Counter, Gauge or Histogram; prompt and
    generated tokens as the outputs hold them, each sample a request."""
    from rltserve.metrics_reader import Counter, Gauge, Histogram, Vector

    def read() -> dict:
        metrics = llm.get_metrics()
        assert all(isinstance(m, (Counter, Gauge, Histogram, Vector)) for m in metrics)
        return {(m.name, m.labels.get("finished_reason")): m for m in metrics}

    before = read()
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    outs = llm.generate(prompts, [GREEDY, GREEDY.replace(n=2)], use_tqdm=False)
    first = outs[0].outputs[0].token_ids
    stopped = llm.generate([[5, 6, 7]], GREEDY.replace(stop_token_ids=[first[1]]), use_tqdm=False)
    after = read()

    def grew(name: str, reason: str | None = None) -> int:
        return after[name, reason].value - before[name, reason].value

    samples = [c for o in outs + stopped for c in o.outputs]
    assert grew("vllm:prompt_tokens") == 3 + 4 * 2 + 3
    assert grew("vllm:generation_tokens") == sum(len(c.token_ids) for c in samples)
    assert stopped[0].outputs[0].finish_reason == "stop"
    reasons = {r: grew("vllm:request_success", r) for r in ("stop", "length", "abort", "error")}
    assert reasons == {"stop": 1, "length": 3, "abort": 0, "error": 0}
    labels = {"model_name": llm._model_name, "engine": "0"}
    assert after["vllm:request_success", "stop"].labels == {**labels, "finished_reason": "stop"}
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        h, was = after[name, None], before[name, None]
        assert isinstance(h, Histogram) and h.labels == labels
        assert h.count - was.count == 4 and h.buckets["+Inf"] == h.count
        assert list(h.buckets.values()) == sorted(h.buckets.values())
    ttft, e2e = (
        after[name, None].sum - before[name, None].sum
        for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds")
    )
    assert 0 < ttft <= e2e
