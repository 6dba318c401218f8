"""The serving metrics on prometheus-client: exact values of a known sequence of events, a
registry per app, the standard process/GC collectors and content negotiation."""

from __future__ import annotations

import asyncio
import gzip

import orjson
from metrics_util import ENGINE, samples, stats
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    tiny_checkpoint,
)

from rltserve.http.metrics import (
    RequestTimeline,
    SampleGroup,
    ServingMetrics,
    per_request_metrics,
)


def test_values_of_a_known_sequence():
    metrics = ServingMetrics("m")
    engine = stats(
        num_running=3, num_waiting=1, kv_usage=0.25, num_steps=4, num_rows=10,
        num_preemptions=5, swap_fallbacks=1, num_swapped=2, num_recomputing=1, swapped_bytes=4096,
        prefix_cache_queries=40, prefix_cache_hits=24, prefix_cache_blocks=12, kv_transfer_hits=16,
        prefix_cache_evictions=3, kv_transfer_unused=6, kv_transfer_skipped=5,
        step_rows_counts=(1, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        step_tokens_counts=(3, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), num_step_tokens=11,
    )  # fmt: skip
    cache = {"block_size": "16", "num_gpu_blocks": "160", "kv_planes": "4"}
    metrics.configure(4, lambda: (engine, 2, 3), cache_info=cache, max_model_len=64)
    timeline = RequestTimeline(arrival=10.0, admitted=10.5, max_tokens=3)
    metrics.on_start(timeline, 7)
    timeline.engine_queued = 0.25  # (the first token's update: it waited 0.25 s in the engine)
    timeline.num_cached_tokens = 4
    metrics.on_tokens(timeline, 11.0, [4])  # first token: TTFT 1.0
    metrics.on_tokens(timeline, 11.25, [2, 3])  # ITL 0.25
    metrics.on_finish(timeline, 12.0, "length")
    metrics.on_http("/v1/completions", "POST", 200, 0.75)
    body, content_type = metrics.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    got = samples(body.decode())
    m = (("model_name", "m"), ENGINE)
    expected = {
        ("rltserve:prompt_tokens_total", m): 7.0,
        ("rltserve:generation_tokens_total", m): 3.0,
        ("rltserve:request_success_total", (("finished_reason", "length"),) + m): 1.0,
        ("rltserve:http_requests_total",
         (("handler", "/v1/completions"), ("method", "POST"), ("status", "200"))): 1.0,
        ("rltserve:time_to_first_token_seconds_sum", m): 1.0,
        ("rltserve:inter_token_latency_seconds_sum", m): 0.25,
        ("rltserve:e2e_request_latency_seconds_sum", m): 2.0,
        # Arrival 10.0, admitted 10.5, first scheduled 10.75 (the engine's 0.25 s), first
        # token 11.0, finish 12.0: queue + prefill + decode = e2e.
        ("rltserve:request_queue_time_seconds_sum", m): 0.75,
        ("rltserve:request_prefill_time_seconds_sum", m): 0.25,
        ("rltserve:request_decode_time_seconds_sum", m): 1.0,
        ("rltserve:request_inference_time_seconds_sum", m): 1.25,  # prefill + decode
        ("rltserve:request_time_per_output_token_seconds_sum", m): 0.5,  # 1.0 s / (3 - 1)
        ("rltserve:request_max_num_generation_tokens_sum", m): 3.0,
        ("rltserve:request_params_n_sum", m): 1.0,
        ("rltserve:request_params_max_tokens_sum", m): 3.0,
        ("rltserve:prompt_tokens_cached_total", m): 4.0,
        ("rltserve:http_request_duration_seconds_sum",
         (("handler", "/v1/completions"), ("method", "POST"))): 0.75,
        ("rltserve:engine_sleep_state", (*m, ("sleep_state", "awake"))): 1.0,
        ("rltserve:engine_sleep_state", (*m, ("sleep_state", "weights_offloaded"))): 0.0,
        ("rltserve:engine_sleep_state", (*m, ("sleep_state", "discard_all"))): 0.0,
        # Every finished_reason has its series from the start (vLLM's).
        ("rltserve:request_success_total", (("finished_reason", "stop"),) + m): 0.0,
        ("rltserve:request_success_total", (("finished_reason", "abort"),) + m): 0.0,
        ("rltserve:request_success_total", (("finished_reason", "error"),) + m): 0.0,
        ("rltserve:request_prompt_tokens_sum", m): 7.0,
        ("rltserve:request_generation_tokens_sum", m): 3.0,
        ("rltserve:token_exit_depth_count", m): 3.0,
        ("rltserve:token_exit_depth_bucket", (("le", "2.0"),) + m): 1.0,
        ("rltserve:token_exit_depth_bucket", (("le", "3.0"),) + m): 2.0,
        ("rltserve:token_exit_depth_bucket", (("le", "4.0"),) + m): 3.0,
        ("rltserve:loops_per_token", m): 3.0,
        ("rltserve:num_requests_running", m): 3.0,
        ("rltserve:num_requests_waiting", m): 3.0,  # the engine's 1 + the server's 2
        ("rltserve:kv_cache_usage_perc", m): 0.25,
        ("rltserve:rows_per_step", m): 2.5,
        ("rltserve:engine_steps_total", m): 4.0,
        ("rltserve:engine_rows_total", m): 10.0,
        ("rltserve:num_preemptions_total", m): 5.0,
        ("rltserve:swap_fallbacks_total", m): 1.0,
        ("rltserve:num_requests_swapped", m): 2.0,
        ("rltserve:num_requests_recomputing", m): 1.0,
        ("rltserve:swapped_bytes", m): 4096.0,
        ("rltserve:prefix_cache_queries_total", m): 40.0,
        ("rltserve:prefix_cache_hits_total", m): 24.0,
        ("rltserve:prefix_cache_evictions_total", m): 3.0,
        ("rltserve:kv_transfer_hits_total", m): 16.0,
        ("rltserve:kv_transfer_unused_total", m): 6.0,
        ("rltserve:kv_transfer_skipped_total", m): 5.0,
        ("rltserve:prefix_cache_blocks", m): 12.0,
        ("rltserve:weight_version", m): 3.0,
        # Steps by tokens (vLLM's iteration_tokens_total): three of at most 1 (a looped
        # model's step may output none), one of 9..16, 11 in all ...
        ("rltserve:iteration_tokens_total_bucket", (("le", "1.0"),) + m): 3.0,
        ("rltserve:iteration_tokens_total_bucket", (("le", "8.0"),) + m): 3.0,
        ("rltserve:iteration_tokens_total_bucket", (("le", "16.0"),) + m): 4.0,
        ("rltserve:iteration_tokens_total_bucket", (("le", "+Inf"),) + m): 4.0,
        ("rltserve:iteration_tokens_total_count", m): 4.0,
        ("rltserve:iteration_tokens_total_sum", m): 11.0,
        # ... and by rows: one of 1 row, three of 2..8 (their sum engine_rows_total).
        ("rltserve:iteration_rows_bucket", (("le", "1.0"),) + m): 1.0,
        ("rltserve:iteration_rows_bucket", (("le", "8.0"),) + m): 4.0,
        ("rltserve:iteration_rows_bucket", (("le", "+Inf"),) + m): 4.0,
        ("rltserve:iteration_rows_count", m): 4.0,
        ("rltserve:iteration_rows_sum", m): 10.0,
        ("rltserve:cache_config_info",
         (("block_size", "16"), ("kv_planes", "4"), *m, ("num_gpu_blocks", "160"))): 1.0,
    }  # fmt: skip
    assert {k: got.get(k) for k in expected} == expected
    # vLLM's labels on every series but the HTTP ones (its instrumentator's) and the standard
    # collectors'; no prefill stage's series without disaggregation, no hidden vLLM series
    assert {
        name for (name, labels) in got if name.startswith("rltserve:") and ENGINE not in labels
    } == {"rltserve:http_requests_total"} | {
        f"rltserve:http_request_duration_seconds_{part}" for part in ("bucket", "count", "sum")
    }
    assert not [name for name, _ in got if "prefill_stage" in name or "gpu_" in name]
    assert not [name for name, _ in got if ":time_per_output_token_seconds" in name]
    # the standard collectors come with every app's registry; no ``_created`` series (vLLM's)
    names = {name for name, _ in got}
    assert not [name for name in names if name.endswith("_created")]
    assert (
        b"_created"
        not in metrics.render("application/openmetrics-text; version=1.0.0; escaping=allow-utf-8")[
            0
        ]
    )
    assert "python_gc_objects_collected_total" in names and "python_info" in names
    assert "process_cpu_seconds_total" in names and "process_resident_memory_bytes" in names


def test_exit_depth_buckets_stay_few_for_deep_models():
    from rltserve.http.metrics import depth_buckets

    assert depth_buckets(4) == [1, 2, 3, 4]
    assert depth_buckets(256) == [*range(1, 33), 64, 128, 256]  # Huginn's cap: 35, not 256
    assert depth_buckets(40)[-2:] == [32, 40]


def test_each_app_has_its_own_registry():
    a, b = ServingMetrics("a"), ServingMetrics("b")
    for metrics in (a, b):
        metrics.configure(2, lambda: (None, 0, 0), max_model_len=64)
    a.on_start(RequestTimeline(0.0, 0.0), 5)
    got_a, got_b = samples(a.render()[0].decode()), samples(b.render()[0].decode())
    assert got_a[("rltserve:prompt_tokens_total", (("model_name", "a"), ENGINE))] == 5.0
    assert got_b[("rltserve:prompt_tokens_total", (("model_name", "b"), ENGINE))] == 0.0
    assert not any(("model_name", "a") in labels for _, labels in got_b)


async def test_metrics_endpoint_negotiates_openmetrics(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        assert (await live.post("/v1/completions", {"prompt": [5], "max_tokens": 2}))[0] == 200
        status, headers, raw = await live.get("/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        got = samples(raw.decode())
        assert got[("rltserve:generation_tokens_total", (("model_name", "tiny"), ENGINE))] == 2.0
        # OpenMetrics where names go unescaped (Prometheus 3's Accept) ...
        accept = {"Accept": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8"}
        status, headers, raw = await live.get("/metrics", headers=accept)
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        assert raw.endswith(b"# EOF\n") and b"\nrltserve:generation_tokens_total{" in raw
        # ... else text 0.0.4 (Prometheus 2.x's default Accept would get rltserve_* names).
        prometheus2 = (
            "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;"
            "version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
        )
        for accept in (prometheus2, "application/openmetrics-text; version=1.0.0"):
            status, headers, raw = await live.get("/metrics", headers={"Accept": accept})
            assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
            key = ("rltserve:generation_tokens_total", (("model_name", "tiny"), ENGINE))
            assert samples(raw.decode())[key] == 2.0


def test_queue_and_prefill_split_at_the_first_scheduling():
    """A request that waited in the engine (for a seat or KV blocks) counts that wait as queue
    time, not prefill; an engine wait its own clock overstates is capped at what this clock
    saw; a request that never got a token observes none of the three (as vLLM, which splits
    finished requests' time)."""
    metrics = ServingMetrics("m")
    waited = RequestTimeline(arrival=0.0, admitted=0.04, engine_queued=12.5)
    metrics.on_start(waited, 250)
    metrics.on_tokens(waited, 12.75, [4])
    metrics.on_finish(waited, 20.0, "stop")
    overstated = RequestTimeline(arrival=100.0, admitted=100.5, engine_queued=9.0)
    metrics.on_start(overstated, 3)
    metrics.on_tokens(overstated, 101.0, [4])
    metrics.on_finish(overstated, 102.0, "stop")
    never = RequestTimeline(arrival=200.0, admitted=200.0)
    metrics.on_start(never, 3)
    metrics.on_finish(never, 230.0, "abort")
    got = samples(metrics.render()[0].decode())
    m = (("model_name", "m"), ENGINE)
    series = ("request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds")  # fmt: skip
    assert {name: got[(f"rltserve:{name}_count", m)] for name in series} == dict.fromkeys(
        series, 2.0
    )
    # 0.04 + 12.5 and 0.5 + 0.5 (all it spent before its first token); 0.21 and 0.0
    assert got[("rltserve:request_queue_time_seconds_sum", m)] == 12.54 + 1.0
    assert round(got[("rltserve:request_prefill_time_seconds_sum", m)], 9) == 0.21
    assert got[("rltserve:request_decode_time_seconds_sum", m)] == 7.25 + 1.0
    assert got[("rltserve:e2e_request_latency_seconds_count", m)] == 3.0
    # vLLM's TPOT: every finished request that got a token, 0 for a single token
    assert got[("rltserve:request_time_per_output_token_seconds_count", m)] == 2.0
    assert got[("rltserve:request_time_per_output_token_seconds_sum", m)] == 0.0
    # A negative engine wait (another clock) is none: scheduled as it went to the stage
    skewed = RequestTimeline(arrival=0.0, admitted=1.0, engine_queued=-0.5, first_token=2.0)
    assert skewed.scheduled == 1.0


def test_the_vllm_prefix_names_every_series():
    """``--metrics-prefix vllm``: vLLM's dashboards query ``vllm:num_requests_waiting`` and the
    like; every series of the app (looped-model ones too) then has that prefix."""
    metrics = ServingMetrics("m", prefix="vllm")
    metrics.configure(
        4, lambda: (stats(num_waiting=2), 1, 0), lambda: stats(), {"x": "1"}, max_model_len=64
    )
    timeline = RequestTimeline(0.0, 0.0)
    metrics.on_start(timeline, 5)
    metrics.on_tokens(timeline, 1.0, [3])
    metrics.on_finish(timeline, 2.0, "stop")
    metrics.on_http("/v1/completions", "POST", 200, 0.25)
    metrics.on_http("unmatched", "GET", 404, 2.0)
    metrics.on_http("/v1/completions", "POST", 499, 0.5)
    # (the instrumentator's excluded routes)
    for probe in ("/metrics", "/metrics/", "/health", "/ping", "/version"):
        metrics.on_http(probe, "GET", 200, 0.01)
    metrics.stage_restarts.inc()
    got = samples(metrics.render()[0].decode())
    m = (("model_name", "m"), ENGINE)
    assert got[("vllm:num_requests_waiting", m)] == 3.0
    assert got[("vllm:request_queue_time_seconds_count", m)] == 1.0
    assert got[("vllm:cache_config_info", (*m, ("x", "1")))] == 1.0
    # The HTTP series as prometheus-fastapi-instrumentator names them (vLLM's): unprefixed,
    # status classes, unmatched routes as "none".
    http = {key: value for key, value in got.items() if key[0].startswith("http_")}
    post = (("handler", "/v1/completions"), ("method", "POST"))
    assert {key: http[key] for key in http if key[0] == "http_requests_total"} == {
        ("http_requests_total", (post[0], post[1], ("status", "2xx"))): 1.0,
        ("http_requests_total", (post[0], post[1], ("status", "4xx"))): 1.0,
        ("http_requests_total", (("handler", "none"), ("method", "GET"), ("status", "4xx"))): 1.0,
    }
    assert http[("http_request_duration_seconds_bucket", (post[0], ("le", "0.5"), post[1]))] == 2
    assert http[("http_request_duration_seconds_sum", post)] == 0.75
    assert http[("http_request_duration_highr_seconds_count", ())] == 3.0  # (no probe counted)
    assert http[("http_request_duration_highr_seconds_bucket", (("le", "1.5"),))] == 2.0
    ours = {name for name, _ in got if not name.startswith(("python_", "process_", "http_"))}
    assert ours and all(name.startswith("vllm:") for name in ours)
    looped = ("token_exit_depth_count", "loops_per_token", "prefill_stage_num_requests_running")
    others = ("stage_restarts_total", "iteration_tokens_total_count")
    for name in looped + others:
        assert "vllm:" + name in ours, name


class _WaitedStage(ScriptedStage):
    """A scripted stage whose first update of each request says it waited ``queued_s`` in
    the engine before its first scheduling."""

    def __init__(self, info, script, queued_s: float) -> None:
        super().__init__(info, script)
        self.queued_s = queued_s

    def add_request(self, request_id, prompt_token_ids, params, sink, group=None) -> None:
        first = [True]

        def waited(update) -> None:
            if first[0] and update.new_token_ids:
                first[0] = False
                update.queued_s = self.queued_s
            sink(update)

        super().add_request(request_id, prompt_token_ids, params, waited, group)


async def test_the_server_takes_the_engine_wait_and_names_series_as_configured(
    tmp_path_factory, caplog, monkeypatch
):
    """The engine's wait reaches the queue time through the stage: one the front end's clock
    cannot have seen (a million seconds) leaves no prefill time at all. ``metrics_prefix``
    names the series; ``cache_config_info`` has the pool's facts; the start log gives the
    pool in tokens (at the scripted engine's one plane, 64 blocks of 16), and the stats line
    comes every ``VLLM_LOG_STATS_INTERVAL`` seconds."""
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.05")
    ckpt = tiny_checkpoint(tmp_path_factory)
    stage = _WaitedStage(scripted_info(ckpt), Script([44]), queued_s=1e6)
    caplog.set_level("INFO", logger="rltserve.http")
    factory = scripted_factory(stage)
    async with running(ckpt, client_factory=factory, metrics_prefix="vllm") as live:
        assert (await live.post("/v1/completions", {"prompt": [5], "max_tokens": 2}))[0] == 200
        got = samples((await live.get("/metrics"))[2].decode())
        assert live.state._stats_log is not None  # (vLLM's periodic line, by default)
        for _ in range(200):
            if any(m.startswith("Engine 000: Avg prompt throughput: ") for m in caplog.messages):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("no stats line within 2 s at a 0.05 s interval")
    m = (("model_name", "tiny"), ENGINE)
    assert got[("vllm:request_queue_time_seconds_count", m)] == 1.0
    assert got[("vllm:request_prefill_time_seconds_count", m)] == 1.0
    assert got[("vllm:request_prefill_time_seconds_sum", m)] == 0.0
    info = {key: value for key, value in got.items() if key[0] == "vllm:cache_config_info"}
    assert info == {
        ("vllm:cache_config_info", (
            ("block_size", "16"), ("cache_dtype", "float32"), ("enable_prefix_caching", "True"),
            ENGINE,
            ("kv_capacity_tokens", "1024"), ("kv_planes", "1"), ("kv_policy", "last_exited"),
            ("model_name", "tiny"), ("num_gpu_blocks", "64"), ("swap_space", "4.0"),
        )): 1.0,
    }  # fmt: skip
    logged = [r.getMessage() for r in caplog.records]
    assert "Maximum concurrency for 64 tokens per request: 16.00x" in logged
    async with running(ckpt, client_factory=factory, disable_log_stats=True) as live:
        assert live.state._stats_log is None


def test_the_samples_of_a_prompt_count_once_as_it_finishes():
    """vLLM's parent request: ``request_params_n`` and ``request_max_num_generation_tokens``
    observe a prompt once its last sample finished; ``request_params_max_tokens`` observes each
    sample that has one."""
    metrics = ServingMetrics("m")
    metrics.configure(4, lambda: (None, 0, 0), max_model_len=64)
    group = SampleGroup(n=2, unfinished=2)
    short, long = (RequestTimeline(0.0, 0.0, max_tokens=8, group=group) for _ in range(2))
    metrics.on_tokens(short, 1.0, [1])
    metrics.on_tokens(long, 1.0, [1, 2, 3])
    metrics.on_finish(long, 2.0, "length")  # (the longest first: the most is kept)
    m = (("model_name", "m"), ENGINE)
    got = samples(metrics.render()[0].decode())
    assert got[("rltserve:request_params_n_count", m)] == 0.0
    metrics.on_finish(short, 3.0, "stop")
    unbounded = RequestTimeline(0.0, 0.0)  # (no max_tokens: not observed, as vLLM)
    metrics.on_finish(unbounded, 4.0, "abort")
    got = samples(metrics.render()[0].decode())
    assert {name: got[(f"rltserve:{name}", m)] for name in (
        "request_params_n_count", "request_params_n_sum", "request_max_num_generation_tokens_sum",
        "request_params_max_tokens_count", "request_params_max_tokens_sum",
    )} == {
        "request_params_n_count": 2.0, "request_params_n_sum": 3.0,  # n=2, then n=1
        "request_max_num_generation_tokens_sum": 3.0 + 0.0,
        "request_params_max_tokens_count": 2.0, "request_params_max_tokens_sum": 16.0,
    }  # fmt: skip


def test_per_request_metrics_are_vllms():
    """vLLM's ``build_per_request_timing_metrics``: TTFT from the first scheduling, generation
    from the first token to the last, tokens per second from the scheduling on."""
    timeline = RequestTimeline(arrival=1.0, admitted=1.25, engine_queued=0.25)
    metrics = ServingMetrics("m")
    assert per_request_metrics(timeline) == dict.fromkeys(
        ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
         "tokens_per_second")
    )  # fmt: skip
    metrics.on_tokens(timeline, 2.0, [1])
    assert per_request_metrics(timeline) == {
        "time_to_first_token_ms": 500.0, "generation_time_ms": 0.0, "queue_time_ms": 500.0,
        "mean_itl_ms": None, "tokens_per_second": 2.0,
    }  # fmt: skip
    metrics.on_tokens(timeline, 3.0, [1] * 9)
    assert per_request_metrics(timeline) == {
        "time_to_first_token_ms": 500.0, "generation_time_ms": 1000.0, "queue_time_ms": 500.0,
        "mean_itl_ms": 1.0 / 9 * 1000, "tokens_per_second": 10 / 1.5,
    }  # fmt: skip
    # An engine wait overstated up to the one token: no time to divide by, no rate
    capped = RequestTimeline(arrival=0.0, admitted=0.5, engine_queued=9.0)
    metrics.on_tokens(capped, 1.0, [1])
    assert per_request_metrics(capped)["tokens_per_second"] is None
    assert per_request_metrics(capped)["queue_time_ms"] == 1000.0


async def test_metrics_gzip_when_asked(tmp_path_factory):
    """As prometheus_client's own handlers: gzip where the scraper accepts it."""
    ckpt = tiny_checkpoint(tmp_path_factory)
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        plain = await live.get("/metrics", headers={"Accept-Encoding": "identity"})
        zipped = await live.get(
            "/metrics", headers={"Accept-Encoding": "gzip, deflate"}, auto_decompress=False
        )
    assert "Content-Encoding" not in plain[1] and zipped[1]["Content-Encoding"] == "gzip"
    key = (
        "rltserve:request_success_total",
        (("finished_reason", "stop"), ("model_name", "tiny"), ENGINE),
    )
    assert samples(gzip.decompress(zipped[2]).decode())[key] == 0.0
    assert len(zipped[2]) < len(plain[2]) / 4


async def test_per_request_metrics_in_the_body(tmp_path_factory):
    """``--enable-per-request-metrics``: vLLM's ``metrics`` object after ``usage`` (a stream's
    in its final usage chunk), only where one prompt is sampled once."""
    ckpt = tiny_checkpoint(tmp_path_factory)
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    keys = ["time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
            "tokens_per_second"]  # fmt: skip
    factory = scripted_factory(stage)
    body = {"prompt": [5], "max_tokens": 3}
    async with running(ckpt, client_factory=factory, enable_per_request_metrics=True) as live:
        got = orjson.loads((await live.post("/v1/completions", body))[2])
        assert list(got)[-3:] == ["usage", "metrics", "metadata"] and list(got["metrics"]) == keys
        assert all(isinstance(v, float) and v >= 0 for v in got["metrics"].values())
        got = orjson.loads((await live.post("/v1/completions", {**body, "n": 2}))[2])
        assert "metrics" not in got
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with live.stream("/v1/completions", stream) as r:
            chunks = sse_payloads(await r.read())
        assert [list(c) for c in chunks[:-2] if "metrics" in c] == []
        assert list(chunks[-2])[-2:] == ["usage", "metrics"] and list(chunks[-2]["metrics"]) == keys
    async with running(ckpt, client_factory=factory) as live:
        assert "metrics" not in orjson.loads((await live.post("/v1/completions", body))[2])
