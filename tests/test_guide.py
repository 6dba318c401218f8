"""Structured outputs in the engine (``core/guide.py``): the guide masks what a request samples,
greedy or not, in every engine mode. A greedy guided request is the argmax over the masked
logits (the oracle, step by step); preempted (recompute, swap), chunked, wavefront, async and
pipelining engines give what a plain synchronous run gives; an unbound or pipelined request is
refused. With random tiny weights the model emits junk: only the guide makes outputs valid."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from engine_util import (
    ENGINE_MODES,
    make_core,
    run_core,
    run_mode,
    run_pd,
)
from reference import Reference

from rltserve.core.guide import Guide
from rltserve.core.live import LiveRequest
from rltserve.core.sampler import Sampler, SampleRow
from rltserve.guide_index import bind, compiled_index
from rltserve.models.tokenizer import load_tokenizer
from rltserve.sampling import SamplingParams
from rltserve.structured import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer"}, "color": {"enum": ["red", "green"]}},
    "required": ["age", "color"],
}
PROMPTS = [[11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [300], [7, 8, 9, 10, 11], [9, 2]]


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(tiny)


def guided(tok, structured: StructuredOutputsParams, **kw) -> SamplingParams:
    return bind(SamplingParams(structured_outputs=structured, **kw), tok)


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"age", "color"}, text
    assert type(value["age"]) is int and value["color"] in ("red", "green"), text


def workload(tok) -> list[SamplingParams]:
    """Greedy and seeded guided requests of each kind, and an unguided one among them."""
    return [
        guided(tok, StructuredOutputsParams(json=SCHEMA), temperature=0.0, max_tokens=40),
        guided(tok, StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}"), seed=5, max_tokens=20),
        guided(tok, StructuredOutputsParams(choice=["yes", "no", "maybe so"]), seed=7),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        # (Adaptive exit: its tokens exit at different depths, as carried rows.)
        guided(tok, StructuredOutputsParams(regex="[a-z]{6}"), temperature=0, exit_threshold=0.5),
    ]


def test_greedy_guided_output_is_the_argmax_over_the_masked_logits(tiny, tok):
    """At a fixed full depth a generated token is computed as a prompt token is, so each step
    of the oracle (the prompt and the tokens so far, one token among those the guide allows)
    is the engine's next token."""
    ref = Reference.load(tiny)
    p = guided(tok, StructuredOutputsParams(json=SCHEMA), temperature=0.0, max_tokens=40)
    core, run = run_mode(tiny, [PROMPTS[0]], [p], kv_policy="last_exited")
    guide, want = Guide(compiled_index(p.structured_outputs)), []
    while len(want) < p.max_tokens and (not want or want[-1] not in tok.eos_token_ids):
        out = ref.generate(
            PROMPTS[0] + want, 1, kv_policy="last_exited", allowed_token_ids=tuple(guide.allowed())
        )
        want.append(out.tokens[0])
        guide.advance(want[-1])
    core.shutdown()
    assert run.tokens["r0"] == want
    assert run.finish["r0"] == "stop" and want[-1] == compiled_index(p.structured_outputs).eos
    check_schema(tok.decode(want))


@pytest.mark.parametrize("mode", [m for m in ENGINE_MODES if m != "sync"])
def test_every_engine_mode_gives_the_synchronous_outputs(tiny, tok, mode):
    params = workload(tok)
    prompts = PROMPTS[: len(params)]
    kw = ENGINE_MODES[mode]
    exit_mode = {"exit_mode": kw["exit_mode"]} if "exit_mode" in kw else {}
    _, want = run_mode(tiny, prompts, params, **exit_mode)
    core, run = run_mode(tiny, prompts, params, **kw)
    assert run.tokens == want.tokens and run.finish == want.finish
    if "preemption_mode" in kw:
        assert core.stats().num_preemptions > 0
    texts = {rid: tok.decode(ids) for rid, ids in run.tokens.items()}
    check_schema(texts["r0"])
    if run.finish["r1"] == "stop":
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", texts["r1"]), texts["r1"]
    assert texts["r2"] in ("yes", "no", "maybe so") and run.finish["r2"] == "stop"
    assert re.fullmatch("[a-z]{6}", texts["r4"]) and run.finish["r4"] == "stop"
    core.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_guided_request_resumes_in_its_constraint(tiny, tok, mode, monkeypatch):
    """Only guided requests, long enough to be preempted mid-output: each resumes with its
    guide advanced over the tokens it had sampled, and ends as an unpressured run does."""
    resumed = []
    create = LiveRequest.create.__func__

    def spy(cls, setup, *args, **kw):
        if setup.num_sampled:
            resumed.append(setup.request_id)
        return create(cls, setup, *args, **kw)

    monkeypatch.setattr(LiveRequest, "create", classmethod(spy))
    params = [
        guided(tok, StructuredOutputsParams(regex="[a-z]{20}\\."), seed=3 + i, max_tokens=30)
        for i in range(3)
    ]
    _, want = run_mode(tiny, PROMPTS[:3], params)
    resumed.clear()
    core, run = run_mode(tiny, PROMPTS[:3], params, **ENGINE_MODES[mode])
    assert core.stats().num_preemptions > 0 and resumed
    assert run.tokens == want.tokens
    for rid, ids in run.tokens.items():
        assert run.finish[rid] == "stop" and re.fullmatch("[a-z]{20}\\.", tok.decode(ids))
    core.shutdown()


def test_deferred_delivery_gives_the_synchronous_outputs(tiny, tok):
    """Async scheduling as it runs on a GPU: each step planned before the previous one's
    result is applied, and delivered inside the next launch; the mask still follows the
    request's last token."""
    params = workload(tok)
    _, want = run_mode(tiny, PROMPTS[: len(params)], params, exit_mode="delayed")
    core = make_core(tiny, kv_policy="last_exited", async_scheduling=True, exit_mode="delayed")
    run = run_core(core, PROMPTS[: len(params)], params, lag=1, deferred=True)
    assert run.tokens == want.tokens and run.finish == want.finish
    core.shutdown()


def test_guided_sampling_is_seeded_and_independent_of_the_batch(tiny, tok):
    """A seeded guided request samples the same tokens alone or among others."""
    params = workload(tok)
    _, together = run_mode(tiny, PROMPTS[: len(params)], params)
    _, alone = run_mode(tiny, [PROMPTS[1]], [params[1]])
    assert alone.tokens["r0"] == together.tokens["r1"]


def test_unbound_or_pipelined_guided_requests_are_refused(tiny, tok):
    core = make_core(tiny, speculative_tokens=2, draft_loops=2, kv_policy="last_exited")
    structured = StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(ValueError, match="structured_outputs: not compiled for the model's"):
        core.add_request(None, [5, 6], SamplingParams(structured_outputs=structured))
    with pytest.raises(ValueError, match="speculative=True: .*structured outputs"):
        core.add_request(None, [5, 6], guided(tok, structured, temperature=0.0, speculative=True))
    core.shutdown()


def test_disaggregated_stages_give_the_single_stage_outputs(tiny, tok):
    """Prefill/decode disaggregation: the prefill stage runs the prompt without the constraint
    and the decode stage samples every output token under it."""
    params = workload(tok)
    prompts = [p * 3 for p in PROMPTS[: len(params)]]  # (whole blocks to move)
    _, want = run_mode(tiny, prompts, params)
    run, took = run_pd(tiny, prompts, params, num_blocks=512, kv_policy="last_exited", block_size=4)
    assert run.tokens == want.tokens
    assert took > 0  # (the decode stage used moved prompt blocks)


def test_a_matched_constraint_pads_min_tokens_with_its_end_id(tiny, tok):
    """``min_tokens`` bans the end id, which is all a constraint matched in full allows: the
    constraint wins, so the output is the match and then end ids (which stop nothing before
    ``min_tokens``), never a token outside it."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = [
        guided(tok, choice, temperature=t, seed=3, min_tokens=12, max_tokens=20) for t in (0, 1)
    ]
    _, run = run_mode(tiny, PROMPTS[:2], params)
    for rid in ("r0", "r1"):
        ids = run.tokens[rid]
        matched = next(n for n in range(len(ids)) if tok.decode(ids[:n]) in ("yes", "no"))
        assert run.finish[rid] == "stop" and len(ids) == 12
        assert set(ids[matched:]) == {tok.eos_token_ids[0]}


def test_min_tokens_bans_do_not_empty_a_guided_row():
    """The sampler's side of it, with an end id that is not 0 (an all -inf row's argmax): a
    guided row whose bans would leave nothing samples what its guide allows."""
    ended = SimpleNamespace(
        compiled=SimpleNamespace(pattern="x", eos=5),
        state=None,
        allowed=lambda: [5],
        mask=lambda width: torch.arange(width) == 5,
        active=True,
    )
    banned = torch.tensor([5, 6])  # (min_tokens' ids: the end ids)
    for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)):
        rows = [SampleRow(p, bias=torch.zeros(16), guide=ended), SampleRow(p, bias=torch.zeros(16))]
        for row in rows:
            row.banned = banned
        out = Sampler().sample(torch.randn(2, 16), rows, banned=[0, 1])
        assert out.token_ids[0] == 5 and out.token_ids[1] not in (5, 6)


def test_a_guide_after_reasoning_masks_nothing_until_the_span_closes(tok):
    """``after_reasoning`` (a chat prompt that leaves ``<think>`` open): the sampler leaves
    the row free until ``</think>`` is sampled, then masks it; a resumed request's replay
    (over the same tokens) lands in the same place."""
    from rltserve.guide_index import after_reasoning

    think_end = tok.get_vocab()["</think>"]
    p = guided(tok, StructuredOutputsParams(choice=["yes", "no"]), temperature=0.0)
    structured = after_reasoning(p.structured_outputs, think_end)
    guide = Guide.of(structured)
    logits = torch.zeros(1, tok.vocab_size)
    logits[0, 7] = 5.0  # (an id the choice never allows)
    row = SampleRow(p, bias=torch.zeros(tok.vocab_size), guide=guide)
    assert Sampler().sample(logits, [row]).token_ids == [7]
    guide.advance(7)
    assert not guide.active and Sampler().sample(logits, [row]).token_ids == [7]
    guide.advance(think_end)
    assert guide.active and Sampler().sample(logits, [row]).token_ids != [7]
    replayed = Guide.of(structured).replay([7, think_end])
    assert replayed.active and replayed.state == guide.state


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_describe_the_masked_distribution(tok, mode):
    """vLLM masks the model's logits before its sampler: a guided row's logprobs, raw ones
    included, are over what the guide allows (a choice's top logprobs are its options'), and
    its logits' finiteness is still the model's."""
    p = guided(tok, StructuredOutputsParams(choice=["yes", "no"]), temperature=0.0, logprobs=3)
    guide = Guide(compiled_index(p.structured_outputs))
    allowed = guide.allowed()
    logits = torch.randn(2, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    rows = [SampleRow(p, bias=torch.zeros(tok.vocab_size), guide=guide), SampleRow(p)]
    out = Sampler(mode).sample(logits, rows)
    want = torch.log_softmax(logits[0, allowed], dim=-1)
    assert out.token_ids[0] == allowed[int(want.argmax())]
    assert out.logprobs[0] == pytest.approx(float(want.max()), abs=1e-5)
    tops = [t for t, _ in out.top_logprobs[0]]
    assert set(tops[: len(allowed)]) == set(allowed) and out.finite == [True, True]
    assert out.token_ids[1] == int(logits[1].argmax())  # (an unguided row: unmasked)


def test_min_tokens_bans_the_end_where_the_constraint_may_go_on(tok):
    """A constraint matched in full that may still go on (``[0-9]+`` after "7"): min_tokens'
    ban of the end id holds, and the row samples what else the guide allows (the end stays
    only where it is all that is left)."""
    p = guided(tok, StructuredOutputsParams(regex="[0-9]+"), temperature=0.0, min_tokens=4)
    guide = Guide(compiled_index(p.structured_outputs))
    guide.advance(tok.encode("7", add_special_tokens=False)[0])
    eos = guide.compiled.eos
    assert eos in guide.allowed() and len(guide.allowed()) > 1
    logits = torch.zeros(1, tok.vocab_size)
    logits[0, eos] = 10.0
    row = SampleRow(p, bias=torch.zeros(tok.vocab_size), guide=guide)
    row.banned = torch.tensor([eos])
    (token,) = Sampler().sample(logits, [row], banned=[0]).token_ids
    assert token != eos and tok.decode([token]).isdigit()


def test_a_token_the_guide_does_not_allow_ends_it(tok):
    """A token outside the constraint (one forced into the output) leaves nothing to match:
    the guide allows only the end id from there, as after a full match."""
    compiled = compiled_index(
        guided(tok, StructuredOutputsParams(choice=["yes", "no"])).structured_outputs
    )
    guide = Guide(compiled)
    outside = tok.encode("Z", add_special_tokens=False)[0]
    assert outside not in guide.allowed()
    guide.advance(outside)
    assert guide.state is None and guide.allowed() == [compiled.eos]
    assert guide.mask(tok.vocab_size).nonzero().flatten().tolist() == [compiled.eos]
