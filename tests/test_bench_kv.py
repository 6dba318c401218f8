"""The KV pressure comparison (``bench offline --kv-pressure``, formerly spelled
``--kv-reservation full --compare``) on a tiny checkpoint: structure and counts, no timings
asserted."""

from __future__ import annotations

import pytest

from rltserve.bench.offline import run_offline_bench
from rltserve.cli import build_parser
from rltserve.engine_args import engine_kwargs


@pytest.mark.parametrize(
    "select", [["--kv-pressure"], ["--kv-reservation", "full", "--compare"]], ids=["flag", "old"]
)
def test_kv_pressure_compare(ouro_rv1, select):
    argv = [
        "bench", "offline", "--model", str(ouro_rv1), "--input-len", "6", "--output-len", "3",
        "--concurrency", "16", "--block-size", "4", *select,
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    report = run_offline_bench(args, engine_kwargs(args))["kv_pressure"]
    assert (report["pool_requests"], report["num_requests"], report["max_tokens"]) == (2, 16, 24)
    for name in ("full", "ondemand_recompute", "ondemand_swap", "unpressured"):
        assert report[name]["output_tokens"] == 16 * 3, name  # every request stops after 3
    assert report["full"]["peak_running"] == 2 and report["full"]["preemptions"] == 0
    assert report["ondemand_recompute"]["peak_running"] >= 8
    assert report["unpressured"]["preemptions"] == 0
    # Without recomputation every run does the same work: each (token, loop) once.
    rows = report["unpressured"]["loop_rows"]
    assert report["full"]["loop_rows"] == rows == 16 * (6 + 3 - 1) * 4  # full depth: 4 loops
    assert report["ondemand_recompute"]["loop_rows"] >= rows
    assert report["ratios"]["recompute_vs_full_running"] >= 4
    # The pressure sweep: the main pool first, then larger ones; both modes, without and with
    # time slicing (8 unless the engine sets one); every run serves every token.
    sweep = report["sweep"]
    pools = list(dict.fromkeys(r["pool_blocks"] for r in sweep))
    assert pools[0] == report["num_blocks"] and pools == sorted(pools)
    assert len(sweep) == 4 * len(pools)
    peak = report["unpressured"]["peak_blocks"]
    for r in sweep:
        assert r["output_tokens"] == 16 * 3
        assert r["pool_fraction"] == round(r["pool_blocks"] / peak, 3)
        assert r["preemption_time_slice"] in (0, 8)
        assert r["preemption_mode"] in ("recompute", "swap")
        assert r["time_slice_preemptions"] <= r["preemptions"]
        assert r["time_slice_preemptions"] == 0 or r["preemption_time_slice"] == 8
        assert r["steps_vs_unpressured"] == round(r["steps"] / report["unpressured"]["steps"], 3)
        # Per-step times: the model's share of a step is at most the step.
        assert 0 < r["model_ms_per_step"] <= r["ms_per_step"]
