"""``rltserve bench rollout``: both arms run the same rollouts (same tokens per step), the
in-place arm updates its weights every step, and the report has the figures it promises."""

from __future__ import annotations

from rltserve.bench.rollout import run_rollout_bench
from rltserve.cli import build_parser, main
from rltserve.engine_args import engine_kwargs


def test_rollout_report(ouro_rv1):
    flags = "--num-prompts 2 --n 3 --max-tokens 4 --input-len 5 --steps 2 --num-blocks 64"
    argv = ["bench", "rollout", "--model", str(ouro_rv1), *flags.split()]
    args = build_parser().parse_args(argv)
    report = run_rollout_bench(args, engine_kwargs(args))
    inplace, restart = report["in_place"], report["restart"]
    assert inplace["tokens_per_step"] == restart["tokens_per_step"] == 2 * 3 * 4
    assert inplace["weight_version"] == 2
    assert len(inplace["steps_s"]) == len(restart["steps_s"]) == 2
    assert inplace["rollout_tokens_per_s"] > 0 and inplace["startup_s"] > 0
    assert report["step_speedup"] > 0
    assert report["workload"]["n"] == 3


def test_rollout_rejects_bad_counts(capsys):
    assert main(["bench", "rollout", "--n", "0"]) == 2
    assert "--n 0: must be >= 1" in capsys.readouterr().err
