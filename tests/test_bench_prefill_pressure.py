"""The prefill pressure workload (``bench offline --kv-pressure prefill``) on ouro-tiny: its
requests preempt themselves during their chunked prefill, and a request that did waits for
room for what it was growing to before it is re-admitted (``Request.resume_need``): preemptions
stay near one per request (re-admitted at once it preempted itself again every few steps:
61 preemptions under wavefront prefill with async scheduling, 22 since), and every output
equals the unpressured run's. Counts only, no timings."""

from __future__ import annotations

import pytest

from rltserve.bench.commands import print_report
from rltserve.bench.prefill_pressure import (
    NUM_PROMPTS,
    PREFIX_LENS,
    PROMPT_LENS,
    format_report,
    run_prefill_pressure,
    workload,
)
from rltserve.cli import build_parser, main
from rltserve.engine_args import engine_kwargs
from rltserve.models import load_model


def test_the_workload_is_fixed_and_shares_prefixes():
    prompts, max_tokens = workload(512)
    assert (prompts, max_tokens) == workload(512)
    assert len(prompts) == NUM_PROMPTS and max_tokens[:3] == [None, 30, 60]
    assert all(PROMPT_LENS[0] <= len(p) <= PROMPT_LENS[1] for p in prompts)
    family = len(PREFIX_LENS)
    for i in range(family, NUM_PROMPTS):  # (a family's prefix, cut to leave 8 of its own)
        shared = min(PREFIX_LENS[i % family], len(prompts[i]) - 8, len(prompts[i - family]) - 8)
        assert prompts[i][:shared] == prompts[i - family][:shared]


@pytest.fixture(scope="module")
def report(tiny):
    argv = ["bench", "offline", "--model", str(tiny), "--kv-pressure", "prefill"]
    args = build_parser().parse_args(argv)
    assert args.kv_pressure == "prefill"
    engine_kw = engine_kwargs(args)
    model = load_model(str(tiny), dtype=engine_kw["dtype"], device=engine_kw["device"])
    return run_prefill_pressure(model, engine_kw, args, modes=("wavefront_async",))


def test_self_preemption_during_prefill_is_not_repeated(report):
    assert report["num_blocks"] == 60  # (15 blocks of 16 on each of ouro-tiny's 4 planes)
    row = report["modes"]["wavefront_async"]
    free = row["unpressured"]
    assert free["preemptions"] == 0 and free["peak_running"] == NUM_PROMPTS
    for mode in ("recompute", "swap"):
        run = row[mode]
        assert run["outputs_match_unpressured"], mode
        assert run["output_tokens"] == free["output_tokens"]
        # Pressure is real: requests preempt (themselves: the pool holds about one)...
        assert run["preemptions"] >= NUM_PROMPTS // 2, mode
        # ... but not again on each re-admission (61 preemptions before, 22 since).
        assert run["preemptions"] <= 2 * NUM_PROMPTS, mode
    # A recompute repeats what its requests had run, not what they ran over and over
    # (18076 loop rows before, 12960 since, 7640 unpressured).
    assert row["recompute"]["loop_rows"] < 2 * free["loop_rows"]
    assert row["swap"]["swap_fallbacks"] == 0


def test_the_report_for_people(report, capsys):
    text = format_report(report)
    assert text.splitlines()[0].startswith(f"prefill pressure: {NUM_PROMPTS} prompts of")
    assert "max_model_len 200, a pool of 60 blocks, steps of 48 tokens" in text
    rows = [line.split() for line in text.splitlines()[2:]]
    assert [r[:2] for r in rows] == [
        ["wavefront_async", "unpressured"],
        ["wavefront_async", "recompute"],
        ["wavefront_async", "swap"],
    ]
    assert [r[-1] for r in rows] == ["-", "yes", "yes"]
    print_report({"model": "m", "prefill_pressure": report}, as_json=False)
    assert "wavefront_async  recompute" in capsys.readouterr().out


def test_the_flag_runs_alone(capsys):
    argv = ["bench", "offline", "--kv-pressure", "prefill", "--compare"]
    assert main(argv) != 0
    assert "--kv-pressure prefill: a benchmark of its own" in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "offline", "--kv-pressure"]).kv_pressure == "decode"
