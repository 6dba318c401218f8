"""``rltserve bench rollout``: both arms run the same rollouts (same tokens per step), the
in-place arm updates its weights every step, and the report has the figures it promises."""

from __future__ import annotations

import functools

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
    assert report["step_speedup"] == round(restart["mean_step_s"] / inplace["mean_step_s"], 2)
    assert report["workload"]["n"] == 3


def test_rollout_rejects_bad_counts(capsys):
    assert main(["bench", "rollout", "--n", "0"]) == 2
    assert "--n 0: must be >= 1" in capsys.readouterr().err


def test_rollout_without_a_model_runs_the_demo_model(ouro_rv1, monkeypatch):
    monkeypatch.setattr("rltserve.models.demo.demo_model_path", lambda: ouro_rv1)
    flags = "--num-prompts 1 --n 1 --max-tokens 2 --input-len 4 --steps 1 --num-blocks 64"
    args = build_parser().parse_args(["bench", "rollout", *flags.split()])
    assert args.model is None
    report = run_rollout_bench(args, engine_kwargs(args))
    assert report["workload"]["model"] == str(ouro_rv1)
    assert report["in_place"]["tokens_per_step"] == 2


def test_both_arms_build_their_engines_on_the_requested_device_and_dtype(ouro_rv1, monkeypatch):
    # The restart arm starts a new LLM every step: each one must get --device/--dtype too, or a
    # GPU run would time a CPU float32 baseline against a GPU in-place arm.
    from rltserve.llm import LLM

    built: list[dict] = []
    real_init = LLM.__init__

    @functools.wraps(real_init)  # keeps the signature the bench filters its kwargs by
    def recording_init(self, *args, **kwargs):
        built.append(kwargs)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "__init__", recording_init)
    flags = "--num-prompts 1 --n 2 --max-tokens 2 --input-len 4 --steps 2 --num-blocks 64"
    argv = ["bench", "rollout", "--model", str(ouro_rv1), "--dtype", "bfloat16", *flags.split()]
    args = build_parser().parse_args([*argv, "--device", "cpu"])
    report = run_rollout_bench(args, engine_kwargs(args))
    assert len(built) == 1 + 2  # one in-place engine, one per restart step
    assert [(kw.get("device"), kw.get("dtype")) for kw in built] == [("cpu", "bfloat16")] * 3
    assert [kw["model"] == str(ouro_rv1) for kw in built] == [True, False, False]
    assert report["in_place"]["tokens_per_step"] == report["restart"]["tokens_per_step"] == 4


def test_summary_means_per_step_and_rate_over_generation_time():
    from rltserve.bench.rollout import _summary

    steps = [
        {"wall_s": 1.0, "weights_s": 0.2, "generate_s": 0.8, "tokens": 8},
        {"wall_s": 3.0, "weights_s": 0.4, "generate_s": 2.4, "tokens": 24},
    ]
    assert _summary(steps, {"startup_s": 0.5}) == {
        "mean_step_s": 2.0, "steps_s": [1.0, 3.0], "mean_weights_s": 0.3,
        "rollout_tokens_per_s": 10.0, "tokens_per_step": 16, "startup_s": 0.5,
    }  # fmt: skip


def test_each_step_samples_with_its_own_seed_and_ignores_eos():
    import argparse

    from rltserve.bench.rollout import _params

    args = argparse.Namespace(n=3, temperature=0.7, max_tokens=5, exit_threshold=0.5)
    p = _params(args, 2)
    assert (p.n, p.temperature, p.max_tokens, p.exit_threshold) == (3, 0.7, 5, 0.5)
    assert (p.seed, p.ignore_eos) == (2, True)
