"""What the server logs about its engine as vLLM logs it (``rltserve.http.stats_log``): the KV
pool's capacity in tokens at start (a looped model's token takes a block slot on each of its
KV planes), and the periodic stats line over each interval, only while there is something to
report. Exact lines from made-up stats and a hand-advanced clock."""

from __future__ import annotations

import dataclasses

from rltserve.core.engine_info import EngineInfo, EngineStats
from rltserve.http.metrics import RequestTimeline, ServingMetrics
from rltserve.http.stats_log import StatsLog, kv_capacity_lines, log_stats_interval


def _info(**facts) -> EngineInfo:
    base = dict(
        model_path="/m", family="ouro", num_loops=4, max_loops=4, max_model_len=512,
        vocab_size=512, eos_token_ids=(0,), num_blocks=160, block_size=16,
        kv_policy="last_exited", kv_planes=4,
    )  # fmt: skip
    return EngineInfo(**{**base, **facts})


def test_the_kv_capacity_counts_every_plane_of_a_token():
    """The tester's pool: 160 blocks of 16 at 4 planes per token hold 640 tokens (not 2560),
    1.25 requests of the whole 512-token context."""
    assert kv_capacity_lines(_info()) == [
        "KV cache size: 640 tokens at 4 loops (160 blocks of 16 tokens; a token takes a block "
        "slot on each of its 4 KV planes, kv_policy last_exited)",
        "Maximum concurrency for 512 tokens per request: 1.25x",
    ]
    shared = _info(kv_policy="shared", kv_planes=1, max_model_len=2048)
    assert shared.kv_capacity_tokens == 2560
    assert kv_capacity_lines(shared)[1] == "Maximum concurrency for 2048 tokens per request: 1.25x"
    # Disaggregated: two stages, each with a pool of that size; requests decode on one.
    assert kv_capacity_lines(_info(), disaggregated=True) == [
        "KV cache size: 640 tokens at 4 loops (160 blocks of 16 tokens; a token takes a block "
        "slot on each of its 4 KV planes, kv_policy last_exited; two stages, prefill and "
        "decode, each with its own pool of this size)",
        "Maximum concurrency for 512 tokens per request: 1.25x (on the decode stage)",
    ]
    # A context's last token writes no KV: 513 tokens still fit 32 blocks a plane.
    assert _info(max_model_len=513).max_concurrency == 1.25


def _stats(**values) -> EngineStats:
    zeros = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{**zeros, **values})


def test_the_stats_line_covers_the_interval_and_stays_quiet_when_idle():
    metrics = ServingMetrics("m")
    source = {"stats": _stats(prefix_cache_queries=100, prefix_cache_hits=50), "queued": 0}
    log = StatsLog(metrics, lambda: (source["stats"], source["queued"], 0), now=0.0)
    assert log.line(10.0) is None  # idle from the start: nothing to say
    # A request of 300 prompt tokens got its first token and 49 more; another is queued.
    timeline = RequestTimeline(10.5, 10.5)
    metrics.on_start(timeline, 300)
    metrics.on_tokens(timeline, 11.0, [4])
    metrics.on_tokens(timeline, 12.0, [2] * 49)
    source["stats"] = _stats(
        num_running=1, num_waiting=2, kv_usage=0.4375, prefix_cache_queries=300,
        prefix_cache_hits=125, num_preemptions=3,
    )  # fmt: skip
    source["queued"] = 1
    assert log.line(20.0) == (
        "Engine 000: Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 "
        "tokens/s, Running: 1 reqs, Waiting: 3 reqs, Preemptions: 3, GPU KV cache usage: 43.8%, "
        "Prefix cache hit rate: 37.5%"
    )
    # All done: one line shows it went idle, then nothing until work comes again.
    source["stats"] = dataclasses.replace(
        source["stats"], num_running=0, num_waiting=0, kv_usage=0.0
    )
    source["queued"] = 0
    assert log.line(25.0) == (  # (vLLM's: no preemptions, no "Preemptions"; the recent rate)
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 "
        "tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, "
        "Prefix cache hit rate: 37.5%"
    )
    assert log.line(35.0) is None
    # A restarted stage counts from zero again: no negative interval, and its cache is new.
    source["stats"] = _stats(num_running=1, prefix_cache_queries=10, prefix_cache_hits=10)
    assert log.line(45.0).endswith("Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, "
                                   "Prefix cache hit rate: 0.0%")  # fmt: skip
    # Its lookups so far (a request admitted, its first token to come) count with that request.
    timeline = RequestTimeline(44.0, 44.0)
    metrics.on_start(timeline, 20)
    metrics.on_tokens(timeline, 46.0, [4])
    source["stats"] = _stats(num_running=1, prefix_cache_queries=20, prefix_cache_hits=15)
    assert log.line(55.0).endswith("Prefix cache hit rate: 75.0%")


def test_the_interval_is_vllms_variable(caplog):
    """``VLLM_LOG_STATS_INTERVAL`` as vLLM reads it: seconds as a float, 10 unless above 0; one
    that is no number is warned about (the stats line does not stop the server)."""
    assert log_stats_interval({}) == 10.0
    assert log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "2.5"}) == 2.5
    assert log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "0"}) == 10.0
    assert log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "-1"}) == 10.0
    assert log_stats_interval({"VLLM_LOG_STATS_INTERVAL": "soon"}) == 10.0
    assert caplog.messages == ["VLLM_LOG_STATS_INTERVAL='soon' is not a number: stats every 10 s"]


def test_the_hit_rate_is_over_recent_requests_not_the_interval():
    """vLLM's line shows the hit rate of the most recent 1000 requests' lookups: a chat server
    whose intervals mostly decode (long answers, a new prompt now and then) keeps showing the
    cache's rate rather than 0.0% whenever no prompt arrived in the last 10 seconds."""
    metrics = ServingMetrics("m")
    source = {"stats": _stats()}
    log = StatsLog(metrics, lambda: (source["stats"], 0, 0), now=0.0)

    def prefill(at: float, prompt: int, cached: int) -> None:
        """One request admitted (its prompt looked up) and given its first token at ``at``."""
        stats = source["stats"]
        source["stats"] = dataclasses.replace(
            stats,
            num_running=1,
            prefix_cache_queries=stats.prefix_cache_queries + prompt,
            prefix_cache_hits=stats.prefix_cache_hits + cached,
        )
        timeline = RequestTimeline(at, at)
        metrics.on_start(timeline, prompt)
        metrics.on_tokens(timeline, at, [4])

    prefill(1.0, 1000, 900)
    assert log.line(10.0).endswith("Prefix cache hit rate: 90.0%")
    # 10 s of decoding only: no lookup, and the rate stays
    assert log.line(20.0).endswith("Prefix cache hit rate: 90.0%")
    prefill(21.0, 1000, 700)
    assert log.line(30.0).endswith("Prefix cache hit rate: 80.0%")
    # A request admitted late in an interval gets its first token in the next: its lookup
    # counts there, with it.
    source["stats"] = dataclasses.replace(
        source["stats"],
        prefix_cache_queries=source["stats"].prefix_cache_queries + 1000,
        prefix_cache_hits=source["stats"].prefix_cache_hits + 1000,
    )
    assert log.line(40.0).endswith("Prefix cache hit rate: 80.0%")
    timeline = RequestTimeline(39.0, 39.0)
    metrics.on_start(timeline, 1000)
    metrics.on_tokens(timeline, 41.0, [4])
    assert log.line(50.0).endswith("Prefix cache hit rate: 86.7%")


def test_the_hit_rate_window_drops_the_oldest_requests():
    from rltserve.http.stats_log import RecentHitRate

    window = RecentHitRate(window=10)
    window.observe(6, 600, 0)
    window.observe(4, 400, 400)
    assert window.rate == 0.4
    window.observe(5, 500, 500)  # 15 requests: the oldest 6 go
    assert window.requests == 9 and window.rate == 1.0
    window.observe(50, 100, 50)  # more than the window alone: the latest stays
    assert window.requests == 50 and window.rate == 0.5
    window.observe(0, 100, 100)  # lookups of requests whose first token is still to come
    window.observe(1, 0, 0)
    window.observe(1, 200, 0)  # (those lookups counted once)
    assert (window.requests, window.queries, window.hits) == (2, 300, 100)
    window.reset()
    assert window.rate == 0.0
