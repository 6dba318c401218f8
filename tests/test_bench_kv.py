"""The KV pressure comparison (``bench offline --kv-pressure``, formerly spelled
``--kv-reservation full --compare``) on a tiny checkpoint: structure and counts, no timings
asserted."""

from __future__ import annotations

import logging

import orjson
import pytest

from rltserve.bench.commands import print_report
from rltserve.bench.kv import format_report, pool_warnings
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
    free = report["unpressured"]
    for mode in ("recompute", "swap"):
        rate = report[f"ondemand_{mode}"]["output_tokens_per_s"]
        assert report["ratios"][f"{mode}_vs_unpressured_tokens_per_s"] == round(
            rate / free["output_tokens_per_s"], 3
        )
    # Blocks held at the peak: within each run's pool (the unpressured one holds 8 worst cases).
    assert 0 < report["full"]["peak_blocks"] <= report["num_blocks"]
    assert 0 < free["peak_blocks"] < 8 * report["num_blocks"]
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
        swapped = r["preemption_mode"] == "swap" and r["preemptions"] > r["swap_fallbacks"]
        assert ("swap" in r["step_kinds"]) == swapped
    # Every step is of one kind, timed apart; only swap copies make a swap step.
    for r in [report[name] for name in ("full", "ondemand_recompute", "unpressured")] + sweep:
        kinds = r["step_kinds"]
        assert sum(k["steps"] for k in kinds.values()) == r["steps"]
        assert {"decode", "chunks"} <= kinds.keys()  # (prompts, then their outputs)
        for k in kinds.values():
            assert 0 < k["model_ms_per_step"] <= k["ms_per_step"]
    assert "swap" not in report["unpressured"]["step_kinds"]
    # For people: a header, a line per run, a line per target (3, and 2 per pool).
    lines = format_report(report).splitlines()
    assert len(lines) == 2 + 4 + len(sweep) + 3 + 2 * len(pools)


def test_repeats_run_every_case_in_rounds_and_report_median_times(ouro_rv1, monkeypatch):
    import statistics

    import rltserve.bench.kv as kv

    order = []
    real = kv._run

    def spy(model, engine_kw, prompts, params):
        order.append(
            (
                engine_kw["num_blocks"],
                engine_kw.get("kv_reservation"),
                engine_kw.get("preemption_mode"),
                engine_kw.get("preemption_time_slice"),
            )
        )
        return real(model, engine_kw, prompts, params)

    monkeypatch.setattr(kv, "_run", spy)
    argv = [
        "bench", "offline", "--model", str(ouro_rv1), "--input-len", "6", "--output-len", "3",
        "--concurrency", "8", "--block-size", "4", "--kv-pressure", "--repeats", "3",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    report = run_offline_bench(args, engine_kwargs(args))["kv_pressure"]
    assert report["repeats"] == 3
    cases = 4 + len(report["sweep"])
    assert len(order) == 3 * cases
    assert order[:cases] == order[cases : 2 * cases] == order[2 * cases :]  # rounds, same order
    for run in [report[name] for name in ("full", "unpressured")] + report["sweep"]:
        rates = run["output_tokens_per_s_runs"]
        assert len(rates) == 3
        assert run["output_tokens_per_s"] == statistics.median(rates)
    free = report["unpressured"]["output_tokens_per_s"]
    for row in report["sweep"]:  # the loss compares medians
        assert row["loss_vs_unpressured"] == round(1 - row["output_tokens_per_s"] / free, 3)


def test_repeats_must_be_positive(ouro_rv1, capsys):
    from rltserve.cli import main

    argv = ["bench", "offline", "--model", str(ouro_rv1), "--kv-pressure", "--repeats", "0"]
    assert main(argv) != 0
    assert "--repeats 0: must be >= 1" in capsys.readouterr().err


def test_median_rounds_times_and_names_figures_that_differ():
    from rltserve.bench.kv import _median

    run = {"seconds": 0.1, "output_tokens_per_s": 0.1, "ms_per_step": 0.1}

    def kinds(ms: float, decode_steps: int = 6) -> dict:
        return {
            "decode": {"steps": decode_steps, "ms_per_step": ms, "model_ms_per_step": ms / 2},
            "chunks": {"steps": 3, "ms_per_step": 2 * ms, "model_ms_per_step": ms},
        }

    runs = [
        {**run, "model_ms_per_step": 0.1, "steps": 9, "loop_rows": 70, "step_kinds": kinds(0.1)},
        {**run, "output_tokens_per_s": 0.2, "model_ms_per_step": 0.2, "steps": 9,
         "loop_rows": 71, "step_kinds": kinds(0.3)},
    ]  # fmt: skip
    merged = _median(runs)
    assert merged["output_tokens_per_s"] == 0.15 and merged["model_ms_per_step"] == 0.15
    assert merged["output_tokens_per_s_runs"] == [0.1, 0.2]
    assert merged["steps"] == 9 and merged["differs_across_runs"] == ["loop_rows"]
    # Each kind's times are medians too; its step counts must agree like the other counts.
    assert merged["step_kinds"] == {
        "decode": {"steps": 6, "ms_per_step": 0.2, "model_ms_per_step": 0.1},
        "chunks": {"steps": 3, "ms_per_step": 0.4, "model_ms_per_step": 0.2},
    }
    assert "differs_across_runs" not in _median(runs[:1] * 2)
    runs[1]["step_kinds"] = kinds(0.3, decode_steps=5)
    assert _median(runs)["differs_across_runs"] == ["loop_rows", "step_kinds"]


def test_sweep_pools_are_distinct():
    from rltserve.bench.kv import _sweep_cases

    # A peak of 3 blocks: 70% and 85% both round to 2.
    pools = [case["num_blocks"] for _, case in _sweep_cases({}, 1, 3)]
    assert pools == [1] * 4 + [2] * 4


def test_repeats_apply_to_the_kv_pressure_runs_only(ouro_rv1, capsys):
    from rltserve.cli import main

    assert main(["bench", "offline", "--model", str(ouro_rv1), "--repeats", "2"]) != 0
    assert "--repeats 2: only the --kv-pressure runs repeat" in capsys.readouterr().err


def _made_up_report() -> dict:
    """A KV pressure report with round figures: unpressured 100 tok/s at a peak of 400 blocks,
    the main pool 200 blocks, a sweep at 200 and 300."""

    def run(tok_s: float, running: int = 8, steps: int = 10, pre: int = 0) -> dict:
        return {
            "output_tokens_per_s": tok_s, "peak_running": running, "steps": steps,
            "preemptions": pre, "loop_rows": 100, "ms_per_step": 2.5, "peak_blocks": 400,
        }  # fmt: skip

    sweep = []
    for pool, losses in ((200, {"recompute": (0.5, 0.35), "swap": (0.31, 0.2)}),
                         (300, {"recompute": (0.1, 0.299), "swap": (0.3, 0.4)})):  # fmt: skip
        for mode, (plain, sliced) in losses.items():
            for time_slice, loss in ((0, plain), (8, sliced)):
                sweep.append({**run(100 * (1 - loss), pre=3), "pool_blocks": pool,
                              "preemption_mode": mode, "preemption_time_slice": time_slice,
                              "loss_vs_unpressured": loss})  # fmt: skip
    return {
        "pool_requests": 2, "num_requests": 16, "max_tokens": 24, "stops_after": 3,
        "num_blocks": 200, "repeats": 3,
        "full": run(40, running=2, steps=40), "ondemand_recompute": run(70, pre=4),
        "ondemand_swap": run(90, pre=4), "sweep": sweep,
        "unpressured": {**run(100), "step_kinds": {
            "decode": {"steps": 7, "ms_per_step": 2.0, "model_ms_per_step": 1.5},
            "chunks": {"steps": 3, "ms_per_step": 3.6667, "model_ms_per_step": 3.0}}},
        "ratios": {"recompute_vs_full_running": 4.0, "recompute_vs_full_tokens_per_s": 1.75,
                   "swap_vs_full_tokens_per_s": 2.25},
    }  # fmt: skip


def test_the_report_for_people_lists_every_run_and_judges_every_target():
    lines = format_report(_made_up_report()).splitlines()
    assert lines[0] == (
        "KV pressure: 16 requests (max_tokens 24, each stopping after 3), a pool of 200 blocks "
        "(2 worst cases), attention pad budget 0; times are medians of 3 rounds"
    )
    assert lines[1].split() == [
        "run", "pool", "(of", "peak)", "mode", "slice", "running", "steps", "preemptions",
        "loop", "rows", "tok/s", "ms/step", "decode", "ms", "(steps)", "chunks", "ms", "(steps)",
        "swap", "ms", "(steps)", "lost",
    ]  # fmt: skip
    rows = [line.split() for line in lines[2:14]]
    assert [r[0] for r in rows] == ["full", "on-demand", "on-demand", "unpressured"] + ["sweep"] * 8
    assert rows[0][-1] == "60.0%" and rows[1][-1] == "30.0%"  # tokens/s lost vs unpressured
    assert rows[1][3:5] == ["recompute", "0"]  # (the engine's own time slice)
    # Time per step by kind, with the steps of that kind; "-" where the run had none. (The
    # unpressured run loses nothing: no loss column.)
    assert rows[3][-6:] == ["2.50", "2.00", "(7)", "3.67", "(3)", "-"]
    assert rows[4][:6] == ["sweep", "200", "(50%)", "recompute", "0", "8"]
    assert rows[4][-5:] == ["2.50", "-", "-", "-", "50.0%"]  # (without kinds: an older report)
    targets = lines[14:]
    assert targets[:3] == [
        "target: on-demand runs >= 4x the requests of full reservation: 4.00x, met",
        "target: recompute >= 2x the tokens/s of full reservation: 1.75x, not met",
        "target: swap >= 2x the tokens/s of full reservation: 2.25x, met",
    ]
    # Under pressure each mode's best slice per pool counts; < 30% is met, 30% is not.
    assert targets[3:] == [
        "target: recompute with a pool of 200 blocks (50% of the peak) loses < 30%: "
        "loses 35.0% at best (slice 8), not met",
        "target: swap with a pool of 200 blocks (50% of the peak) loses < 30%: "
        "loses 20.0% at best (slice 8), met",
        "target: recompute with a pool of 300 blocks (75% of the peak) loses < 30%: "
        "loses 10.0% at best (slice 0), met",
        "target: swap with a pool of 300 blocks (75% of the peak) loses < 30%: "
        "loses 30.0% at best (slice 0), not met",
    ]


def test_the_report_for_people_says_what_makes_its_figures_suspect():
    report = _made_up_report()
    report["ondemand_swap"]["swap_fallbacks"] = 2
    report["sweep"][3]["differs_across_runs"] = ["steps"]
    report["sweep"][3]["loss_vs_unpressured"] = -0.05  # (faster than unpressured: noise)
    lines = format_report(report).splitlines()
    assert lines[-2:] == [
        "note: ondemand_swap: 2 swaps fell back to recompute",
        "warning: sweep 200 swap 8: differs across rounds: ['steps']",
    ]
    assert lines[-5].endswith(
        "swap with a pool of 200 blocks (50% of the peak) loses < 30%: "
        "gains 5.0% at best (slice 8), met"
    )


def test_the_cli_prints_the_kv_report_as_a_table_unless_json(capsys):
    report = {"model": "m", "kv_pressure": _made_up_report()}
    print_report(report, as_json=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "model: m" and out[1].startswith("KV pressure: 16 requests")
    assert len(out) == 1 + 2 + 12 + 7
    print_report(report, as_json=True)
    assert orjson.loads(capsys.readouterr().out) == report


def test_step_kind_by_what_a_step_runs_besides_decode_tokens():
    from types import SimpleNamespace

    from rltserve.bench.kv import step_kind

    def plan(*items, swap_out=(), swap_in=()):
        return SimpleNamespace(items=list(items), swap_out=list(swap_out), swap_in=list(swap_in))

    decode = SimpleNamespace(num_tokens=1, token_ids=None)
    replay = SimpleNamespace(num_tokens=1, token_ids=[5])  # (given its input token)
    chunk = SimpleNamespace(num_tokens=8, token_ids=None)
    assert step_kind(plan(decode, decode)) == "decode"
    assert step_kind(plan(decode, chunk)) == step_kind(plan(replay)) == "chunks"
    assert step_kind(plan(decode, swap_out=[1])) == step_kind(plan(chunk, swap_in=[1])) == "swap"


def test_sweep_pools_above_the_main_pool_only_with_the_engines_time_slice():
    from rltserve.bench.kv import _sweep_cases

    # A peak of 12 blocks: 70% and 85% (8, 10) are not above a main pool of 10.
    assert {case["num_blocks"] for _, case in _sweep_cases({}, 10, 12)} == {10}
    cases = _sweep_cases({"preemption_time_slice": 3}, 2, 12)
    assert [key for key, _ in cases][:4] == [
        (2, "recompute", 0), (2, "recompute", 3), (2, "swap", 0), (2, "swap", 3),
    ]  # fmt: skip


@pytest.mark.parametrize("quiet, shown", [(False, ["a", "b", "other"]), (True, ["other"])])
def test_pool_warnings_show_each_pool_once_and_none_when_quiet(caplog, quiet, shown):
    logger = logging.getLogger("rltserve.core.kv_sizing")
    with caplog.at_level(logging.WARNING, logger=logger.name), pool_warnings(quiet):
        for pool in ("a", "a", "b", "a"):
            logger.warning("max_model_len lowered to %d: pool %s", 9, pool)
        logger.warning("other")
    assert [r.getMessage().split()[-1] for r in caplog.records] == shown
    caplog.clear()
    logger.warning("max_model_len lowered to %d: pool %s", 9, "a")  # (the filter is gone)
    assert len(caplog.records) == 1
