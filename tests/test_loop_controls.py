"""Loop controls checked against the model as a request is made: a zero-shot criterion on a
model with an exit gate (Ouro) and a ``min_loops`` above the most loops the request runs are
errors naming the field, not settings silently ignored."""

from __future__ import annotations

import pytest
from engine_util import make_core, run_core

from rltserve.sampling import SamplingParams


def test_exit_criterion_on_a_gated_model_is_refused(ckpts):
    core = make_core(ckpts["ouro"])
    with pytest.raises(ValueError, match=r"^exit_criterion='kl': this model's tokens exit by"):
        core.make_request(None, [5, 6], SamplingParams(temperature=0.0, exit_criterion="kl"))


@pytest.mark.parametrize("family", ["huginn", "nanbeige"])
def test_a_model_without_a_gate_runs_max_loops_by_default(ckpts, family, tmp_path):
    path = ckpts.get(family)
    if path is None:  # (nanbeige: built here)
        from rltserve.models.presets import make_model

        path = make_model("nanbeige-tiny", tmp_path / "n")
    core = make_core(path)
    # Fixed depth, set by max_loops, is what it runs.
    run = run_core(
        core,
        [[5, 6]],
        [SamplingParams(temperature=0.0, max_tokens=2, max_loops=2, ignore_eos=True)],
    )
    assert run.depths["r0"] == [2, 2]


def test_min_loops_above_the_depth_is_refused(ckpts):
    core = make_core(ckpts["ouro"])  # 4 loops
    with pytest.raises(ValueError, match=r"^min_loops=5: above the 4 loops this request runs"):
        core.make_request(
            None, [5], SamplingParams(temperature=0.0, min_loops=5, exit_threshold=0.5)
        )
    core.make_request(
        None, [5], SamplingParams(temperature=0.0, min_loops=5, max_loops=6, exit_threshold=0.5)
    )
    huginn = make_core(ckpts["huginn"])
    with pytest.raises(ValueError, match=r"^min_loops=200: above the \d+ loops"):
        huginn.make_request(None, [5], SamplingParams(temperature=0.0, min_loops=200))
