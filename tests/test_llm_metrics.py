"""``get_metrics``' request series (``llm_metrics``): histograms read as vLLM's reader gives
them (cumulative buckets keyed by Prometheus' ``le`` text), a request's tokens, time to first
token and finish counted once, the exit-depth series (of a run's outputs too), and what an
``OutputAssembler`` tells its observer: the tokens its outputs hold and the reason they report.
An LLM run's other counts: ``test_llm_vllm.py``."""

from __future__ import annotations

import pytest
from test_outputs import CharTokenizer

import rltserve
from rltserve.llm_metrics import RequestCounts, _Buckets
from rltserve.metrics_reader import Counter, Gauge, Histogram
from rltserve.outputs import OutputAssembler, TextDelta
from rltserve.updates import FinishReason, RequestUpdate

LABELS = {"model_name": "m", "engine": "0"}


def test_reader_classes_are_vllms_and_exported():
    h = Histogram("vllm:x", {}, count=2, sum=1.5, buckets={"1.0": 1, "+Inf": 2})
    assert (h.name, h.labels, h.count, h.sum, h.buckets) == ("vllm:x", {}, 2, 1.5, h.buckets)
    assert rltserve.Vector("vllm:v", {}, [1, 2]).values == [1, 2]
    for name in ("Metric", "Counter", "Gauge", "Histogram", "Vector"):
        assert getattr(rltserve, name) is getattr(rltserve.metrics_reader, name)
        assert name in rltserve.__all__
    assert issubclass(Counter, rltserve.Metric) and issubclass(Histogram, rltserve.Metric)


def test_buckets_are_cumulative_and_keyed_as_prometheus_writes_le():
    b = _Buckets((0.5, 1.0, 10.0))
    for value in (0.5, 0.7, 3.0, 20.0):  # (a value on a bound is in its bucket)
        b.observe(value)
    assert b.read("vllm:x", LABELS) == Histogram(
        "vllm:x", LABELS, 4, 24.2, {"0.5": 1, "1.0": 2, "10.0": 3, "+Inf": 4}
    )


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("rltserve.llm_metrics.time.monotonic", lambda: now[0])
    return now


def delta(n: int, finish: str | None = None) -> TextDelta:
    return TextDelta("", [7] * n, [1] * n, [], finish)


def test_a_request_counts_its_prompt_at_its_first_token_and_its_finish_once(clock):
    counts = RequestCounts(4)
    timer = counts.request(5)
    clock[0] = 100.25
    timer(delta(0))  # (an update without tokens: nothing yet)
    assert counts.prompt_tokens == 0
    timer(delta(2))
    clock[0] = 101.5
    timer(delta(1, "length"))
    timer(delta(4))  # (after its finish: not counted)
    timer.finish("abort")
    never = counts.request(9)
    never(delta(0, "abort"))  # (aborted before its first token: no prompt tokens, no TTFT)
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in counts.metrics("m")}
    assert metrics["vllm:prompt_tokens", None] == Counter("vllm:prompt_tokens", LABELS, 5)
    assert metrics["vllm:generation_tokens", None].value == 3
    success = {r: m.value for (name, r), m in metrics.items() if name == "vllm:request_success"}
    assert success == {"stop": 0, "length": 1, "abort": 1, "error": 0}
    ttft = metrics["vllm:time_to_first_token_seconds", None]
    assert (ttft.count, ttft.sum, ttft.buckets["0.25"], ttft.buckets["0.1"]) == (1, 0.25, 1, 0)
    e2e = metrics["vllm:e2e_request_latency_seconds", None]
    assert (e2e.count, e2e.sum, e2e.buckets["1.5"], e2e.buckets["1.0"]) == (2, 1.5, 2, 1)
    assert e2e.labels == LABELS and [m.name for m in counts.metrics("m")][:2] == [
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    ]


def observed(**kw) -> tuple[OutputAssembler, list[TextDelta]]:
    seen: list[TextDelta] = []
    return OutputAssembler("r", [1, 2], CharTokenizer(), observer=seen.append, **kw), seen


def test_the_assembler_tells_its_observer_what_the_output_holds():
    asm, seen = observed(stop=("c",))
    asm.add(RequestUpdate("r", [ord("a")], [1]))
    asm.add(RequestUpdate("r", [ord(c) for c in "bcde"], [1] * 4))  # a stop string cuts it
    assert [(len(d.token_ids), d.finish_reason) for d in seen] == [(1, None), (2, "stop")]
    assert sum(len(d.token_ids) for d in seen) == len(asm.output.token_ids) == 3
    asm.abandon()  # (finished: nothing more)
    assert len(seen) == 2
    # A refused request is not observed; a failure in assembling and a dropped stream are.
    asm, seen = observed()
    asm.add(RequestUpdate("r", finish_reason=FinishReason.ERROR, error="bad", rejected=True))
    assert seen == []
    asm, seen = observed()
    asm.fail(OverflowError("x"))
    assert [(d.finish_reason, d.error) for d in seen] == [
        ("error", "OverflowError while assembling output: x")
    ]
    asm, seen = observed()
    asm.add(RequestUpdate("r", [ord("a")], [1]))
    asm.abandon()
    assert [d.finish_reason for d in seen] == [None, "abort"] and asm.output.finish_reason is None


def test_exit_depths_are_the_servers_series_of_the_tokens_the_outputs_hold(clock):
    """``rltserve:token_exit_depth`` as ``/metrics`` has it (name, buckets, labels) and
    its mean as ``rltserve:loops_per_token``; a token after the finish is not counted."""
    counts = RequestCounts(40)
    timer = counts.request(3)
    labels = LABELS  # (the engine label too, as /metrics gives every engine series)
    assert counts.metrics("m")[-1] == Gauge("rltserve:loops_per_token", labels, 0.0)
    timer(TextDelta("", [7, 8], [2, 33], [], None))
    timer(TextDelta("", [9], [40], [], "length"))
    timer(TextDelta("", [9], [1], [], None))  # (finished: not counted)
    *_, depths, mean = counts.metrics("m")
    bounds = [*range(1, 33), 40]  # (the server's depth_buckets(40))
    assert depths.name == "rltserve:token_exit_depth" and depths.labels == labels
    assert list(depths.buckets) == [*(repr(float(b)) for b in bounds), "+Inf"]
    assert (depths.count, depths.sum) == (3, 75.0)
    assert (depths.buckets["1.0"], depths.buckets["2.0"], depths.buckets["32.0"]) == (0, 1, 1)
    assert depths.buckets["40.0"] == depths.buckets["+Inf"] == 3
    assert mean == Gauge("rltserve:loops_per_token", labels, 25.0)


def test_an_llm_runs_exit_depths_are_its_outputs(tiny):
    """get_metrics' exit-depth series against the outputs of a run that exits early."""
    params = rltserve.SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, exit_threshold=0.5, n=2
    )
    with rltserve.LLM(str(tiny), in_process=True, num_blocks=64, max_model_len=64) as llm:
        outs = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
        max_loops = llm.info.max_loops
    depths = [d for o in outs for c in o.outputs for d in c.exit_depths]
    histogram = metrics["rltserve:token_exit_depth"]
    assert len(depths) == 24 and len(set(depths)) > 1  # (exits at several depths)
    assert (histogram.count, histogram.sum) == (24, sum(depths))
    assert histogram.buckets == {
        **{repr(float(b)): sum(d <= b for d in depths) for b in range(1, max_loops + 1)},
        "+Inf": 24,
    }
    assert metrics["rltserve:loops_per_token"].value == sum(depths) / 24
