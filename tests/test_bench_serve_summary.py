"""``rltserve bench serve``'s numbers on synthetic timings: the report's metric definitions and
settings, the configuration's bounds, and the seeded arrival process. Requests and
conversations against fake servers: test_http_bench."""

from __future__ import annotations

import itertools
import math
import random
import re
import statistics

import pytest

from rltserve.bench.serve import (
    BenchConfig,
    RequestResult,
    arrival_offsets,
    format_report,
    random_prompts,
    summarize,
)


def test_summary_follows_the_serving_definitions():
    config = BenchConfig(url="http://x", num_prompts=3, input_len=4, output_len=5)
    results = [
        RequestResult(4, True, 5, ttft=0.1, e2el=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(4, True, 5, ttft=0.3, e2el=1.1, itl=[0.2, 0.2, 0.2, 0.2]),
        RequestResult(4, False, error="APIError: 503"),
    ]
    report = summarize(config, results, duration=2.0)
    assert (report["completed"], report["failed"]) == (2, 1)
    assert report["request_throughput"] == 1.0
    assert report["output_throughput"] == 5.0  # 10 tokens / 2 s
    assert report["total_token_throughput"] == 9.0  # (8 + 10) / 2 s
    assert report["mean_ttft_ms"] == pytest.approx(200.0)
    assert report["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT = (E2EL - TTFT) / (tokens - 1): 100 ms and 200 ms
    assert report["mean_tpot_ms"] == pytest.approx(150.0)
    assert report["p99_tpot_ms"] == pytest.approx(199.0)
    assert report["mean_itl_ms"] == pytest.approx(150.0)
    assert report["mean_e2el_ms"] == pytest.approx(800.0)
    assert report["errors"] == ["APIError: 503"]
    assert report["skipped_turns"] == 0
    assert "Output token throughput (tok/s):" in format_report(report)
    # numpy's (population) std, as vLLM's: TTFT 100 and 300 ms, E2EL 500 and 1100 ms, ...
    assert report["std_ttft_ms"] == pytest.approx(100.0)
    assert report["std_e2el_ms"] == pytest.approx(300.0)
    assert report["std_tpot_ms"] == pytest.approx(50.0)
    assert report["std_itl_ms"] == pytest.approx(50.0)


def test_summary_records_the_settings_of_the_run():
    config = BenchConfig(
        url="http://x:1", endpoint="chat", seed=4, temperature=0.5, exit_threshold=0.7,
        input_len=6, output_len=7, num_turns=2,
    )  # fmt: skip
    report = summarize(config, [], duration=1.0, served="served-name")
    settings = {key: report[key] for key in (
        "url", "endpoint", "model", "seed", "temperature", "exit_threshold", "input_len",
        "output_len", "num_turns",
    )}  # fmt: skip
    assert settings == {
        "url": "http://x:1", "endpoint": "chat", "model": "served-name", "seed": 4,
        "temperature": 0.5, "exit_threshold": 0.7, "input_len": 6, "output_len": 7,
        "num_turns": 2,
    }  # fmt: skip
    assert re.fullmatch(r"\d{8}-\d{6}", report["date"])
    assert summarize(BenchConfig(url="http://x", model="m"), [], 1.0, "other")["model"] == "m"


def test_summary_counts_the_turns_a_failed_conversation_did_not_send():
    config = BenchConfig(url="http://x", num_prompts=2, num_turns=3)
    ok = RequestResult(4, True, 2, ttft=0.1, e2el=0.2, itl=[0.1])
    # conversation 1: all three turns; conversation 2: its first turn failed
    results = [ok, ok, ok, RequestResult(4, False, error="APIError: 503")]
    report = summarize(config, results, duration=1.0)
    assert (report["completed"], report["failed"], report["skipped_turns"]) == (3, 1, 2)
    assert "Turns not sent (after a failed turn):" in format_report(report)


def test_arrivals_and_prompts_are_seeded():
    config = BenchConfig(url="http://x", num_prompts=2000, request_rate=50.0, seed=3, input_len=8)
    offsets = arrival_offsets(config)
    assert offsets == arrival_offsets(config)
    other = BenchConfig(url="http://x", num_prompts=2000, request_rate=50.0, seed=4)
    assert offsets != arrival_offsets(other)
    assert arrival_offsets(BenchConfig(url="http://x", num_prompts=3)) == [0.0, 0.0, 0.0]
    prompts = random_prompts(config, 512)
    assert prompts == random_prompts(config, 512)
    assert all(len(p) == 8 and all(0 <= t < 512 for t in p) for p in prompts)
    with pytest.raises(ValueError, match="request_rate"):
        BenchConfig(url="http://x", request_rate=0)


def test_summary_percentiles_pool_the_successful_requests():
    config = BenchConfig(url="http://x", num_prompts=10, request_rate=4.0, max_concurrency=2)
    results = [
        RequestResult(4, True, 3, ttft=0.1, e2el=0.5, itl=[0.1, 0.3]),
        RequestResult(4, True, 3, ttft=0.2, e2el=0.4, itl=[0.1, 0.1]),
        RequestResult(4, True, 1, ttft=0.6, e2el=0.6),  # one token: no TPOT
    ] + [RequestResult(4, False, itl=[0.5], error=f"OSError: {i}") for i in range(7)]
    report = summarize(config, results, duration=1.0)
    assert (report["completed"], report["failed"]) == (3, 7)
    assert (report["request_rate"], report["max_concurrency"]) == (4.0, 2)
    assert report["mean_ttft_ms"] == pytest.approx(300.0)
    assert report["median_ttft_ms"] == pytest.approx(200.0)
    assert report["mean_tpot_ms"] == pytest.approx(150.0)  # 200 and 100 ms
    # Every gap of every successful request (a failed one's are left out).
    assert report["mean_itl_ms"] == pytest.approx(150.0)
    assert report["median_itl_ms"] == pytest.approx(100.0)
    assert report["errors"] == [f"OSError: {i}" for i in range(5)]  # the first five, sorted
    empty = summarize(BenchConfig(url="http://x"), [], duration=1.0)
    assert empty["request_rate"] == "inf" and empty["completed"] == 0
    assert empty["mean_ttft_ms"] == empty["p99_e2el_ms"] == 0.0


@pytest.mark.parametrize(
    ("name", "value"),
    [("num_prompts", 0), ("input_len", 0), ("output_len", 0), ("num_turns", 0),
     ("burstiness", 0.0), ("burstiness", math.inf), ("max_concurrency", 0),
     ("ready_timeout_s", 0.0), ("url", "http://:8000")],
)  # fmt: skip
def test_config_rejects_values_out_of_range(name, value):
    with pytest.raises(ValueError, match=f"^{name}="):
        BenchConfig(**{"url": "http://x", name: value})


def test_config_takes_a_base_url_ending_in_v1():
    for url in ("http://x:8000/v1", "http://x:8000/v1/", "http://x:8000/"):
        assert BenchConfig(url=url).url == "http://x:8000"


def test_config_accepts_the_smallest_values():
    config = BenchConfig(
        url="https://x", num_prompts=1, input_len=1, output_len=1, num_turns=1,
        max_concurrency=1, burstiness=0.1, ready_timeout_s=0.1,
    )  # fmt: skip
    assert config.max_concurrency == 1


def test_a_fixed_rate_sends_at_vllms_rescaled_offsets():
    """Recent vLLM's get_request: every request's delay (the first's too) drawn at the rate,
    summed into offsets from the start, rescaled so the last is num_prompts / rate."""
    config = BenchConfig(url="http://x", num_prompts=4, request_rate=2.0, burstiness=0.5, seed=3)
    rng = random.Random(4)  # (seed + 1: the arrivals' own stream)
    draws = [rng.gammavariate(0.5, 1.0) for _ in range(4)]  # scale 1 / (rate * burstiness)
    sums = list(itertools.accumulate(draws))
    offsets = arrival_offsets(config)
    assert offsets == [total * (4 / 2.0 / sums[-1]) for total in sums]
    assert offsets[-1] == pytest.approx(2.0) and offsets[0] > 0


def test_burstiness_shapes_the_gaps_at_the_same_rate():
    config = BenchConfig(url="http://x", num_prompts=4000, request_rate=50.0, burstiness=4.0)
    offsets = arrival_offsets(config)
    gaps = [b - a for a, b in itertools.pairwise([0.0, *offsets])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 50)  # (rescaled: the last is sent at 4000 / 50 s)
    # Gamma gaps of shape 4: a coefficient of variation of 1/2 (Poisson's is 1).
    assert statistics.pstdev(gaps) / mean == pytest.approx(0.5, rel=0.1)
