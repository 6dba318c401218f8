"""Serving metrics as vLLM shapes them and what the looped model adds: scoring requests that
generate nothing, loops_per_token's meaning, per-request token buckets up to the context, the
hidden vLLM series a version brings back, and a disaggregated engine's prefill-stage series.
Exact values of a known sequence and the endpoint: ``test_http_metrics.py``."""

from __future__ import annotations

import orjson
import pytest
from metrics_util import ENGINE, samples, stats
from prometheus_client.parser import text_string_to_metric_families
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
)

from rltserve.http.metrics import RequestTimeline, ServingMetrics, per_request_metrics


def test_a_scoring_update_marks_the_first_token_and_counts_no_token():
    """``generated=False`` (echo with max_tokens=0): the prompt scored is the request's first
    token moment (TTFT, queue, prefill, as vLLM observes it), but the engine's one token is
    neither a generated token nor an exit depth."""
    metrics = ServingMetrics("m")
    metrics.configure(4, lambda: (None, 0, 0), max_model_len=64)
    timeline = RequestTimeline(arrival=1.0, admitted=1.0, max_tokens=1)
    metrics.on_start(timeline, 5)
    metrics.on_tokens(timeline, 1.25, [])  # (an update without tokens: no first token yet)
    metrics.on_tokens(timeline, 1.5, [4], generated=False)
    metrics.on_tokens(timeline, 1.5, [5], generated=False)  # (a forced token's scores: no gap)
    metrics.on_finish(timeline, 1.5, "length")
    got = samples(metrics.render()[0].decode())
    m = (("model_name", "m"), ENGINE)
    expected = {
        "generation_tokens_total": 0.0, "token_exit_depth_count": 0.0, "loops_per_token": 0.0,
        "request_generation_tokens_count": 1.0, "request_generation_tokens_sum": 0.0,
        "request_max_num_generation_tokens_sum": 0.0, "inter_token_latency_seconds_count": 0.0,
        "time_to_first_token_seconds_sum": 0.5, "request_prefill_time_seconds_count": 1.0,
        "request_decode_time_seconds_sum": 0.0, "request_time_per_output_token_seconds_sum": 0.0,
        "prompt_tokens_total": 5.0,
    }  # fmt: skip
    assert {k: got[(f"rltserve:{k}", m)] for k in expected} == expected
    assert (timeline.num_tokens, metrics.num_tokens, metrics.num_prefilled) == (0, 0, 5)
    assert per_request_metrics(timeline)["tokens_per_second"] == 0.0


def test_a_two_token_requests_time_per_output_token_is_its_one_gap():
    metrics = ServingMetrics("m")
    timeline = RequestTimeline(arrival=0.0, admitted=0.0)
    metrics.on_tokens(timeline, 1.0, [1])
    metrics.on_tokens(timeline, 1.5, [1])
    metrics.on_finish(timeline, 1.5, "length")
    got = samples(metrics.render()[0].decode())
    assert (
        got[("rltserve:request_time_per_output_token_seconds_sum", (("model_name", "m"), ENGINE))]
        == 0.5
    )


async def test_scoring_requests_count_no_generated_token(tmp_path_factory):
    """Completions' echo with max_tokens=0 answers with no completion token, and /metrics
    counts none (the engine's internal one is left out), while a generating request counts
    its tokens and exit depths as its response has them."""
    ckpt = tiny_checkpoint(tmp_path_factory)
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    scoring = {"prompt": [5, 6], "echo": True, "max_tokens": 0, "return_exit_depths": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        for body in (scoring, {**scoring, "stream": True}):
            status, _, raw = await live.post("/v1/completions", body)
            assert status == 200, raw
        got = orjson.loads((await live.post("/v1/completions", scoring))[2])
        assert got["usage"]["completion_tokens"] == 0 and got["choices"][0]["exit_depths"] == []
        scored = samples((await live.get("/metrics"))[2].decode())
        body = {"prompt": [5], "max_tokens": 3, "return_exit_depths": True}
        depths = orjson.loads((await live.post("/v1/completions", body))[2])["choices"][0]
        after = samples((await live.get("/metrics"))[2].decode())
    m = (("model_name", "tiny"), ENGINE)
    zero = ("generation_tokens_total", "token_exit_depth_count", "token_exit_depth_sum",
            "loops_per_token", "request_generation_tokens_sum",
            "inter_token_latency_seconds_count")  # fmt: skip
    assert {k: scored[(f"rltserve:{k}", m)] for k in zero} == dict.fromkeys(zero, 0.0)
    assert scored[("rltserve:time_to_first_token_seconds_count", m)] == 3.0
    assert scored[("rltserve:request_generation_tokens_count", m)] == 3.0
    assert depths["exit_depths"] == [1, 2, 3]
    assert after[("rltserve:generation_tokens_total", m)] == 3.0
    assert after[("rltserve:token_exit_depth_sum", m)] == 6.0
    assert after[("rltserve:loops_per_token", m)] == 2.0


def test_loops_per_token_says_it_is_the_mean_exit_depth():
    """Its value is the mean of token_exit_depth, which its help says, pointing to the rows
    run (under kv_policy full every token loops to max_loops whatever its exit)."""
    metrics = ServingMetrics("m")
    metrics.configure(4, lambda: (stats(num_rows=40), 0, 0), max_model_len=64)
    metrics.on_tokens(RequestTimeline(0.0, 0.0), 1.0, [1, 2])
    families = {f.name: f for f in text_string_to_metric_families(metrics.render()[0].decode())}
    family = families["rltserve:loops_per_token"]
    assert family.documentation == (
        "Mean exit depth of generated tokens (the mean of token_exit_depth), not the loops run: "
        "under kv_policy full every token loops to max_loops; engine_rows_total counts rows run."
    )
    assert family.samples[0].value == 1.5
    assert families["rltserve:token_exit_depth"].documentation == (
        "Loop at which each generated token exited."
    )


def test_per_request_token_buckets_are_vllms_up_to_the_context():
    """vLLM's ``build_1_2_5_buckets(max_model_len)`` for the four per-request token
    histograms, made once the engine's context is known; a request past every bound (a
    prompt cannot be, but ``max_tokens`` may ask for more) counts in +Inf only."""
    from rltserve.http.metrics import build_1_2_5_buckets

    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    metrics = ServingMetrics("m")
    metrics.configure(4, lambda: (None, 0, 0), max_model_len=512)
    timeline = RequestTimeline(0.0, 0.0, max_tokens=1000)
    metrics.on_start(timeline, 7)
    metrics.on_tokens(timeline, 1.0, [1])
    metrics.on_finish(timeline, 2.0, "stop")
    families = {f.name: f for f in text_string_to_metric_families(metrics.render()[0].decode())}
    names = ("request_prompt_tokens", "request_generation_tokens",
             "request_max_num_generation_tokens", "request_params_max_tokens")  # fmt: skip
    bounds = ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]
    for name in names:
        les = [s.labels["le"] for s in families["rltserve:" + name].samples if "le" in s.labels]
        assert les == bounds, name
    got = samples(metrics.render()[0].decode())
    m = (("model_name", "m"), ENGINE)
    assert got[("rltserve:request_params_max_tokens_bucket", (("le", "500.0"), *m))] == 0.0
    assert got[("rltserve:request_params_max_tokens_bucket", (("le", "+Inf"), *m))] == 1.0
    assert got[("rltserve:request_prompt_tokens_bucket", (("le", "10.0"), *m))] == 1.0


def test_hidden_vllm_series_come_back_for_their_version():
    """``--show-hidden-metrics-for-version``: vLLM's deprecated names, with the values of their
    successors: ``time_per_output_token_seconds`` observes each inter-token gap,
    ``gpu_cache_usage_perc`` is the KV usage and ``gpu_prefix_cache_*`` the prefix cache's
    counters. 0.11 shows what vLLM 0.11 still exported; 0.10 also what it hid in 0.11."""
    from rltserve.http.hidden_metrics import shown_hidden_metrics

    engine = stats(kv_usage=0.5, prefix_cache_queries=30, prefix_cache_hits=12)
    m = (("model_name", "m"), ENGINE)
    got = {}
    for version in ("0.10", "0.11", "0.12", None):
        metrics = ServingMetrics("m", "vllm", shown_hidden_metrics(version))
        metrics.configure(4, lambda: (engine, 0, 0), max_model_len=64)
        timeline = RequestTimeline(0.0, 0.0)
        for now in (1.0, 1.25, 1.75):  # gaps of 0.25 and 0.5
            metrics.on_tokens(timeline, now, [2])
        got[version] = samples(metrics.render()[0].decode())
    assert {
        name: got["0.10"][("vllm:" + name, m)]
        for name in ("time_per_output_token_seconds_sum", "time_per_output_token_seconds_count",
                     "inter_token_latency_seconds_sum", "gpu_cache_usage_perc",
                     "kv_cache_usage_perc", "gpu_prefix_cache_queries_total",
                     "gpu_prefix_cache_hits_total")
    } == {
        "time_per_output_token_seconds_sum": 0.75, "time_per_output_token_seconds_count": 2.0,
        "inter_token_latency_seconds_sum": 0.75, "gpu_cache_usage_perc": 0.5,
        "kv_cache_usage_perc": 0.5, "gpu_prefix_cache_queries_total": 30.0,
        "gpu_prefix_cache_hits_total": 12.0,
    }  # fmt: skip

    def hidden(version) -> set[str]:
        names = {name for name, _ in got[version]}
        return {n for n in names if ":time_per_output_token_seconds" in n or "gpu_" in n}

    assert hidden("0.11") == {
        f"vllm:time_per_output_token_seconds_{part}" for part in ("bucket", "count", "sum")
    }
    assert hidden("0.12") == hidden(None) == set()
    assert shown_hidden_metrics("v0.9.2") == shown_hidden_metrics("0.10")
    for bad in ("latest", "0", "0.11.x", 11):
        with pytest.raises(ValueError, match="show_hidden_metrics_for_version"):
            shown_hidden_metrics(bad)


def test_a_disaggregated_prefill_stage_has_its_series_from_the_start():
    """Under ``--disaggregate`` the ``prefill_stage_*`` series read 0 until the prefill stage
    first reports (``absent()`` alerts and fresh dashboards see them); without it there are
    none."""
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
             "prefix_cache_blocks", "engine_steps_total", "prefix_cache_queries_total",
             "prefix_cache_hits_total")  # fmt: skip
    m = (("model_name", "m"), ENGINE)
    reported = {"stats": None}
    metrics = ServingMetrics("m")
    metrics.configure(
        4, lambda: (None, 0, 0), lambda: reported["stats"], max_model_len=64, disaggregated=True
    )
    got = samples(metrics.render()[0].decode())
    assert {n: got.get((f"rltserve:prefill_stage_{n}", m)) for n in names} == dict.fromkeys(
        names, 0.0
    )
    reported["stats"] = stats(num_running=2, num_steps=5)
    got = samples(metrics.render()[0].decode())
    assert got[("rltserve:prefill_stage_num_requests_running", m)] == 2.0
    assert got[("rltserve:prefill_stage_engine_steps_total", m)] == 5.0
    single = ServingMetrics("m")
    single.configure(4, lambda: (None, 0, 0), max_model_len=64)
    assert not [name for name, _ in samples(single.render()[0].decode()) if "prefill_stage" in name]
