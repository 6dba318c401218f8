"""The offline benchmark's comparisons, on a tiny checkpoint (structure and consistency; no
timings are asserted)."""

from __future__ import annotations

from rltserve.bench import run_offline_bench
from rltserve.cli import build_parser, engine_kwargs


def bench(*argv: str) -> dict:
    args = build_parser().parse_args(["bench", "offline", *argv])
    return run_offline_bench(args, engine_kwargs(args))


def test_graphs_compare_on_cpu_runs_the_eager_cells(ouro_rv1):
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
        assert full["mean_exit_depth"] == 4.0 and adaptive["mean_exit_depth"] <= 4.0
        assert row["eager_vs_full_depth"] == round(
            adaptive["output_tokens_per_s"] / full["output_tokens_per_s"], 3
        )
        assert "graph_steps" not in adaptive  # no graphs were built
