"""``rltserve bench serve``'s ``vllm bench serve`` flags: goodput, the percentiles reported and
the random lengths on hand-built results (no server), the vLLM spellings the parser takes and
their usage errors, and one run through the command against a live (scripted) server that
saves its result file."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re

import pytest
from test_http_harness import (
    MODEL,
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    tiny_checkpoint,
)

from rltserve.bench.serve import BenchConfig, RequestResult, format_report, summarize
from rltserve.bench.serve_datasets import random_prompts, request_lengths
from rltserve.bench.serve_report import result_filename
from rltserve.http.cli import add_bench_serve_parser, cmd_bench_serve

_METRICS = ("ttft", "tpot", "itl", "e2el")


def _results() -> list[RequestResult]:
    return [
        # TTFT 250 ms, TPOT (1.25 - 0.25) / 4 = 250 ms, E2EL 1250 ms: exactly at the bounds
        RequestResult(4, True, 5, ttft=0.25, e2el=1.25, itl=[0.25] * 4),
        RequestResult(4, True, 5, ttft=0.5, e2el=1.0, itl=[0.125] * 4),  # TTFT above
        RequestResult(4, True, 3, ttft=0.125, e2el=1.125, itl=[0.5, 0.5]),  # TPOT 500 ms
        RequestResult(4, True, 1, ttft=0.125, e2el=0.125),  # one token: a TPOT of 0
        RequestResult(4, False, 2, ttft=0.0625, e2el=0.125, error="OSError: broken"),
    ]


def test_goodput_counts_the_successful_requests_within_every_bound():
    def goodput(*bounds):
        config = BenchConfig(url="http://x", num_prompts=5, goodput=bounds)
        return summarize(config, _results(), duration=2.0)["request_goodput"]

    assert goodput(("ttft", 250.0), ("tpot", 250.0)) == 1.0  # requests 1 and 4, in 2 s
    assert goodput(("ttft", 250.0)) == 1.5  # 1, 3 and 4 (a failed one never counts)
    assert goodput(("e2el", 1124.0)) == 1.0  # 2 and 4
    assert goodput(("tpot", 0.0)) == 0.5  # 4 alone
    assert goodput(("ttft", 0.0), ("tpot", 1e9), ("e2el", 1e9)) == 0.0
    plain = summarize(BenchConfig(url="http://x", num_prompts=5), _results(), 2.0)
    assert plain["request_goodput"] is None and plain["goodput"] is None
    assert "goodput" not in format_report(plain)
    report = summarize(BenchConfig(url="http://x", goodput=(("e2el", 1124.0),)), _results(), 2.0)
    assert report["goodput"] == {"e2el": 1124.0}
    assert f"{'Request goodput (req/s):':<45}{'1.00':>15}" in format_report(report).splitlines()


def test_percentiles_of_the_metrics_chosen_are_reported_by_vllm_names():
    config = BenchConfig(
        url="http://x", percentile_metrics=("e2el", "ttft"), metric_percentiles=(50, 90.0, 99.9)
    )
    report = summarize(config, _results()[:4], duration=1.0)
    measured = {k: v for k, v in report.items() if k.endswith("_ms")}
    # TTFT 250, 500, 125, 125 ms: numpy's linear percentiles; E2EL 1250, 1000, 1125, 125 ms
    assert measured == pytest.approx({
        "mean_ttft_ms": 250.0, "median_ttft_ms": 187.5, "std_ttft_ms": 23437.5**0.5,
        "p50_ttft_ms": 187.5, "p90_ttft_ms": 425.0, "p99.9_ttft_ms": 499.25,
        "mean_e2el_ms": 875.0, "median_e2el_ms": 1062.5, "std_e2el_ms": 195312.5**0.5,
        "p50_e2el_ms": 1062.5, "p90_e2el_ms": 1212.5, "p99.9_e2el_ms": 1249.625,
    })  # fmt: skip
    text = format_report(report)
    assert "P99.9 TTFT (ms):" in text and "P90 E2EL (ms):" in text
    assert "Time per Output Token" not in text and "Inter-token Latency" not in text


def test_the_default_report_keeps_all_four_sections_at_p99():
    report = summarize(BenchConfig(url="http://x"), _results(), duration=1.0)
    keys = {k for k in report if k.endswith("_ms")}
    assert keys == {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in _METRICS}


def test_a_detailed_report_adds_vllms_per_request_arrays():
    results = _results()
    results[0].output_text = "ab"
    report = summarize(BenchConfig(url="http://x", detailed=True), results, duration=1.0)
    assert report["input_lens"] == [4] * 5
    assert report["output_lens"] == [5, 5, 3, 1, 0]  # (0: the failed request)
    assert report["ttfts"] == [0.25, 0.5, 0.125, 0.125, 0.0625]
    assert report["itls"] == [[0.25] * 4, [0.125] * 4, [0.5, 0.5], [], []]
    assert report["latencies"] == [1.25, 1.0, 1.125, 0.125, 0.125]
    assert report["generated_texts"] == ["ab", "", "", "", ""]
    assert report["errors"] == ["", "", "", "", "OSError: broken"]
    assert format_report(report).splitlines()[-2] == "error: OSError: broken"


def test_range_ratio_draws_lengths_around_the_given_ones():
    config = BenchConfig(
        url="http://x", num_prompts=400, input_len=10, output_len=4, range_ratio=0.5, seed=3
    )
    lengths = request_lengths(config)
    assert lengths == request_lengths(config)  # seeded
    assert {i for i, _ in lengths} == set(range(5, 16))  # [floor(5), ceil(15)]
    assert {o for _, o in lengths} == set(range(2, 7))
    assert [len(p) for p in random_prompts(config, 50)] == [i for i, _ in lengths]
    one = BenchConfig(url="http://x", num_prompts=200, output_len=1, range_ratio=0.5)
    assert {o for _, o in request_lengths(one)} == {1, 2}  # (never 0 output tokens)
    with pytest.raises(ValueError, match=r"^range_ratio=0.5: the shortest prompt"):
        BenchConfig(url="http://x", input_len=1, range_ratio=0.5)
    with pytest.raises(ValueError, match=r"^range_ratio=1: must be in \[0, 1\)"):
        BenchConfig(url="http://x", range_ratio=1)


def test_without_a_range_ratio_the_prompts_are_those_of_before():
    config = BenchConfig(url="http://x", num_prompts=3, input_len=4, output_len=7, seed=5)
    rng = random.Random(5)
    assert random_prompts(config, 99) == [[rng.randrange(99) for _ in range(4)] for _ in "abc"]
    assert request_lengths(config) == [(4, 7)] * 3


def test_a_random_prefix_starts_every_prompt_before_its_input_len_tokens():
    """vLLM's --random-prefix-len: the same prefix_len random tokens, then each prompt's own
    input_len (drawn around it with a range ratio; the prefix never varies)."""
    plain = BenchConfig(url="http://x", num_prompts=5, input_len=4, seed=2, range_ratio=0.5)
    config = dataclasses.replace(plain, prefix_len=6)
    prompts = random_prompts(config, 99)
    prefix = random.Random("2:prefix")
    assert {tuple(p[:6]) for p in prompts} == {tuple(prefix.randrange(99) for _ in range(6))}
    assert [p[6:] for p in prompts] == random_prompts(plain, 99)  # (the tokens after: the same)
    assert request_lengths(config) == request_lengths(plain)
    with pytest.raises(ValueError, match=r"^prefix_len=-1: must be >= 0$"):
        BenchConfig(url="http://x", prefix_len=-1)


def test_result_file_name_is_vllms():
    report = {"request_rate": 4.0, "max_concurrency": 8, "model": "served", "model_id": "org/m-1b/",
              "ramp_up_strategy": None, "date": "20250101-120000"}  # fmt: skip
    # (the model part: --model's, not the name sent)
    assert (
        result_filename(report, "openai") == "openai-4.0qps-concurrency8-m-1b-20250101-120000.json"
    )
    report.update(request_rate="inf", max_concurrency=None, model_id=None)
    assert result_filename(report, "vllm") == "vllm-infqps-unknown-20250101-120000.json"
    # A ramp-up's: its strategy and bounds (ints, as vLLM's flags take them; fractions kept)
    report.update(ramp_up_strategy="linear", ramp_up_start_rps=1.0, ramp_up_end_rps=2.5,
                  model_id="m", max_concurrency=4)  # fmt: skip
    assert result_filename(report, "openai") == (
        "openai-ramp-up-linear-1qps-2.5qps-concurrency4-m-20250101-120000.json"
    )


def test_append_result_alone_saves_and_appends_one_line_per_run(monkeypatch, tmp_path):
    async def fake_run_bench(config):
        ok = RequestResult(4, True, 2, ttft=0.1, e2el=0.3, itl=[0.2], usage=True)
        return summarize(config, [ok], 1.0, served="served")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", fake_run_bench)
    monkeypatch.chdir(tmp_path)
    ramp = ("--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "1",
            "--ramp-up-end-rps", "8")  # fmt: skip
    flags = ("--quiet", "--model", "org/m-1b", "--served-model-name", "m", "--max-concurrency", "2")
    assert cmd_bench_serve(_parse(*flags, *ramp, "--append-result")) == 0
    [path] = tmp_path.iterdir()
    name = r"openai-ramp-up-exponential-1qps-8qps-concurrency2-m-1b-\d{8}-\d{6}\.json"
    assert re.fullmatch(name, path.name)
    [line] = path.read_text().splitlines()
    assert json.loads(line)["model_id"] == "org/m-1b"
    path.unlink()
    saved = ("--result-filename", "r.jsonl")
    assert cmd_bench_serve(_parse(*flags, "--save-result", *saved)) == 0
    assert cmd_bench_serve(_parse(*flags, "--append-result", "--label", "b", *saved)) == 0
    reports = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["label"] for r in reports] == [None, "b"]


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rltserve")
    add_bench_serve_parser(parser.add_subparsers(dest="bench_command"))
    return parser.parse_args(["serve", *flags])


def _config(monkeypatch, *flags: str) -> BenchConfig:
    seen = []

    async def fake_run_bench(config):
        seen.append(config)
        return {"completed": 1}

    monkeypatch.setattr("rltserve.bench.serve.run_bench", fake_run_bench)
    assert cmd_bench_serve(_parse("--json", "--quiet", *flags)) == 0
    return seen[0]


def test_vllm_spellings_reach_the_config(monkeypatch):
    config = _config(
        monkeypatch, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", "http://h:9/v1", "--dataset-name", "random", "--random-input-len", "7",
        "--random-output-len", "5", "--random-range-ratio", "0.25", "--ignore-eos",
        "--goodput", "ttft:500", "e2el:2e3", "--percentile-metrics", "ttft,itl",
        "--metric-percentiles", "50,99.9", "--save-detailed", "--disable-tqdm",
    )  # fmt: skip
    assert (config.endpoint, config.url, config.input_len, config.output_len) == (
        "chat", "http://h:9", 7, 5
    )  # fmt: skip
    assert config.range_ratio == 0.25 and config.goodput == (("ttft", 500.0), ("e2el", 2000.0))
    assert config.percentile_metrics == ("ttft", "itl")
    assert config.metric_percentiles == (50.0, 99.9) and config.detailed
    assert _config(monkeypatch, "--host", "::1", "--port", "8100").url == "http://[::1]:8100"
    assert _config(monkeypatch, "--port", "8100").url == "http://127.0.0.1:8100"
    assert _config(monkeypatch, "--backend", "vllm").endpoint == "completions"
    assert _config(monkeypatch, "--backend", "openai-chat").endpoint == "chat"
    assert _config(monkeypatch, "--endpoint", "/v1/completions/").endpoint == "completions"
    default = _config(monkeypatch)
    assert default.percentile_metrics == _METRICS and default.metric_percentiles == (99.0,)
    assert (default.goodput, default.range_ratio, default.detailed) == ((), 0.0, False)
    assert default.prefix_len == 0
    assert _config(monkeypatch, "--random-prefix-len", "300").prefix_len == 300


def test_the_report_records_the_extra_body_and_the_loop_fields_it_sends(monkeypatch):
    """``--extra-body`` goes over the flags in every body, so the report's ``exit_threshold``
    (and ``temperature``) are what it sent; the report keeps the whole of it too."""
    extra = {"max_loops": 6, "exit_criterion": "kl", "exit_threshold": 0.5, "init_state": "zero"}
    config = _config(monkeypatch, "--extra-body", json.dumps(extra), "--exit-threshold", "0.9")
    report = summarize(config, [], duration=1.0)
    assert (report["extra_body"], report["exit_threshold"], report["temperature"]) == (
        extra, 0.5, 0.0
    )  # fmt: skip
    hot = _config(monkeypatch, "--extra-body", '{"temperature": 0.7}', "--exit-threshold", "0.9")
    report = summarize(hot, [], duration=1.0)
    assert (report["extra_body"], report["exit_threshold"], report["temperature"]) == (
        {"temperature": 0.7}, 0.9, 0.7
    )  # fmt: skip
    report = summarize(_config(monkeypatch), [], duration=1.0)
    assert (report["extra_body"], report["exit_threshold"]) == ({}, None)


def test_the_backend_choices_are_the_configs():
    from rltserve.bench.serve_config import BACKENDS

    for backend in BACKENDS:
        assert _parse("--backend", backend).backend == backend
    with pytest.raises(SystemExit):
        _parse("--backend", "tgi")
    with pytest.raises(SystemExit):
        _parse("--endpoint", "/v1/embeddings")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--goodput", "ttft=5"], "--goodput ttft=5: give KEY:VALUE pairs"),
        (["--goodput", "itl:5"], "--goodput itl:5: give KEY:VALUE pairs, a metric of ttft, "),
        (["--goodput", "tpot:x"], "--goodput tpot:x: give KEY:VALUE pairs"),
        (["--goodput", "ttft:-1"], "--goodput ttft:-1: the bound must be >= 0 ms"),
        (["--goodput", "ttft:1", "ttft:2"], "--goodput ttft:1 ttft:2: ttft is bounded twice"),
        (["--percentile-metrics", "ttft,foo"], "--percentile-metrics ttft,foo: a comma-"),
        (["--percentile-metrics", "ttft,ttft"], "--percentile-metrics ttft,ttft: a comma-"),
        (["--metric-percentiles", "50,x"], "--metric-percentiles 50,x: a comma-separated"),
        (["--metric-percentiles", "101"], "--metric-percentiles 101: a comma-separated"),
        (["--metric-percentiles", "99,99.0"], "--metric-percentiles 99,99.0: a comma-"),
        (["--random-range-ratio", "1"], "--random-range-ratio 1: must be in [0, 1)"),
        (["--random-prefix-len", "-1"], "--random-prefix-len -1: must be >= 0"),
        (["--random-range-ratio", "0.5", "--input-len", "1"],
         "--random-range-ratio 0.5: the shortest prompt of --input-len 1 would have no tokens"),
        (["--dataset-name", "sharegpt"], "--dataset-name sharegpt: needs --dataset-path FILE"),
        (["--dataset-name", "sonnet"], "--dataset-name sonnet: not supported; "),
        (["--random-output-len", "0"], "--random-output-len 0: must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens 0: must be >= 1"),
        (["--extra-body", "[1]"], "--extra-body [1]: must be a JSON object"),
        (["--extra-body", "{x"], "--extra-body {x: not JSON"),
        (["--extra-body", '{"prompt": 1}'], '--extra-body {"prompt": 1}: prompt is the bench'),
        (["--header", "X-A"], "--header X-A: give KEY=VALUE"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"],
         "--ramp-up-strategy linear: needs --ramp-up-end-rps"),
        (["--ramp-up-end-rps", "4"], "--ramp-up-end-rps 4: needs --ramp-up-strategy"),
        (["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0",
          "--ramp-up-end-rps", "4"], "--ramp-up-start-rps 0: must be a finite rate > 0"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "4",
          "--request-rate", "2"], "--request-rate 2: not with --ramp-up-strategy"),
        (["--num-warmups", "-1"], "--num-warmups -1: must be >= 0"),
        (["--dataset-path", "x.json"], "--dataset-path x.json: the 'random' dataset reads no"),
        (["--backend", "openai", "--endpoint", "chat"],
         "--backend openai: streams the completions endpoint, not --endpoint chat"),
        (["--host", "h", "--url", "http://other:1"], "--host h: not with --url/--base-url"),
        (["--port", "0"], "--port 0: must be in 1..65535"),
        (["--metadata", "tp"], "--metadata tp: give KEY=VALUE pairs"),
        (["--metadata", "model=x"], "--metadata model=x: 'model' is a key of the report"),
    ],
)  # fmt: skip
def test_bad_vllm_flags_are_usage_errors_naming_the_flag(monkeypatch, tmp_path, flags, message):
    async def connects(config):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", connects)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):  # (exit code 2)
        cmd_bench_serve(_parse("--quiet", *flags))


def test_extra_body_of_several_choices_per_request_is_refused(monkeypatch):
    """``"n": 2`` streamed both choices into one request: its chunks timed as one answer
    (TPOT halved, twice the output tokens per request), silently."""

    async def connects(config):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", connects)
    with pytest.raises(ValueError, match=r'^--extra-body \{"n": 2\}: n 2: bench serve times one'):
        cmd_bench_serve(_parse("--quiet", "--extra-body", '{"n": 2}'))
    with pytest.raises(ValueError, match="one choice per request"):
        BenchConfig(url="http://x", extra_body={"n": 3})
    assert _config(monkeypatch, "--extra-body", '{"n": 1}').extra_body == {"n": 1}


def test_random_length_flags_with_a_text_dataset_are_refused(monkeypatch, tmp_path):
    """A file's prompts and output lengths are the dataset's: --random-input-len and
    --random-output-len (or their other spellings) were ignored silently, and the report
    recorded their defaults as the run's lengths."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "hi there"}\n')
    text = ("--dataset-name", "custom", "--dataset-path", str(path))
    for flag, message in (
        ("--random-input-len", "sends the file's prompts as they are"),
        ("--input-len", "sends the file's prompts as they are"),
        ("--random-output-len", "takes --custom-output-len for output lengths"),
        ("--max-tokens", "takes --custom-output-len for output lengths"),
    ):
        with pytest.raises(ValueError, match=f"^{flag} 64: random prompts only; --dataset-name "
                                             f"custom {message}"):  # fmt: skip
            cmd_bench_serve(_parse("--quiet", *text, flag, "64"))
    config = _config(monkeypatch, *text, "--custom-output-len", "9")
    report = summarize(config, [], duration=1.0)
    assert (report["input_len"], report["output_len"]) == (None, None)
    assert summarize(_config(monkeypatch), [], 1.0)["input_len"] == 128


def test_a_result_file_that_cannot_be_written_is_refused_before_the_run(monkeypatch, tmp_path):
    async def connects(config):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", connects)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="^--result-dir .*file: is not a directory$"):
        cmd_bench_serve(_parse("--save-result", "--result-dir", str(tmp_path / "file")))
    with pytest.raises(ValueError, match="^--result-filename no/r.json: .*no does not exist$"):
        cmd_bench_serve(_parse("--result-dir", str(tmp_path), "--result-filename", "no/r.json"))


async def test_a_run_saves_vllms_result_file(tmp_path_factory, tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path_factory)
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 77], interval_s=0.001))
    out = tmp_path / "results"
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        args = _parse(
            "--base-url", live.url, "--backend", "openai", "--endpoint", "/v1/completions",
            "--dataset-name", "random", "--random-input-len", "6", "--random-output-len", "4",
            "--random-range-ratio", "0.5", "--num-prompts", "5", "--max-concurrency", "2",
            "--goodput", "ttft:0", "--percentile-metrics", "ttft,e2el",
            "--metric-percentiles", "50,99.9", "--save-result", "--save-detailed",
            "--result-dir", str(out), "--metadata", "tp=1", "--disable-tqdm", "--json",
        )  # fmt: skip
        # (in a thread: the command runs its own event loop, the server is on this one)
        assert await asyncio.to_thread(cmd_bench_serve, args) == 0
    [path] = out.iterdir()
    assert re.fullmatch(rf"openai-infqps-concurrency2-{MODEL}-\d{{8}}-\d{{6}}\.json", path.name)
    saved = json.loads(path.read_text())
    assert saved == json.loads(capsys.readouterr().out)  # the file holds the --json report
    config = BenchConfig(url="http://x", num_prompts=5, input_len=6, output_len=4, range_ratio=0.5)
    lengths = request_lengths(config)
    assert (saved["completed"], saved["tp"], saved["range_ratio"]) == (5, "1", 0.5)
    assert saved["input_lens"] == [i for i, _ in lengths]
    assert saved["output_lens"] == [o for _, o in lengths]
    assert saved["total_output_tokens"] == sum(o for _, o in lengths)
    assert saved["request_goodput"] == 0.0 and saved["goodput"] == {"ttft": 0.0}
    assert saved["errors"] == [""] * 5 and len(saved["ttfts"]) == len(saved["itls"]) == 5
    assert [len(gaps) for gaps in saved["itls"]] == [o - 1 for _, o in lengths]
    stats = {k for k in saved if k.endswith("_ms")}
    assert stats == {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p99.9")
                     for m in ("ttft", "e2el")}  # fmt: skip
