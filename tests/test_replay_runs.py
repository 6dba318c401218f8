"""Recompute after preemption with replay runs in lockstep (``Wavefront.start_runs``): the runs
of a preempted request's generated tokens start in one step and loop together, each to its
recorded exit depth, so a replay takes about as many steps as its deepest run has loops. Token
ids and exit depths stay the oracle's under token budgets that split the runs of one replay
across steps, with chunked and wavefront prefill, async scheduling and time slicing."""

from __future__ import annotations

import pytest
from engine_util import make_core, run_core
from test_preemption import _assert_empty, _oracle, _workload
from test_preemption import _tight_blocks as tight_blocks


def _pressured(ckpts, prompts, params, arrivals, **kw):
    kw = {"block_size": 4, "kv_watermark": 0.0, "preemption_mode": "recompute", **kw}
    core = make_core(
        ckpts["ouro"], num_blocks=tight_blocks(ckpts["ouro"], prompts, params, **kw), **kw
    )
    started = []  # per step: the replay runs started in lockstep
    schedule = core.scheduler.schedule

    def spy():
        plan = schedule()
        if plan is not None:
            started.append(sum(1 for r in core.scheduler.running for it in r.items if it.lockstep))
        return plan

    core.scheduler.schedule = spy
    return core, started


@pytest.mark.parametrize(
    "case",
    [
        {"max_num_batched_tokens": 32, "prefill_chunk_size": 8},
        {"max_num_batched_tokens": 4, "prefill_chunk_size": 2},
        {"max_num_batched_tokens": 7, "prefill_chunk_size": 4, "wavefront_prefill": True},
        {
            "max_num_batched_tokens": 9,
            "prefill_chunk_size": 4,
            "async_scheduling": True,
            "exit_mode": "delayed",
            "lag": 1,
        },
        {"max_num_batched_tokens": 6, "prefill_chunk_size": 3, "preemption_time_slice": 2},
    ],
    ids=["roomy-budget", "tight-budget", "wavefront", "async-delayed", "time-sliced"],
)
def test_lockstep_replay_equals_oracle(ckpts, ouro_ref, case):
    prompts, params, arrivals = _workload(
        6, seed=13, thresholds=(0.5, 0.3, 1.0), max_tokens=(14, 20)
    )
    kw = dict(case)
    lag = kw.pop("lag", 0)
    core, started = _pressured(ckpts, prompts, params, arrivals, **kw)
    run = run_core(core, prompts, params, arrivals=arrivals, lag=lag)
    _assert_empty(core)
    assert core.stats().num_preemptions >= 3
    assert max(started) >= 2  # runs did loop in lockstep
    _oracle(ouro_ref, run, prompts, params, "last_exited", case.get("exit_mode", "gate"))
