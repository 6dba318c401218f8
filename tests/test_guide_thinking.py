"""Structured outputs with bounded thinking (``core/guide.py`` with ``core/thinking.py``): the
constraint applies to the answer after the thinking span, whether the model closes the span
itself or the budget forces its end (the forced ids are not sampled: the guide turns active at
the token that spends the budget and masks the first token after them). A greedy request is the
oracle's (``reference_guided.Answer``: the budget's forced ids, then the argmax over what the
constraint allows); every engine mode (chunked, wavefront, async, recompute and swap
preemption, whose resumed guide skips the forced ids among its outputs, two stages) gives the
synchronous run's outputs."""

from __future__ import annotations

import json
import re

import pytest
from engine_util import ENGINE_MODES, oracle_run, run_mode, run_pd
from reference import Reference
from reference_guided import Answer, Constraint, ThinkingBudget

from rltserve.core.guide import Guide
from rltserve.core.live import LiveRequest
from rltserve.guide_index import bind
from rltserve.models.tokenizer import load_tokenizer
from rltserve.sampling import SamplingParams
from rltserve.structured import StructuredOutputsParams

PROMPTS = [[11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [300], [7, 8, 9, 10, 11], [9, 2]]
REGEX = "[0-9]{3}-[a-z]{2}"
SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer"}, "color": {"enum": ["red", "green"]}},
    "required": ["age", "color"],
}


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(tiny)


@pytest.fixture(scope="module")
def end(tok) -> int:
    return tok.get_vocab()["</think>"]


@pytest.fixture(scope="module")
def interruption(tok) -> tuple[int, ...]:
    return tuple(tok.encode(" Time is up.", add_special_tokens=False))


def budgeted(tok, end, interruption, structured, budget: int, **kw) -> SamplingParams:
    p = SamplingParams(
        structured_outputs=structured,
        max_thinking_tokens=budget,
        thinking_end_token_ids=(end,),
        thinking_interruption=interruption,
        **kw,
    )
    return bind(p, tok)


def workload(tok, end, interruption) -> list[SamplingParams]:
    """Greedy and seeded requests: a budget spent, a budget of 0, one the thinking never
    reaches (a bias makes the model close the span at once), adaptive exits, logprobs."""
    b = lambda *a, **kw: budgeted(tok, end, interruption, *a, **kw)  # noqa: E731
    return [
        b(StructuredOutputsParams(json=SCHEMA), 4, temperature=0.0, max_tokens=50),
        b(StructuredOutputsParams(choice=["yes", "no", "maybe so"]), 0, seed=7, max_tokens=30),
        b(StructuredOutputsParams(regex=REGEX), 5, seed=3, max_tokens=40, logprobs=2),
        b(StructuredOutputsParams(regex="[a-z]{6}"), 2, temperature=0, exit_threshold=0.5),
        b(StructuredOutputsParams(regex="[0-9]{2}"), 9, seed=4, logit_bias={end: 100.0}),
    ]


def answer(tok, ids: list[int], end: int) -> str:
    """The text after the span's end (the whole output where the span never closed)."""
    return tok.decode(ids[ids.index(end) + 1 :])


def test_a_budgeted_guide_is_inactive_until_the_span_closes(tok, end):
    """The span closes at its end ids or after the budget's K-th token (the forced ids never
    reach a live guide); a budget of 0 leaves none; a replay skips the forced ids."""
    p = budgeted(tok, end, (), StructuredOutputsParams(choice=["yes", "no"]), 2)
    guide = Guide.of(p.structured_outputs, p)
    guide.advance(7)
    assert not guide.active
    guide.advance(8)  # (the budget's K-th token: the end is forced after it)
    assert guide.active and guide.allowed() == Guide.of(p.structured_outputs).allowed()
    closed = Guide.of(p.structured_outputs, p)
    closed.advance(end)
    assert closed.active
    assert Guide.of(p.structured_outputs, p.replace(max_thinking_tokens=0)).active
    yes = tok.encode("yes", add_special_tokens=False)
    live = Guide.of(p.structured_outputs, p).replay([7, 8, *yes])
    resumed = Guide.of(p.structured_outputs, p).replay([7, 8, end, *yes], num_forced=1)
    assert resumed.state == live.state and resumed.allowed() == [live.compiled.eos]
    two = p.replace(thinking_end_token_ids=(5, 6), max_thinking_tokens=9)
    pair = Guide.of(p.structured_outputs, two).replay([6, 5])
    assert not pair.active  # (a multi-token end closes the span only when whole)
    pair.advance(6)
    assert pair.active


@pytest.mark.parametrize("budget", [0, 3, "closed"])
def test_greedy_output_is_the_oracles_answer_after_the_span(tiny, tok, end, interruption, budget):
    """The oracle's run: thinking (argmax), the forced ids, then the argmax over what the
    constraint allows after the answer so far. "closed": the model samples the end itself
    before a budget of 4 is spent (the end named is its second greedy token)."""
    ref = Reference.load(tiny)
    k, end_ids = budget, (end,)
    if budget == "closed":
        k, end_ids = 4, (ref.generate(PROMPTS[0], 2, kv_policy="last_exited").tokens[1],)
    structured = StructuredOutputsParams(regex=REGEX)
    p = budgeted(tok, end, interruption, structured, k, temperature=0.0, max_tokens=30)
    p = p.replace(thinking_end_token_ids=end_ids)
    _, run = run_mode(tiny, [PROMPTS[0]], [p])
    steer = Answer(
        ThinkingBudget(k, interruption, end_ids),
        Constraint(tiny, ref.eos_token_ids[0], tok.vocab_size, pattern=REGEX),
    )
    want = oracle_run(ref, PROMPTS[0], p, kv_policy="last_exited", steer=steer)
    out = run.tokens["r0"]
    assert out == want.tokens and run.finish["r0"] == "stop"
    start = steer.start(out)
    assert re.fullmatch(REGEX, tok.decode(out[start:-1]))
    forced = steer.forced_at(out)
    assert len(forced) == (0 if budget == "closed" else len(interruption) + 1)


@pytest.mark.parametrize("mode", [m for m in ENGINE_MODES if m != "sync" and m != "pipelined"])
def test_every_engine_mode_gives_the_synchronous_outputs(tiny, tok, end, interruption, mode):
    params = workload(tok, end, interruption)
    kw = ENGINE_MODES[mode]
    exit_mode = {"exit_mode": kw["exit_mode"]} if "exit_mode" in kw else {}
    _, want = run_mode(tiny, PROMPTS, params, **exit_mode)
    core, run = run_mode(tiny, PROMPTS, params, **kw)
    assert run.tokens == want.tokens and run.finish == want.finish
    assert run.logprobs["r2"] == pytest.approx(want.logprobs["r2"], abs=1e-4)  # (batching)
    if "preemption_mode" in kw:
        assert core.stats().num_preemptions > 0
    core.shutdown()
    texts = {rid: answer(tok, ids, end) for rid, ids in run.tokens.items()}
    if run.finish["r0"] == "stop":
        value = json.loads(texts["r0"])
        assert set(value) == {"age", "color"} and value["color"] in ("red", "green")
    assert texts["r1"] in ("yes", "no", "maybe so") and run.tokens["r1"][0] == interruption[0]
    assert re.fullmatch(REGEX, texts["r2"]) and re.fullmatch("[a-z]{6}", texts["r3"])
    assert run.tokens["r4"][0] == end and re.fullmatch("[0-9]{2}", texts["r4"])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_resumed_after_its_forced_ids_stays_in_its_constraint(
    tiny, tok, end, interruption, mode, monkeypatch
):
    """Long answers under a pool that preempts them again and again: a request resumed with
    forced ids among its outputs gets a guide that skipped them, and ends as an unpressured
    run does."""
    resumed = []
    create = LiveRequest.create.__func__

    def spy(cls, setup, *args, **kw):
        if setup.output_token_ids and setup.num_sampled < len(setup.output_token_ids):
            resumed.append(setup.request_id)  # (forced ids among its outputs)
        return create(cls, setup, *args, **kw)

    monkeypatch.setattr(LiveRequest, "create", classmethod(spy))
    structured = StructuredOutputsParams(regex="[a-z]{16}\\.")
    params = [
        budgeted(tok, end, interruption, structured, i, seed=3 + i, max_tokens=40) for i in range(3)
    ]
    _, want = run_mode(tiny, PROMPTS[:3], params)
    resumed.clear()
    core, run = run_mode(tiny, PROMPTS[:3], params, **ENGINE_MODES[mode])
    assert core.stats().num_preemptions > 0 and resumed
    core.shutdown()
    assert run.tokens == want.tokens
    for rid, ids in run.tokens.items():
        assert run.finish[rid] == "stop" and re.fullmatch("[a-z]{16}\\.", answer(tok, ids, end))


def test_disaggregated_stages_give_the_single_stage_outputs(tiny, tok, end, interruption):
    """The prefill stage runs the prompt alone; the decode stage forces, and constrains."""
    params = workload(tok, end, interruption)
    prompts = [p * 3 for p in PROMPTS]  # (whole blocks to move)
    _, want = run_mode(tiny, prompts, params)
    run, _ = run_pd(tiny, prompts, params, num_blocks=512, kv_policy="last_exited", block_size=4)
    assert run.tokens == want.tokens
