"""The prefix caching and n-sharing comparisons (``bench offline --shared-prefix-len P --n K``) on
a tiny checkpoint: structure and prompt-token counts, no timings asserted."""

from __future__ import annotations

from rltserve.bench.offline import run_offline_bench
from rltserve.cli import build_parser
from rltserve.engine_args import engine_kwargs


def test_shared_prefix_and_n_compare(ouro_rv1):
    argv = [
        "bench", "offline", "--model", str(ouro_rv1), "--num-prompts", "4", "--input-len", "5",
        "--output-len", "2", "--block-size", "4", "--shared-prefix-len", "16", "--n", "2",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    report = run_offline_bench(args, engine_kwargs(args))["prefix_compare"]
    shared = report["shared_prefix"]
    assert shared["caching_off"]["prompt_tokens_computed"] == 4 * 21
    # The first computes all 21; the others reuse the 16-token prefix (4 full blocks).
    assert shared["caching_on"]["prompt_tokens_computed"] == 21 + 3 * 5
    for run in ("caching_off", "caching_on"):
        assert shared[run]["output_tokens"] == 4 * 2
    n = report["n_sharing"]
    assert (n["n"], n["prompts"]) == (2, 2)
    assert n["independent"]["prompt_tokens_computed"] == 4 * 5
    assert n["grouped"]["prompt_tokens_computed"] == 2 * 5 + 2 * 1  # followers: the last token
    assert n["ratios"]["prompt_tokens_computed_ratio"] == 12 / 20
