"""Loop controls checked against the model as a request is made: a zero-shot criterion on a
model with an exit gate (Ouro) and a ``min_loops`` above the most loops the request runs are
errors naming the field, not settings silently ignored."""

from __future__ import annotations

import pytest
from engine_util import make_core, oracle_run, run_core

from rltserve.sampling import SamplingParams


def test_exit_criterion_on_a_gated_model_is_refused(ckpts):
    core = make_core(ckpts["ouro"])
    with pytest.raises(ValueError) as info:
        core.make_request(None, [5, 6], SamplingParams(temperature=0.0, exit_criterion="kl"))
    assert str(info.value) == (
        "exit_criterion='kl': this model's tokens exit by its learned gate (exit_threshold); "
        "the zero-shot criteria are for models without one (Huginn, Nanbeige)"
    )


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
@pytest.mark.parametrize("init_state", ["random", "zero"])
def test_init_state_on_a_model_without_a_recurrent_state_is_refused(
    ckpts, family, init_state, tmp_path
):
    """Only Huginn starts its loops from a state a request chooses; elsewhere the field would
    be ignored, so a value is refused (left out, None, it is the model's)."""
    core = make_core(_checkpoint(ckpts, family, tmp_path))
    with pytest.raises(ValueError) as info:
        core.make_request(None, [5], SamplingParams(temperature=0.0, init_state=init_state))
    assert str(info.value) == (
        f"init_state={init_state!r}: this model has no recurrent initial state to set (it "
        "starts from the embedding); init_state is for Huginn"
    )
    core.make_request(None, [5], SamplingParams(temperature=0.0))


def test_init_state_is_huginns_to_set_and_random_when_left_out(ckpts, huginn_ref):
    core = make_core(ckpts["huginn"])
    seeded = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seed=7, max_loops=3)
    params = [seeded, seeded.replace(init_state="random"), seeded.replace(init_state="zero")]
    run = run_core(core, [[5, 6]] * 3, params)
    for rid, init_state in (("r0", "random"), ("r1", "random"), ("r2", "zero")):
        want = oracle_run(huginn_ref, [5, 6], seeded.replace(init_state=init_state))
        assert (run.tokens[rid], run.depths[rid]) == (want.tokens, want.exit_depths), rid


def _checkpoint(ckpts, family, tmp_path):
    path = ckpts.get(family)
    if path is None:  # (nanbeige: built here)
        from rltserve.models.presets import make_model

        path = make_model("nanbeige-tiny", tmp_path / "n")
    return path


@pytest.mark.parametrize("family", ["huginn", "nanbeige"])
def test_a_model_without_a_gate_runs_max_loops_by_default(ckpts, family, tmp_path):
    core = make_core(_checkpoint(ckpts, family, tmp_path))
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
