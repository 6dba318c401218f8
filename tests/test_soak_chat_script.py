"""scripts/soak_chat.py's pieces that decide whether a soak passed: reading /metrics, counter
increments, drift slopes and the whole-run consistency of the counters with the clients' view.
(The load itself runs against a live server: docs/benchmarks.md, "Chat soak".)"""

from __future__ import annotations

import os
from collections import Counter
from types import SimpleNamespace

import pytest
from script_util import load_script

probe = load_script("soak_probe")
soak_chat = load_script("soak_chat")

EXPOSITION = """\
# HELP rltserve:num_requests_running Requests in the engine.
rltserve:num_requests_running{engine="0",model_name="m"} 3.0
rltserve:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
rltserve:prompt_tokens_total{engine="0",model_name="m"} 1200.0
rltserve:generation_tokens_total{engine="0",model_name="m"} 300.0
rltserve:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
rltserve:prefix_cache_hits_total{engine="0",model_name="m"} 900.0
rltserve:request_success_total{engine="0",finished_reason="stop",model_name="m"} 4.0
rltserve:request_success_total{engine="0",finished_reason="length",model_name="m"} 6.0
rltserve:request_success_total{engine="0",finished_reason="abort",model_name="m"} 2.0
rltserve:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0
"""


def test_parse_metrics_reads_gauges_counters_and_reasons():
    values = probe.parse_metrics(EXPOSITION)
    assert values["num_requests_running"] == 3.0 and values["kv_cache_usage_perc"] == 0.25
    assert values["prefix_cache_hits_total"] == 900.0
    assert values["request_success"] == {"stop": 4.0, "length": 6.0, "abort": 2.0}
    assert "time_to_first_token_seconds_count" not in values
    assert probe.parse_metrics(EXPOSITION.replace("rltserve:", "vllm:"), "vllm") == values


def test_delta_is_the_counters_increments():
    before = probe.parse_metrics(EXPOSITION)
    stop = '"stop",model_name="m"}'
    after = probe.parse_metrics(
        EXPOSITION.replace("1200.0", "1500.0").replace(f"{stop} 4.0", f"{stop} 7.0")
    )
    step = probe.delta(after, before)
    assert step["prompt_tokens_total"] == 300.0 and step["generation_tokens_total"] == 0.0
    assert step["request_success"] == {"abort": 0.0, "length": 0.0, "stop": 3.0}
    assert "num_requests_running" not in step  # a gauge has no increment


def test_slope_and_percentiles():
    assert probe.slope_per_min([(1, 100.0), (2, 102.0), (3, 104.0)]) == pytest.approx(2.0)
    assert probe.slope_per_min([(1, 1.0), (2, 2.0)]) is None  # too few points for a trend
    spread = probe.ms_percentiles([0.1] * 50 + [0.2] * 50)
    assert spread == {"p50": 200.0, "p90": 200.0, "p99": 200.0}
    assert probe.ms_percentiles([])["p50"] is None


def test_process_tree_counts_this_process():
    tree = probe.process_tree(os.getpid())
    assert tree["pids"] >= 1 and tree["rss_mb"] > 0 and tree["fds"] > 0 and tree["threads"] >= 1


def _metrics(stop, length, abort, prompt=0.0, generated=0.0):
    values = {k: 0.0 for k in probe.SERIES}
    values.update(prompt_tokens_total=prompt, generation_tokens_total=generated)
    values["request_success"] = {"stop": stop, "length": length, "abort": abort, "error": 0.0}
    return values


def test_whole_run_allows_cut_answers_either_way_and_nothing_else():
    soak = SimpleNamespace(
        finished=Counter(stop=5, length=10),
        cut_choices=3,
        usage=Counter(prompt_tokens_x_n=100, completion_tokens=50),
    )
    first = _metrics(0, 0, 0)
    # two cut answers ended on the server before the cut reached it, one was aborted
    assert soak_chat.whole_run(soak, first, _metrics(6, 11, 1, 120, 60))["consistent"]
    # a finished answer the clients never saw end: lost
    assert not soak_chat.whole_run(soak, first, _metrics(5, 14, 0, 120, 60))["consistent"]
    # fewer generated tokens counted than the clients were told
    assert not soak_chat.whole_run(soak, first, _metrics(5, 10, 3, 120, 40))["consistent"]
