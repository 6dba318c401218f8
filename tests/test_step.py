"""Step: the fast paths of decode rows give what the general paths give (the dense oracle's
tokens and exit depths), and the exit rule's thresholds compare as fp32 tensors would."""

from __future__ import annotations

import math

import pytest
import torch
from engine_util import make_core, oracle_run, random_workload, run_core

import rltserve.core.step_rows as step_rows
from rltserve.sampling import SamplingParams


class _Host:
    """What ``thresholds`` uses of the runner."""

    def tensor(self, values, dtype=None):
        return torch.tensor(values, dtype=dtype)

    def scalar(self, value):
        return torch.tensor(value, dtype=torch.float32)


def _value(t: torch.Tensor) -> float:
    assert t.dim() == 0 and t.dtype == torch.float32  # one scalar operand, in fp32
    return t.item()


def _thresholds(host, values, depths, min_loops, max_loops=None, modes=None):
    n = len(values)
    return step_rows.thresholds(
        host, values, depths, min_loops, max_loops or (8,) * n, modes or ("gate",) * n
    )


def test_thresholds_are_one_scalar_when_every_row_shares_it():
    host = _Host()
    assert _value(_thresholds(host, (0.8,) * 3, (2,) * 3, (1,) * 3)) == pytest.approx(0.8)
    # Before min_loops, or with threshold 1, the rule does not apply: inf, which no CDF reaches.
    assert _value(_thresholds(host, (0.8,) * 3, (1,) * 3, (2,) * 3)) == math.inf
    assert _value(_thresholds(host, (1.0,) * 2, (3,) * 2, (1,) * 2)) == math.inf
    # Different rows, one value once the rule is applied.
    assert _value(_thresholds(host, (1.0, 0.5), (3, 1), (1, 2))) == math.inf
    per_row = _thresholds(host, (0.8, 0.5, 0.7), (2, 1, 3), (1, 2, 1))
    assert per_row.dtype == torch.float32
    assert per_row.tolist() == [pytest.approx(0.8), math.inf, pytest.approx(0.7)]


def test_no_threshold_where_a_crossing_cannot_move_the_exit():
    """From the cap on a row exits anyway; a delayed row's crossing exits it at the next
    loop, so one loop before the cap its crossing is no news either."""
    host = _Host()
    caps, delayed, gate = (4,) * 2, ("delayed",) * 2, ("gate",) * 2
    assert _value(
        _thresholds(host, (0.8,) * 2, (2,) * 2, (1,) * 2, caps, delayed)
    ) == pytest.approx(0.8)
    assert _value(_thresholds(host, (0.8,) * 2, (3,) * 2, (1,) * 2, caps, delayed)) == math.inf
    assert _value(_thresholds(host, (0.8,) * 2, (3,) * 2, (1,) * 2, caps, gate)) == pytest.approx(
        0.8
    )
    assert _value(_thresholds(host, (0.8,) * 2, (4,) * 2, (1,) * 2, caps, gate)) == math.inf
    mixed = _thresholds(host, (0.8,) * 4, (3, 3, 2, 4), (1,) * 4, (4,) * 4, ("delayed", "gate") * 2)
    assert mixed.tolist() == [math.inf, pytest.approx(0.8), pytest.approx(0.8), math.inf]


def test_a_shared_threshold_compares_in_fp32_like_a_tensor_of_it():
    # fp32(0.7) < 0.7: compared in float64 this CDF would not reach its threshold.
    cdf = torch.tensor([0.7, 0.69999], dtype=torch.float32)
    one = _thresholds(_Host(), (0.7, 0.7), (2, 2), (1, 1))
    want = [True, False]
    assert torch.ge(cdf, one).tolist() == (cdf >= 0.7).tolist() == want
    assert (cdf >= torch.tensor([0.7, 0.7])).tolist() == want


def test_the_runners_scalars_are_kept_per_value_and_bounded(ckpts):
    """``ModelRunner.scalar``: one 0-dim fp32 CPU tensor per value, reused; the exit rule's
    ``1 - lam`` with it is torch's ``1.0 - lam``."""
    core = make_core(ckpts["ouro"])
    runner = core.runner
    one = runner.scalar(1.0)
    assert one is runner.scalar(1.0) and one.device.type == "cpu" and _value(one) == 1.0
    lam = torch.rand(64)
    assert torch.equal(torch.sub(one, lam), 1.0 - lam)
    for k in range(300):  # many distinct thresholds: the cache is cleared, never unbounded
        assert _value(runner.scalar(k / 1000)) == pytest.approx(k / 1000)
    assert len(runner._scalars) <= 256
    core.shutdown()


def test_row_positions_are_each_items_positions_in_order():
    class Host(_Host):
        device = torch.device("cpu")

    cases = [
        ([7], [512]),  # one chunk
        ([3, 9, 40], [1, 1, 1]),  # decode rows
        ([3, 0, 11], [1, 20, 1]),  # a chunk among decode rows (a list)
        ([30, 0, 100, 5], [64, 9, 1, 33]),  # chunks (numpy)
    ]
    for starts, counts in cases:
        got = step_rows.row_positions(Host(), starts, counts)
        assert got.dtype == torch.int64
        assert got.tolist() == [p for s, n in zip(starts, counts) for p in range(s, s + n)]


@pytest.mark.parametrize("exit_mode", ["gate", "delayed"])
def test_lockstep_decode_takes_the_fast_paths_and_matches_the_oracle(
    ckpts, ouro_ref, monkeypatch, exit_mode
):
    """Requests of one prompt length at a fixed depth step in lockstep: every step's states,
    gate states and decode inputs are an earlier step's rows in order, so nothing is gathered
    row by row; the tokens and depths are the oracle's."""
    gathered = []

    def counted(name):
        real = getattr(step_rows, name)
        return lambda *args: gathered.append(name) or real(*args)

    for name in ("gather_rows", "gather_tokens"):
        monkeypatch.setattr(step_rows, name, counted(name))
    prompts = [[(7 * i + k) % 300 + 1 for k in range(6)] for i in range(5)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, max_loops=3) for _ in prompts
    ]
    core = make_core(ckpts["ouro"], exit_mode=exit_mode, kv_policy="full")
    run = run_core(core, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="full", exit_mode=exit_mode)
        assert run.tokens[f"r{i}"] == want.tokens
        assert run.depths[f"r{i}"] == want.exit_depths == [3] * 6
    assert gathered == []


@pytest.mark.parametrize(
    ("exit_mode", "threshold", "unread_from"),
    [("gate", 0.999, 3), ("delayed", 0.999, 2), ("gate", 1.0, 1)],
)
def test_a_decode_batch_computes_no_gate_where_it_cannot_move_an_exit(
    ckpts, ouro_ref, monkeypatch, exit_mode, threshold, unread_from
):
    """A carried row's gate is not computed where no crossing can move its exit: at its cap,
    a delayed row from a loop before (its crossing would exit it at the cap), a fixed exit's
    (threshold 1: no adaptive exit) at every loop. The tokens and depths are the oracle's."""
    prompts = [[(7 * i + k) % 300 + 1 for k in range(6)] for i in range(5)]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, max_loops=3, exit_threshold=threshold
        )
        for _ in prompts
    ]
    core = make_core(ckpts["ouro"], exit_mode=exit_mode, kv_policy="full")
    model, carried = core.runner.model, core.runner.carried
    real = model.exit_logit
    depths = []  # the carried rows' depths at each gate computed

    def spy(state):
        depths.append(min(carried.depths, default=0))  # (0: no carried row, a prompt's step)
        return real(state)

    monkeypatch.setattr(model, "exit_logit", spy)
    run = run_core(core, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="full", exit_mode=exit_mode)
        assert run.tokens[f"r{i}"] == want.tokens
        assert run.depths[f"r{i}"] == want.exit_depths
    beside = {d for d in depths if d}
    assert beside == set(range(1, unread_from))  # computed below, and only below


def test_carried_rows_exiting_below_their_last_plane_copy_their_kv():
    """last_exited: a carried row exiting at depth d copies its position's K/V into the planes
    of depths d+1.. (its ``Carry.copy_blocks``), also past the model's own loops (a request's
    ``max_loops`` above them gives it more planes); rows at their last plane copy nothing."""
    from types import SimpleNamespace

    bs, loops = 4, 4  # the model's own loops; the requests have 6 planes

    class Host(_Host):
        block_size = bs
        spec = SimpleNamespace(num_loops=loops)

    tables = [[d] for d in range(6)]  # depth d's table: block d - 1 (one block each)
    carry = SimpleNamespace(copy_blocks=list(range(6)), tables=tables)
    items = [SimpleNamespace(carry=carry, num_tokens=1) for _ in range(2)]
    for depths, copied in (([5, 5], True), ([6, 6], False)):
        host = Host()
        host.kv = torch.arange(2 * 2 * 32, dtype=torch.float32).view(2, 2, 32, 1, 1)
        before = host.kv.clone()
        spec = object()  # (an exit spec: carried rows always have one)
        step_rows.copy_on_exit(host, items, [0, 1], [spec, spec], depths, [1, 2])
        # Positions 1 and 2 of depth 5's block (4) copied into depth 6's (5), nothing else.
        want = before.clone()
        if copied:
            want[:, :, 5 * bs + 1 : 5 * bs + 3] = before[:, :, 4 * bs + 1 : 4 * bs + 3]
        assert torch.equal(host.kv, want)


def test_a_decode_batch_past_the_models_loops_matches_the_oracle(ckpts, ouro_ref):
    """Requests looping past the model's own loops (``max_loops`` above them) exit in lockstep
    below their last plane, past the model's loops, and the next tokens loop deeper and read
    the exits' copies (last_exited). The tokens and depths are the oracle's."""
    core = make_core(ckpts["ouro"], exit_mode="trace")
    n = core.runner.spec.num_loops
    depths = [n, n + 1, n, n + 1, n + 2, n, n + 1, n]
    prompts = [[(5 * i + k) % 300 + 1 for k in range(5)] for i in range(3)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            max_loops=n + 2,
            trace_depths=depths,
            seed=i,
        )
        for i in range(len(prompts))
    ]
    run = run_core(core, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited", exit_mode="trace")
        assert run.tokens[f"r{i}"] == want.tokens
        assert run.depths[f"r{i}"] == want.exit_depths == depths


def test_staggered_requests_take_the_general_paths_and_match_the_oracle(
    ckpts, ouro_ref, monkeypatch
):
    """Different prompt lengths, thresholds and arrivals: items of a step come from several
    sources, out of order; the general paths gather them, with the oracle's results."""
    gathered = []
    real = step_rows.gather_rows
    monkeypatch.setattr(
        step_rows, "gather_rows", lambda *a, **k: gathered.append(1) or real(*a, **k)
    )
    prompts = [[(5 * i + k) % 300 + 1 for k in range(2 + 3 * i)] for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, exit_threshold=t)
        for t in (0.3, 0.9, 0.5, 1.0, 0.6, 0.4)
    ]
    core = make_core(ckpts["ouro"], prefill_chunk_size=4, max_num_batched_tokens=12)
    run = run_core(core, prompts, params, arrivals=[0, 1, 1, 3, 4, 6])
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited")
        assert run.tokens[f"r{i}"] == want.tokens
        assert run.depths[f"r{i}"] == want.exit_depths
    assert gathered


def test_pending_rows_settle_into_their_item_states():
    from rltserve.core.live import ItemState, PendingRows

    held = [ItemState(start=s) for s in (4, 9, 2)]
    state, gate = torch.zeros(5, 3), torch.zeros(2, 2)
    kept = torch.ones(2, 1)
    held[1].gate_src = kept  # not an output row of the step: its gate stays
    PendingRows(held, [0, 1, 3], state, None, [0, 2], gate).settle()
    assert [(h.src is state, h.e_src, h.row) for h in held] == [(True, None, r) for r in (0, 1, 3)]
    assert (held[0].gate_src is gate, held[0].gate_row) == (True, 0)
    assert (held[2].gate_src is gate, held[2].gate_row) == (True, 1)
    assert held[1].gate_src is kept
    PendingRows(held, range(3), state, None).settle()  # no gate computed: gates are current
    assert held[1].gate_src is kept and held[0].gate_src is gate


def test_a_decode_step_leaves_its_states_pending_for_the_same_items(ckpts):
    core = make_core(ckpts["ouro"], kv_policy="full")
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, max_loops=3)
    for i in range(3):
        core.add_request(f"r{i}", [1 + i, 2, 3], p)
    seen = 0
    while core.has_work():
        plan = core.plan()
        if plan is None:
            break
        gone = {*plan.released, *plan.preempted}
        # The step's items and positions: the runner's carried decode tokens first (those it
        # continues last among them; a carried row's position is the runner's column), then
        # the plan's.
        rows = core.runner.carried
        items = [
            (w.request_id, s) for w, s in zip(rows.items, rows.starts) if w.request_id not in gone
        ]
        result = core.runner.execute(plan)
        continued = {key for _, _, key in plan.continued}
        rows = core.runner.carried
        items += [
            (w.request_id, s)
            for w, s, k in zip(rows.items, rows.starts, rows.keys)
            if k in continued
        ]
        items += [(w.request_id, w.start) for w in plan.items]
        core.apply(plan, result)
        pending = core.runner.pending_rows
        if pending is not None:  # a step where no item ended: its items' fields lag
            seen += 1
            live = core.runner.live
            carried_rows = len(items) - len(plan.items)  # (one row each)
            # A carried row's state is in the runner's carried rows alone (the plan's carried
            # tokens joined them after the step), a plan item's in its request's live items.
            kept = core.runner.carried.held
            assert pending.held[:carried_rows] == kept[:carried_rows]
            joined = iter(kept[carried_rows:])
            for (rid, start), w, h in zip(
                items[carried_rows:], plan.items, pending.held[carried_rows:]
            ):
                assert h is (next(joined) if w.carry is not None else live[rid].items[start])
            assert all(start not in live[rid].items for rid, start in items[:carried_rows])
            rows_run = carried_rows + sum(w.num_tokens for w in plan.items)
            assert pending.state.shape[0] == result.num_rows == rows_run
    assert seen >= 4


def test_a_prompt_at_a_lower_cap_exits_there_beside_delayed_decode_rows(ckpts, ouro_ref):
    """Delayed exits: a request capped at 2 loops arrives while two capped at 5 decode, and its
    prompt reaches its cap in a step beside their carried rows (every row an output row, none
    of theirs at a cap): the step's lowest cap is the prompt's, whose output exits there. The
    tokens and depths are the oracle's."""
    prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, max_loops=cap, exit_threshold=0.9
        )
        for cap in (5, 5, 2)
    ]
    core = make_core(ckpts["ouro"], exit_mode="delayed", kv_policy="full")
    run = run_core(core, prompts, params, arrivals=[0, 0, 4])
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="full", exit_mode="delayed")
        assert run.tokens[f"r{i}"] == want.tokens
        assert run.depths[f"r{i}"] == want.exit_depths


def test_delayed_decisions_beside_prompt_chunks_match_the_oracle(ckpts, ouro_ref):
    """Delayed exits with chunked prefill and staggered arrivals: prompt chunks without an
    output sit among a step's output rows, and each delayed decision (aligned with the output
    rows) goes to its own item. The tokens and depths are the oracle's."""
    prompts, params, arrivals = random_workload(
        8, 1, (0.3, 0.5, 0.9), max_prompt=14, max_tokens=(3, 8), max_arrival=10
    )
    core = make_core(
        ckpts["ouro"], exit_mode="delayed", prefill_chunk_size=4, max_num_batched_tokens=12
    )
    run = run_core(core, prompts, params, arrivals=arrivals)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="last_exited", exit_mode="delayed")
        assert run.tokens[f"r{i}"] == want.tokens, f"request {i}"
        assert run.depths[f"r{i}"] == want.exit_depths, f"request {i}"


def test_every_sampled_token_comes_with_its_rank(ckpts, ouro_ref):
    """vLLM's rank (the count of logprobs >= the token's, under the model before the allowed
    ids) comes with every token: the prompt's first output (a plan item's result) and the
    carried decode tokens' (their events, also in a step where a plan item samples beside
    them) alike. The allowed ids keep the model's top tokens out, so the ranks are not all 1."""
    prompts = [[3, 14, 15], [9, 2, 6, 5, 35]]
    p = SamplingParams(
        temperature=0.0,
        max_tokens=5,
        ignore_eos=True,
        logprobs=0,
        exit_threshold=0.5,
        allowed_token_ids=tuple(range(100, 140)),
    )
    core = make_core(ckpts["ouro"], kv_policy="full")
    core.add_request("r0", prompts[0], p)
    got: dict[str, tuple[list, list]] = {}
    for step in range(1000):
        if step == 6:  # (its prompt's token exits beside r0's carried tokens)
            core.add_request("r1", prompts[1], p)
        elif not core.has_work():
            break
        plan = core.plan()
        if plan is None:
            break
        for u in core.apply(plan, core.runner.execute(plan)):
            tokens, ranks = got.setdefault(u.request_id, ([], []))
            tokens += u.new_token_ids
            ranks += u.new_ranks + [None] * (len(u.new_token_ids) - len(u.new_ranks))
    for i, prompt in enumerate(prompts):
        want = oracle_run(ouro_ref, prompt, p, kv_policy="full")
        tokens, ranks = got[f"r{i}"]
        assert tokens == want.tokens
        logps = [torch.log_softmax(logits.double(), dim=-1) for logits in want.logits]
        assert ranks == [int((lp >= lp[t]).sum()) for lp, t in zip(logps, tokens)]
        assert max(ranks) > 1
