"""``rltserve bench serve`` as ``vllm bench serve``: the sharegpt and custom datasets, vLLM's
report keys and peaks, its flags (ramp-up, extra body, headers, warm-ups, append-result,
OPENAI_API_KEY) and the errors of servers without rltserve's extras (against the vLLM-like
stand-in of test_bench_serve_live)."""

from __future__ import annotations

import argparse
import itertools
import json
import random

import pytest
from aiohttp import web
from test_bench_serve_flags import _config, _parse
from test_bench_serve_live import _vllm_like
from test_client_sse import serve

from rltserve.bench import serve as serve_bench
from rltserve.bench.serve import BenchConfig, RequestResult, format_report, run_bench, summarize
from rltserve.bench.serve_datasets import random_prompts, token_pool
from rltserve.bench.serve_flags import parse_headers, saving, write_result
from rltserve.bench.serve_report import peaks
from rltserve.bench.serve_text_datasets import TokenCounter, text_requests
from rltserve.http.cli import cmd_bench_serve


def _words(*ids: int) -> str:
    return "".join(f"w{i} " for i in ids)  # (the stand-in's text of token ids)


def _sharegpt(path) -> str:
    def conv(*turns):
        return {"conversations": [{"from": who, "value": text} for who, text in turns]}

    data = [
        conv(("human", _words(1, 2, 3, 4, 5)), ("gpt", _words(6, 7, 8, 9))),
        conv(("human", _words(1, 2, 3, 4))),  # one turn: skipped
        conv(("human", _words(1, 2)), ("gpt", _words(3, 4, 5, 6))),  # a 2-token prompt
        # vLLM's: turns 0 and 1 whatever their roles (a reply, then a question, here)
        conv(("gpt", _words(9, 9, 9, 9)), ("human", _words(5, 5, 5, 5, 5)), ("gpt", "w1")),
        conv(("human", _words(7, 7, 7, 7)), ("gpt", _words(1, 2))),  # a 2-token reply
    ]
    path.write_text(json.dumps(data))
    return str(path)


async def test_sharegpt_sends_the_first_two_turns_as_prompt_and_reply_lengths(tmp_path):
    bodies: list[dict] = []
    path = _sharegpt(tmp_path / "sg.json")
    async with serve(_vllm_like(True, bodies)) as url:
        config = BenchConfig(url=url, num_prompts=2, dataset="sharegpt", dataset_path=path)
        report = await run_bench(config)
    sent = sorted((b["prompt"], b["max_tokens"]) for b in bodies)
    assert sent == [([1, 2, 3, 4, 5], 4), ([9, 9, 9, 9], 5)]  # (the rest are skipped)
    assert (report["completed"], report["total_input_tokens"]) == (2, 9)
    assert (report["dataset_name"], report["dataset_path"]) == ("sharegpt", path)
    # --sharegpt-output-len: the reply's length is not needed, nor checked.
    bodies.clear()
    async with serve(_vllm_like(True, bodies)) as url:
        fixed = BenchConfig(
            url=url, num_prompts=3, dataset="sharegpt", dataset_path=path, sharegpt_output_len=3
        )
        await run_bench(fixed)
    assert sorted(b["prompt"] for b in bodies) == [[1, 2, 3, 4, 5], [7, 7, 7, 7], [9, 9, 9, 9]]
    assert {b["max_tokens"] for b in bodies} == {3}


async def test_custom_sends_each_lines_prompt_and_repeats_them_for_more(tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": _words(3, 4)}) + "\n\n" + json.dumps({"prompt": "w5"}))
    bodies: list[dict] = []
    async with serve(_vllm_like(True, bodies)) as url:
        config = BenchConfig(
            url=url, num_prompts=3, dataset="custom", dataset_path=str(path),
            custom_output_len=2, skip_chat_template=True,
        )  # fmt: skip
        report = await run_bench(config)
    prompts = [b["prompt"] for b in bodies]
    assert len(prompts) == 3 and {tuple(p) for p in prompts} == {(3, 4), (5,)}
    assert {b["max_tokens"] for b in bodies} == {2} and report["completed"] == 3
    assert "2 usable prompts for --num-prompts 3" in capsys.readouterr().err
    bodies.clear()
    async with serve(_vllm_like(True, bodies)) as url:  # chat: the text as the user message
        chat = BenchConfig(url=url, num_prompts=2, dataset="custom", dataset_path=str(path),
                           endpoint="chat")  # fmt: skip
        await run_bench(chat)
    assert sorted(b["messages"][0]["content"] for b in bodies) == ["w3 w4 ", "w5"]
    assert {b["max_tokens"] for b in bodies} == {256}  # (vLLM's default)
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="line 1 is not a JSON object with a string 'prompt'"):
        async with serve(_vllm_like(True, bodies)) as url:
            await run_bench(dataclass_replace(chat, url=url))


def dataclass_replace(config: BenchConfig, **changes) -> BenchConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


def test_dataset_flags_reach_the_config_and_bad_ones_name_the_flag(monkeypatch, tmp_path):
    path = _sharegpt(tmp_path / "sg.json")
    config = _config(monkeypatch, "--dataset-name", "sharegpt", "--dataset-path", path,
                     "--sharegpt-output-len", "9")  # fmt: skip
    assert (config.dataset, config.dataset_path, config.sharegpt_output_len) == (
        "sharegpt", path, 9
    )  # fmt: skip
    for flags, message in (
        (["--dataset-path", str(tmp_path / "none")], "--dataset-path .*none: no such file"),
        (["--dataset-path", path, "--num-turns", "2"], "--num-turns 2: random prompts only"),
        (["--dataset-path", path, "--random-range-ratio", "0.5"], "--random-range-ratio 0.5: "),
    ):
        with pytest.raises(ValueError, match=f"^{message}"):
            cmd_bench_serve(_parse("--dataset-name", "custom", *flags))


def test_vllm_flags_reach_the_config(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-o")
    monkeypatch.delenv("RLTSERVE_API_KEY", raising=False)
    config = _config(
        monkeypatch, "--model", "org/m", "--served-model-name", "m", "--tokenizer", "/t",
        "--extra-body", '{"max_loops": 4, "init_state": "zero"}', "--header", "X-A=1",
        "--header", "X-B = 2", "--top-p", "0.9", "--top-k", "5", "--min-p", "0.1",
        "--num-warmups", "2", "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1",
        "--ramp-up-end-rps", "4", "--label", "mine",
    )  # fmt: skip
    assert (config.model, config.model_id, config.tokenizer, config.api_key) == (
        "m", "org/m", "/t", "sk-o"
    )  # fmt: skip
    assert config.extra_body == {"max_loops": 4, "init_state": "zero"}
    assert config.headers == (("X-A", "1"), ("X-B", "2"))
    assert (config.top_p, config.top_k, config.min_p, config.num_warmups) == (0.9, 5, 0.1, 2)
    assert (config.ramp_up_strategy, config.ramp_up_start_rps, config.ramp_up_end_rps) == (
        "linear", 1.0, 4.0
    )  # fmt: skip
    assert (config.ignore_eos, _config(monkeypatch, "--ignore-eos").ignore_eos) == (False, True)
    monkeypatch.setenv("RLTSERVE_API_KEY", "sk-r")  # (OPENAI_API_KEY: the last fallback)
    assert _config(monkeypatch).api_key == "sk-r"
    assert _config(monkeypatch, "--api-key", "sk-a").api_key == "sk-a"


def test_ramp_up_rates_move_from_the_start_to_the_end_rate():
    def rates(strategy):
        config = BenchConfig(url="http://x", num_prompts=5, ramp_up_strategy=strategy,
                             ramp_up_start_rps=1.0, ramp_up_end_rps=16.0, seed=2)  # fmt: skip
        return serve_bench.request_rates(config), serve_bench.arrival_offsets(config)

    (linear, offsets), (exponential, _) = rates("linear"), rates("exponential")
    assert linear == [1.0, 4.75, 8.5, 12.25, 16.0]
    assert exponential == [1.0, 2.0, 4.0, 8.0, 16.0]
    # vLLM's: request i's delay drawn at request i's rate (the first's at the start rate, the
    # last's at the end rate), summed from the start; a ramp-up's offsets are not rescaled.
    rng = random.Random(3)  # (seed + 1: the arrivals' own stream)
    delays = [rng.gammavariate(1.0, 1.0 / rate) for rate in linear]
    assert offsets == list(itertools.accumulate(delays))


async def test_sharegpt_shuffles_every_entry_of_two_turns_as_vllm_then_walks_it(tmp_path, capsys):
    """vLLM's order: keep the entries of >= 2 turns, random.seed(seed) and shuffle them, walk
    them for turn 0 and turn 1; oversample with random.seed(seed) and a choice per request."""

    def conv(*turns):
        return {"conversations": [{"from": who, "value": _words(*ids)} for who, ids in turns]}

    data = [conv(("human", [i] * 4), ("gpt", [0] * 4)) for i in range(6)]
    data[2] = conv(("gpt", [2] * 4), ("gpt", [0] * 4))  # no human turn: kept all the same
    data.insert(4, conv(("human", [8] * 4)))  # one turn: left out before the shuffle
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))

    class Words:  # (the stand-in's /tokenize)
        async def tokenize(self, text):
            return [int(word[1:]) for word in text.split()]

    config = BenchConfig(url="http://x", num_prompts=8, dataset="sharegpt",
                         dataset_path=str(path), seed=7)  # fmt: skip
    requests = await text_requests(config, TokenCounter(Words()))
    order = list(range(6))
    random.Random(7).shuffle(order)  # (vLLM's random.seed(7); random.shuffle(data))
    assert [r.prompt for r in requests[:6]] == [[i] * 4 for i in order]
    again = random.Random(7)
    assert requests[6:] == [again.choice(requests[:6]) for _ in range(2)]
    assert "6 usable prompts for --num-prompts 8" in capsys.readouterr().err


def test_peaks_are_vllms_one_second_buckets():
    results = [  # sent at 0 s: tokens at 0.5, 1.0, 1.2 s; sent at 1.5 s: at 1.6 and 2.5 s
        RequestResult(4, True, 3, ttft=0.5, e2el=1.3, itl=[0.5, 0.2], start=0.0),
        RequestResult(4, True, 2, ttft=0.1, e2el=1.1, itl=[0.9], start=1.5),
        RequestResult(4, False, start=0.2, e2el=9.0),  # (a failure is not counted)
    ]
    assert peaks(results) == (3.0, 2)  # 1.0, 1.2 and 1.6 s; both requests in second 1
    assert isinstance(peaks(results)[1], int)  # (a count, an int in vLLM's report too)
    assert peaks([]) == (0.0, 0) and isinstance(peaks([])[1], int)


def test_the_report_has_vllms_keys_and_single_turn_lines():
    config = BenchConfig(url="http://x", model="m", model_id="org/m", label="mine")
    results = [RequestResult(4, True, 2, ttft=0.1, e2el=0.3, itl=[0.2], usage=True)]
    report = summarize(config, results, duration=1.0)
    keys = (
        "backend",
        "endpoint_type",
        "label",
        "model",
        "model_id",
        "tokenizer_id",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "requests_without_usage",
    )
    assert [report[k] for k in keys] == ["openai", "openai", "mine", "m", "org/m", "org/m",
                                         2.0, 1, 0]  # fmt: skip
    assert json.dumps(report["max_concurrent_requests"]) == "1"
    lines = format_report(report).splitlines()
    assert f"{'Peak output token throughput (tok/s):':<45}{'2.00':>15}" in lines
    assert f"{'Peak concurrent requests:':<45}{'1.00':>15}" in lines
    assert not any("Turns" in line or "Prefix cache" in line for line in lines)
    multi = summarize(BenchConfig(url="http://x", num_turns=2, endpoint="chat"), results, 1.0)
    assert multi["backend"] == "openai-chat"
    text = format_report(multi)
    assert "Turns per conversation:" in text and "Prefix cache hit rate:" in text


def test_random_prompts_leave_out_the_special_ids():
    pool = token_pool(6, frozenset({0, 5, 99}))
    assert list(pool) == [1, 2, 3, 4]
    config = BenchConfig(url="http://x", num_prompts=50, input_len=8, prefix_len=2)
    assert {i for p in random_prompts(config, 6, pool) for i in p} == {1, 2, 3, 4}
    assert token_pool(6) == range(6)


def test_a_saved_report_is_one_line_that_appends_add_to(tmp_path):
    path = tmp_path / "r.jsonl"
    write_result(path, {"a": 1, "b": [1, 2]}, append=False)  # (vLLM's json.dump: compact)
    assert path.read_text() == '{"a": 1, "b": [1, 2]}\n'
    write_result(path, {"c": 3}, append=True)
    assert path.read_text() == '{"a": 1, "b": [1, 2]}\n{"c": 3}\n'
    path.write_text('{"a": 1}')  # (no newline at its end: vLLM's own file)
    write_result(path, {"b": 2}, append=True)
    write_result(path, {"c": 3}, append=True)
    assert path.read_text() == '{"a": 1}\n{"b": 2}\n{"c": 3}\n'
    fresh = tmp_path / "new.jsonl"  # (vLLM's "a+": made if missing)
    write_result(fresh, {"d": 4}, append=True)
    assert fresh.read_text() == '{"d": 4}\n'


def test_append_result_alone_saves_and_headers_take_several_per_flag():
    assert saving(_parse("--append-result")) and not saving(_parse())
    args = _parse("--header", "X-A=1", "X-B = 2", "--header", "X-C=3", "--json")
    assert args.json and parse_headers(args.header) == (("X-A", "1"), ("X-B", "2"), ("X-C", "3"))
    assert _parse("--header").header == []  # (vLLM's nargs="*": no header)


def test_a_result_dir_that_cannot_be_made_is_a_usage_error(monkeypatch, tmp_path):
    async def connects(config):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr("rltserve.bench.serve.run_bench", connects)
    (tmp_path / "file").write_text("")
    under_file = str(tmp_path / "file" / "sub")
    with pytest.raises(ValueError, match=f"^--result-dir {under_file}: cannot be made"):
        cmd_bench_serve(_parse("--save-result", "--result-dir", under_file))


async def test_chat_against_a_server_without_detokenize_names_the_route():
    app = web.Application()  # (the stand-in's routes but /detokenize)
    for route in _vllm_like(True, []).router.routes():
        if route.resource.canonical != "/detokenize":
            app.router.add_route(route.method, route.resource.canonical, route.handler)
    async with serve(app) as url:
        config = BenchConfig(url=url, num_prompts=2, input_len=3, output_len=2, endpoint="chat")
        with pytest.raises(serve_bench.MissingRouteError, match="^POST /detokenize: .*404"):
            await run_bench(config)


async def test_a_stream_without_usage_is_counted_and_warned_of(capsys):
    async with serve(_vllm_like(False, [])) as url:
        config = BenchConfig(url=url, num_prompts=2, input_len=3, output_len=2, endpoint="chat")
        report = await run_bench(config)
    assert (report["requests_without_usage"], report["total_input_tokens"]) == (2, 6)
    assert "warning: 2 of 2 streams carried no usage" in capsys.readouterr().err


async def test_warmups_headers_and_request_ids_reach_the_server():
    bodies: list[dict] = []
    seen: list[tuple[str | None, str | None]] = []
    app = _vllm_like(True, bodies)

    @web.middleware
    async def record(request, handler):
        seen.append((request.headers.get("X-Tenant"), request.headers.get("X-Request-Id")))
        return await handler(request)

    app.middlewares.append(record)
    async with serve(app) as url:
        config = BenchConfig(url=url, num_prompts=2, input_len=3, output_len=2, num_warmups=3,
                             headers=(("X-Tenant", "a"),), request_id_prefix="b-")  # fmt: skip
        report = await run_bench(config)
    assert len(bodies) == 5 and report["completed"] == 2  # (the 3 warm-ups are not measured)
    assert bodies[0]["prompt"] == bodies[1]["prompt"] == bodies[2]["prompt"]
    # Every request has the header (the probes too: a gateway may ask for it everywhere); the
    # measured ones their ids, the warm-ups none (the server's).
    assert {tenant for tenant, _ in seen} == {"a"}
    assert sorted(i for _, i in seen if i is not None) == ["b-0", "b-1"]
    assert "extra_headers" not in bodies[-1]


def test_bench_host_takes_json():
    from rltserve.cli import build_parser

    args = build_parser().parse_args(["bench", "host", "--quick", "--json"])
    assert isinstance(args, argparse.Namespace) and args.json
