"""``rltserve bench serve``: metric definitions on synthetic timings, the arrival process, a
short run against a live (scripted) server, and the CLI parsers of serve and bench serve."""

from __future__ import annotations

import argparse
import math

import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
)

from rltserve.bench.serve import (
    BenchConfig,
    RequestResult,
    arrival_gaps,
    format_report,
    random_prompts,
    run_bench,
    summarize,
)
from rltserve.client import APIError
from rltserve.http.cli import (
    add_bench_serve_parser,
    add_serve_parser,
    cmd_bench_serve,
    dataclass_kwargs,
    serve_configs,
)
from rltserve.http.config import ServerConfig


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
    assert "Output token throughput (tok/s):" in format_report(report)


def test_arrivals_and_prompts_are_seeded():
    config = BenchConfig(url="http://x", num_prompts=2000, request_rate=50.0, seed=3, input_len=8)
    gaps = arrival_gaps(config)
    assert gaps == arrival_gaps(config) and gaps[0] == 0.0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)  # Poisson at 50 req/s
    assert arrival_gaps(BenchConfig(url="http://x", num_prompts=3)) == [0.0, 0.0, 0.0]
    prompts = random_prompts(config, 512)
    assert prompts == random_prompts(config, 512)
    assert all(len(p) == 8 and all(0 <= t < 512 for t in p) for p in prompts)
    with pytest.raises(ValueError, match="request_rate"):
        BenchConfig(url="http://x", request_rate=0)


async def test_short_run_against_a_server(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 77], interval_s=0.001))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        config = BenchConfig(
            url=live.url, num_prompts=6, input_len=5, output_len=4, max_concurrency=2,
            request_rate=200.0,
        )  # fmt: skip
        report = await run_bench(config)
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == 24 and report["total_input_tokens"] == 30
    assert report["mean_ttft_ms"] > 0 and report["mean_tpot_ms"] > 0
    assert report["mean_e2el_ms"] >= report["mean_ttft_ms"]


async def test_multi_turn_chat_reports_the_cache_hit_rate(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory)
    engine = {"block_size": 4, "num_blocks": 256}
    async with running(ckpt, engine=engine) as live:
        config = BenchConfig(
            url=live.url, num_prompts=2, input_len=5, output_len=3, num_turns=3,
        )  # fmt: skip
        report = await run_bench(config)
    assert report["completed"] == 6 and report["num_turns"] == 3
    # Turn prompts: 5, 5+3+5 = 13, 13+3+5 = 21 tokens; turns 2 and 3 reuse the full blocks
    # before their last token that the previous turn cached (its prompt: 1 and 3 blocks).
    assert report["total_input_tokens"] == 2 * (5 + 13 + 21)
    assert report["total_cached_tokens"] == 2 * (4 + 12)
    assert report["prefix_cache_hit_rate"] == pytest.approx(32 / 78)


async def test_chat_endpoint_streams_messages(tmp_path_factory):
    """``endpoint="chat"``: the prompts as text in user messages, a conversation's answers as
    assistant messages; prompt lengths are the server's (the template's tokens included), and
    later turns hit the cache."""
    ckpt = tiny_checkpoint(tmp_path_factory)
    engine = {"block_size": 4, "num_blocks": 256}
    async with running(ckpt, engine=engine) as live:
        config = BenchConfig(
            url=live.url, num_prompts=2, input_len=5, output_len=3, num_turns=2, endpoint="chat"
        )
        report = await run_bench(config)
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_output_tokens"] == 4 * 3
    assert report["total_input_tokens"] > 2 * (5 + 13)  # (the chat template's tokens)
    assert report["total_cached_tokens"] > 0 and report["mean_ttft_ms"] > 0
    with pytest.raises(ValueError, match="endpoint='rest'"):
        BenchConfig(url="http://x", endpoint="rest")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rltserve")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command")
    add_bench_serve_parser(bench)
    return parser


def test_serve_flags_come_from_server_config(monkeypatch):
    args = _parser().parse_args(
        ["serve", "--port", "0", "--max-concurrent", "8", "--served-model-name", "m",
         "--max-num-seqs", "4"]
    )  # fmt: skip
    config = ServerConfig(**dataclass_kwargs(args, ServerConfig))
    assert (config.port, config.max_concurrent, config.served_model_name) == (0, 8, "m")
    assert config.max_queued == ServerConfig().max_queued  # unset flags keep the defaults
    assert args.max_num_seqs == 4  # engine flags ride along
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    assert config.with_env().api_key == "from-env"
    with pytest.raises(ValueError, match="ssl_certfile"):
        ServerConfig(ssl_certfile="cert.pem")
    with pytest.raises(ValueError, match="max_concurrent"):
        ServerConfig(max_concurrent=0)


def test_bench_serve_flags():
    args = _parser().parse_args(
        ["bench", "serve", "--num-prompts", "5", "--request-rate", "inf", "--json"]
    )
    assert args.num_prompts == 5 and math.isinf(args.request_rate) and args.json
    assert args.endpoint == "completions"
    from rltserve.bench.serve import ENDPOINTS

    for endpoint in ENDPOINTS:  # (the flag spells out the config's choices)
        assert _parser().parse_args(["bench", "serve", "--endpoint", endpoint]).endpoint == endpoint
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "serve", "--endpoint", "rest"])


def test_serve_takes_the_api_key_from_the_environment_unless_a_flag_gives_one(monkeypatch):
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    server, engine = serve_configs(_parser().parse_args(["serve", "--max-num-seqs", "4"]))
    assert server.api_key == "from-env" and engine.scheduler.max_num_seqs == 4
    server, _ = serve_configs(_parser().parse_args(["serve", "--api-key", "flag"]))
    assert server.api_key == "flag"


def test_bench_serve_targets_where_serve_listens_by_default():
    args = _parser().parse_args(["bench", "serve"])
    server = ServerConfig()
    assert args.url == f"http://{server.host}:{server.port}"
    assert math.isinf(args.request_rate) and args.num_turns == 1
    assert _parser().parse_args(["serve"]).log_level == "info"


def _bench_args(*flags: str) -> argparse.Namespace:
    return _parser().parse_args(["bench", "serve", "--json", "--quiet", *flags])


def test_bench_serve_flags_reach_the_benchmark(monkeypatch, capsys):
    seen = []

    async def fake_run_bench(config):
        seen.append(config)
        return {"completed": 3}

    monkeypatch.setattr("rltserve.bench.serve.run_bench", fake_run_bench)
    monkeypatch.setenv("RLTSERVE_API_KEY", "from-env")
    flags = ["--input-len", "3", "--output-len", "5", "--num-turns", "2", "--wait-timeout", "7",
             "--seed", "9", "--max-concurrency", "2"]  # fmt: skip
    assert cmd_bench_serve(_bench_args(*flags)) == 0
    [config] = seen
    assert (config.input_len, config.output_len, config.num_turns) == (3, 5, 2)
    assert (config.ready_timeout_s, config.seed, config.max_concurrency) == (7.0, 9, 2)
    assert config.api_key == "from-env" and math.isinf(config.request_rate)
    assert config.progress is False
    assert capsys.readouterr().out.strip() == '{\n  "completed": 3\n}'
    assert cmd_bench_serve(_bench_args("--api-key", "flag")) == 0
    assert seen[-1].api_key == "flag"


def test_bench_serve_fails_when_nothing_completed_or_the_server_refuses(monkeypatch):
    async def nothing_completed(config):
        return {"completed": 0}

    monkeypatch.setattr("rltserve.bench.serve.run_bench", nothing_completed)
    assert cmd_bench_serve(_bench_args()) == 1

    async def refused(config):
        raise APIError(401, "invalid API key")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", refused)
    with pytest.raises(RuntimeError, match=r"^http://127.0.0.1:8000: .*invalid API key"):
        cmd_bench_serve(_bench_args())
