"""The offline benchmark's comparisons, on a tiny checkpoint (structure and consistency; no
timings are asserted)."""

from __future__ import annotations

import random

from engine_util import oracle_run

from rltserve.bench.offline import run_offline_bench
from rltserve.cli import build_parser
from rltserve.engine_args import engine_kwargs
from rltserve.sampling import SamplingParams


def bench(*argv: str) -> dict:
    args = build_parser().parse_args(["bench", "offline", *argv])
    return run_offline_bench(args, engine_kwargs(args))


def test_graphs_compare_on_cpu_runs_the_eager_cells(ouro_rv1, ouro_ref):
    report = bench(
        "--model", str(ouro_rv1), "--input-len", "6", "--output-len", "3",
        "--exit-threshold", "0.5", "--cuda-graphs", "--compare", "--concurrency-list", "1,3",
    )  # fmt: skip
    cmp = report["graphs_compare"]
    assert cmp["modes"] == ["eager"] and "CUDA device" in cmp["note"]
    assert cmp["exit_thresholds"] == [0.5, 1.0]
    for concurrency, num_prompts in (("1", 4), ("3", 6)):
        row = cmp[concurrency]
        adaptive, full = row["eager_q0.5"], row["eager_q1.0"]
        assert adaptive["output_tokens"] == full["output_tokens"] == 3 * num_prompts
        assert full["mean_exit_depth"] == 4.0
        # The bench's workload (seeded by the concurrency) through the oracle: the adaptive
        # cell's mean exit depth is a value the bench could get wrong.
        rng = random.Random(int(concurrency))
        prompts = [[rng.randrange(384) for _ in range(6)] for _ in range(num_prompts)]
        p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, exit_threshold=0.5)
        depths = [
            d
            for q in prompts
            for d in oracle_run(ouro_ref, q, p, kv_policy="last_exited").exit_depths
        ]
        assert adaptive["mean_exit_depth"] == round(sum(depths) / len(depths), 3)
        assert adaptive["mean_exit_depth"] < 4.0
        assert row["eager_vs_full_depth"] > 0
        assert "graph_steps" not in adaptive  # no graphs were built


def test_max_loops_sets_the_depth_huginn_runs_at(huginn_rv1):
    report = bench(
        "--model", str(huginn_rv1), "--input-len", "4", "--output-len", "3",
        "--num-prompts", "2", "--max-loops", "3",
    )  # fmt: skip
    assert report["max_loops"] == 3 and report["refill"]["mean_exit_depth"] == 3.0


def test_exit_criterion_is_compared_with_full_depth(huginn_rv1):
    report = bench(
        "--model", str(huginn_rv1), "--input-len", "4", "--output-len", "4", "--num-prompts",
        "3", "--exit-criterion", "entropy-diff", "--exit-threshold", "0.6", "--compare",
    )  # fmt: skip
    assert (report["exit_criterion"], report["exit_threshold"]) == ("entropy-diff", 0.6)
    assert report["full_depth"]["mean_exit_depth"] == 4.0
    assert report["refill"]["mean_exit_depth"] < 4.0
    assert report["refill"]["output_tokens"] == report["full_depth"]["output_tokens"] == 12


def test_disaggregate_compares_one_stage_with_two(tiny):
    report = bench(
        "--model", str(tiny), "--disaggregate", "--block-size", "4", "--input-len", "12",
        "--output-len", "3", "--num-prompts", "3",
    )  # fmt: skip
    cmp = report["pd_compare"]
    for arm in ("one_stage", "disaggregated"):
        assert cmp[arm]["steps"] > 0 and cmp[arm]["ttft_mean_ms"] > 0
        assert cmp[arm]["itl_mean_ms"] > 0
    assert cmp["disaggregated_vs_one_stage"] > 0
