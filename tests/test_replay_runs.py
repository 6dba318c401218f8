"""Recompute after preemption with replay runs in lockstep (``Wavefront.start_runs``): the runs
of a preempted request's generated tokens start in one step, with the last chunk of its
prompt when that is recomputed too, and loop together, each to its recorded exit depth, so a
replay takes about as many steps as its deepest item has loops. Token
ids and exit depths stay the oracle's under token budgets that split the runs of one replay
across steps, with chunked and wavefront prefill, async scheduling and time slicing."""

from __future__ import annotations

import pytest
from engine_util import count_grouped_attention, make_core, run_core, tight_blocks
from test_preemption import _assert_empty, _oracle, _workload


def _pressured(ckpts, prompts, params, arrivals, **kw):
    kw = {"block_size": 4, "kv_watermark": 0.0, "preemption_mode": "recompute", **kw}
    core = make_core(
        ckpts["ouro"], num_blocks=tight_blocks(ckpts["ouro"], prompts, params, **kw), **kw
    )
    started = []  # per step: the replay runs started in lockstep
    core.with_prompt = 0  # steps where runs start with the last prompt chunk they replay after
    schedule = core.scheduler.schedule

    def spy():
        plan = schedule()
        if plan is not None:
            started.append(sum(1 for r in core.scheduler.running for it in r.items if it.lockstep))
            for r in core.scheduler.running:
                p = r.num_prompt_tokens
                firsts = [w for w in plan.items if w.request_id == r.request_id and w.depth == 1]
                if any(w.start < p <= w.start + w.num_tokens for w in firsts) and any(
                    w.start >= p for w in firsts
                ):
                    core.with_prompt += 1
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
    assert core.with_prompt >= 1  # ... and with the last prompt chunk before them
    _oracle(ouro_ref, run, prompts, params, "last_exited", case.get("exit_mode", "gate"))


@pytest.mark.parametrize("pad_budget", [0, 1 << 20], ids=["groups", "one-padded-batch"])
def test_replay_with_one_padded_attention_batch_equals_oracle(
    ckpts, ouro_ref, monkeypatch, pad_budget
):
    """Within a pad budget (``attention_pad_budget``, for GPUs) a step's replay runs, prompt
    chunks and decode rows attend as one padded batch instead of groups: the same tokens and
    depths."""
    grouped = count_grouped_attention(monkeypatch)
    prompts, params, arrivals = _workload(
        6, seed=13, thresholds=(0.5, 0.3, 1.0), max_tokens=(14, 20)
    )
    kw = {"max_num_batched_tokens": 6, "prefill_chunk_size": 3, "preemption_time_slice": 2}
    core, started = _pressured(
        ckpts, prompts, params, arrivals, attention_pad_budget=pad_budget, **kw
    )
    assert core.runner._attention.pad_budget == pad_budget
    run = run_core(core, prompts, params, arrivals=arrivals)
    _assert_empty(core)
    assert core.stats().num_preemptions >= 3 and max(started) >= 2
    assert (len(grouped) > 0) == (pad_budget == 0)  # groups only without the budget
    _oracle(ouro_ref, run, prompts, params, "last_exited", "gate")
