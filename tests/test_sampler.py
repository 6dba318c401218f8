import math

import pytest
import torch

from rltserve.core.sampler import Sampler, SampleRow, SeededGenerator
from rltserve.sampling import SamplingParams

V = 50


def gen(seed):
    return torch.Generator().manual_seed(seed)


def seeded(seed):
    return SeededGenerator(seed, "cpu")


def rand_logits(rows, seed=0):
    return torch.randn(rows, V, generator=gen(seed)) * 3


def test_greedy_is_argmax():
    logits = rand_logits(4)
    out = Sampler().sample(logits, [SampleRow(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4 and out.top_logprobs == [None] * 4


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_takes_the_first_maximal_id(threads):
    # Ties (and a row of equal logits) go to the first maximal id, as torch's max reduction
    # gives it; on CPU with one torch thread the argmax is numpy's.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_greedy_ties()
    finally:
        torch.set_num_threads(before)


def _check_greedy_ties():
    logits = rand_logits(5, seed=3)
    logits[0, 7] = logits[0, 2] = logits[0].max() + 1
    logits[1] = 0.5
    logits[2, V - 1] = logits[2, 0] = logits[2].max() + 1
    for rows in (logits, logits[:, ::2], logits.t().contiguous().t()):  # strided views too
        out = Sampler().sample(rows, [SampleRow(SamplingParams(temperature=0.0)) for _ in range(5)])
        assert out.token_ids == rows.max(dim=-1).indices.tolist()
    assert out.token_ids[:3] == [2, 0, 0]
    # A row with a NaN: flagged, its (meaningless) token as torch's max gives it.
    logits[3, 4] = float("nan")
    out = Sampler().sample(logits, [SampleRow(SamplingParams(temperature=0.0)) for _ in range(5)])
    assert out.finite == [True, True, True, False, True]
    assert out.token_ids == logits.max(dim=-1).indices.tolist()


def test_input_not_modified():
    logits = rand_logits(2)
    before = logits.clone()
    p = SamplingParams(temperature=1.0, top_k=3, repetition_penalty=2.0)
    Sampler().sample(logits, [SampleRow(p, seeded(1), ([1, 2], [3])), SampleRow(p)])
    assert torch.equal(logits, before)


def test_seeded_rows_independent_of_batch():
    p = SamplingParams(temperature=1.3, top_k=20, top_p=0.9, min_p=0.01)
    target = torch.randn(V, generator=gen(5)) * 2
    alone = []
    g = seeded(42)
    for _ in range(8):
        alone += Sampler().sample(target[None], [SampleRow(p, g)]).token_ids

    batched = []
    g, other = seeded(42), seeded(7)
    for step in range(8):
        noise = rand_logits(3, seed=100 + step)
        logits = torch.stack([noise[0], target, noise[1], noise[2]])
        rows = [
            SampleRow(SamplingParams(temperature=0.7)),  # unseeded: shared draw
            SampleRow(p, g),
            SampleRow(SamplingParams(temperature=0.0)),  # greedy
            SampleRow(SamplingParams(temperature=1.0, top_p=0.5), other),
        ]
        batched.append(Sampler().sample(logits, rows).token_ids[1])
    assert alone == batched
    assert len(set(alone)) > 1  # actually sampling, not collapsing to argmax


def test_same_seed_same_tokens_different_seed_differs():
    p = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, V)  # uniform: any difference in noise shows up
    a = [Sampler().sample(logits, [SampleRow(p, g)]).token_ids[0] for g in [seeded(3)] * 10]
    b = [Sampler().sample(logits, [SampleRow(p, g)]).token_ids[0] for g in [seeded(3)] * 10]
    c = [Sampler().sample(logits, [SampleRow(p, g)]).token_ids[0] for g in [seeded(4)] * 10]
    assert a == b and a != c


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = rand_logits(6, seed=3)
    want = logits.argmax(-1).tolist()
    rows = [SampleRow(SamplingParams(temperature=2.0, top_k=1), seeded(i)) for i in range(3)]
    rows += [SampleRow(SamplingParams(temperature=2.0, top_p=1e-6), seeded(i)) for i in range(3)]
    for _ in range(5):
        assert Sampler().sample(logits, rows).token_ids == want


def test_top_k_restricts_support():
    logits = rand_logits(1, seed=4)
    allowed = set(logits[0].topk(3).indices.tolist())
    g = seeded(0)
    row = SampleRow(SamplingParams(temperature=2.0, top_k=3), g)
    seen = {Sampler().sample(logits, [row]).token_ids[0] for _ in range(60)}
    assert seen == allowed


def test_top_p_keeps_smallest_covering_set():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    row = SampleRow(SamplingParams(temperature=1.0, top_p=0.75), seeded(0))
    seen = {Sampler().sample(logits, [row]).token_ids[0] for _ in range(60)}
    assert seen == {0, 1}


def test_min_p_filters_relative_to_max():
    probs = torch.tensor([0.4, 0.35, 0.2, 0.05])
    logits = probs.log()[None]
    row = SampleRow(SamplingParams(temperature=1.0, min_p=0.3), seeded(0))  # threshold 0.12
    seen = {Sampler().sample(logits, [row]).token_ids[0] for _ in range(80)}
    assert seen == {0, 1, 2}


def test_repetition_penalty_changes_argmax():
    logits = torch.full((2, V), -5.0)
    logits[:, 7] = 2.0  # seen before: 2.0 / 4 = 0.5
    logits[:, 9] = 1.0  # unseen
    logits[:, 11] = -0.5  # seen, negative: -0.5 * 4 = -2.0
    p = SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=0)
    rows = [SampleRow(p, None, ([7], [11])), SampleRow(p)]  # row 1 has no token history
    out = Sampler("processed_logprobs").sample(logits, rows)
    assert out.token_ids == [9, 7]
    expected = logits[0].clone()
    expected[7], expected[11] = 0.5, -2.0
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(expected, -1)[9].item(), abs=1e-6)
    # Raw logprobs (the default, vLLM's) are the model's, before the penalty.
    raw = Sampler().sample(logits, rows)
    assert raw.token_ids == [9, 7]
    assert raw.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[9].item(), abs=1e-6)


def test_presence_and_frequency_penalties():
    logits = torch.zeros(1, 4)
    logits[0, 0] = 1.0
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, logprobs=4)
    out = Sampler("processed_logprobs").sample(logits, [SampleRow(p, None, ([1, 3], [0, 0, 2]))])
    # token 0: 1 - 0.5 - 2*0.25 = 0; token 2: -0.75; prompt-only tokens untouched
    expected = torch.log_softmax(torch.tensor([0.0, 0.0, -0.75, 0.0]), -1)
    got = dict(out.top_logprobs[0])
    for t in range(4):
        assert got[t] == pytest.approx(expected[t].item(), abs=1e-6)
    assert out.token_ids == [0]  # ties broken toward the lowest id


def test_logprobs_values_and_order():
    logits = rand_logits(3, seed=8)
    rows = [
        SampleRow(SamplingParams(temperature=0.0, logprobs=5)),
        SampleRow(SamplingParams(temperature=0.5, top_k=2, logprobs=2), seeded(1)),
        SampleRow(SamplingParams(temperature=0.0, logprobs=0)),
    ]
    out = Sampler().sample(logits, rows)
    ref = torch.log_softmax(logits.double(), -1)  # before temperature and filters
    for i, row in enumerate(rows):
        tok = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        top = out.top_logprobs[i]
        assert len(top) == row.params.logprobs
        assert [t for t, _ in top] == ref[i].topk(len(top)).indices.tolist()
        vals = [lp for _, lp in top]
        assert vals == sorted(vals, reverse=True)
        for t, lp in top:
            assert lp == pytest.approx(ref[i, t].item(), abs=1e-5)
    assert out.top_logprobs[2] == []


def test_distribution_matches_probs():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 2000
    logits = probs.log().expand(n, 3).contiguous()  # n draws in one batched call
    rows = [SampleRow(SamplingParams(temperature=1.0), seeded(i)) for i in range(n // 2)]
    rows += [SampleRow(SamplingParams(temperature=1.0)) for _ in range(n // 2)]  # shared draw
    torch.manual_seed(0)
    out = Sampler().sample(logits, rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=3).double() / n
    sigma = math.sqrt(0.25 / n)
    assert torch.allclose(counts, probs.double(), atol=5 * sigma)


def test_shape_mismatch():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, V), [SampleRow(SamplingParams(temperature=0.0))])


def test_sample_device_matches_sample():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    rows = lambda: [  # noqa: E731
        SampleRow(SamplingParams(temperature=0.0, logprobs=3)),
        SampleRow(SamplingParams(temperature=0.8, top_p=0.9, seed=1), seeded(1)),
        SampleRow(SamplingParams(temperature=0.0)),
        SampleRow(SamplingParams(temperature=1.2, top_k=5, logprobs=0), seeded(2)),
        SampleRow(SamplingParams(min_p=0.1, temperature=0.7, logprobs=1), seeded(3)),
    ]
    want = Sampler().sample(logits, rows())
    dev = Sampler().sample_device(logits, rows())
    assert dev.token_ids.dtype == torch.int64 and dev.token_ids.shape == (5,)
    got = dev.to_output({k: v.tolist() for k, v in dev.tensors().items()})
    assert got == want
    assert got.logprobs[2] is None and got.top_logprobs[3] == []


def _draws(g, n, width=V):
    return [g.noise(width) for _ in range(n)]


def test_seeded_generator_counts_its_draws():
    g = seeded(9)
    Sampler().sample(torch.zeros(2, V), [SampleRow(SamplingParams(temperature=1.0), g)] * 2)
    assert g.draws == 2
    Sampler().sample(
        torch.zeros(1, V), [SampleRow(SamplingParams(temperature=0.0), g)]
    )  # greedy: no draw
    assert g.draws == 2


def test_resume_continues_a_kept_generator():
    kept = seeded(5)
    _draws(kept, 3)
    resumed = SeededGenerator.resume(5, "cpu", 7, V, kept)
    assert resumed is kept and resumed.draws == 7  # four more drawn, not seven
    fresh = seeded(5)
    _draws(fresh, 7)
    assert all(torch.equal(a, b) for a, b in zip(_draws(resumed, 3), _draws(fresh, 3)))


def test_resume_replays_from_the_seed_when_the_kept_one_drew_too_far_or_is_foreign():
    # A step in flight at preemption sampled a token the scheduler then dropped: the kept
    # generator is a draw ahead of the recorded tokens.
    ahead = seeded(5)
    _draws(ahead, 4)
    foreign = seeded(6)
    fresh = seeded(5)
    _draws(fresh, 3)
    want = _draws(fresh, 2)
    for kept in (ahead, foreign, None):
        resumed = SeededGenerator.resume(5, "cpu", 3, V, kept)
        assert resumed is not kept and resumed.draws == 3
        assert all(torch.equal(a, b) for a, b in zip(_draws(resumed, 2), want))


@pytest.mark.parametrize("greedy_only", [True, False])
def test_finite_flags_rows_with_nan_or_infinity(greedy_only):
    """Both paths (every row plain greedy, and the general one) flag exactly the rows that
    hold a NaN or an infinity, as ``isfinite(logits).all(-1)`` would."""
    logits = rand_logits(6)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, V - 1] = float("-inf")
    logits[4] = float("nan")
    params = (
        SamplingParams(temperature=0.0)
        if greedy_only
        else SamplingParams(temperature=0.0, logprobs=1)
    )
    rows = [SampleRow(params) for _ in range(6)]
    assert rows[0].plain is greedy_only
    out = Sampler().sample(logits, rows)
    assert out.finite == [True, False, False, False, False, True]
    assert out.finite == torch.isfinite(logits).all(-1).tolist()
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[5] == int(
        logits[5].argmax()
    )


def test_a_row_is_plain_only_when_greedy_with_nothing_else_asked():
    assert SampleRow(SamplingParams(temperature=0.0)).plain
    assert not SampleRow(SamplingParams(temperature=0.7)).plain
    assert not SampleRow(SamplingParams(temperature=0.0, logprobs=0)).plain
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    assert not SampleRow(penalized, penalty_tokens=([1], [2])).plain
    assert SampleRow(penalized).plain  # no history kept: nothing to penalize


def test_banned_rows_never_sample_their_ids_and_keep_their_logprobs():
    # min_tokens: a banned row draws from its logits without the banned ids (greedy rows take
    # the argmax of the rest); logprobs and the finite flag read the logits as given; rows not
    # listed in ``banned`` ignore their ids.
    logits = rand_logits(4, seed=5)
    top = logits.argmax(-1)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, seed=1, logprobs=0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=2),
    ]
    rows = [SampleRow(p, generator=seeded(i)) for i, p in enumerate(params)]
    for i, row in enumerate(rows):
        row.banned = torch.tensor([int(top[i]), 0, 1])
    unbanned = [SampleRow(p, generator=seeded(i)) for i, p in enumerate(params)]
    plain = Sampler().sample(logits, unbanned)
    out = Sampler().sample(logits, rows, banned=[0, 1, 2])
    masked = logits.clone()
    for i in range(3):
        masked[i, [int(top[i]), 0, 1]] = float("-inf")
    assert out.token_ids[0] == int(masked[0].argmax())
    assert out.token_ids[2] == int(masked[2].argmax())
    for i in range(3):
        assert out.token_ids[i] not in (int(top[i]), 0, 1)
    assert out.token_ids[3] == plain.token_ids[3]  # not listed: as without a ban
    assert out.finite == [True] * 4
    logp = torch.log_softmax(logits, -1)
    assert out.logprobs[0] == pytest.approx(float(logp[0, out.token_ids[0]]), abs=1e-5)
    assert [t for t, _ in out.top_logprobs[0]] == logp[0].topk(2).indices.tolist()
    # A seeded banned row draws the same way every time.
    again = [SampleRow(p, generator=seeded(i)) for i, p in enumerate(params)]
    for i, row in enumerate(again):
        row.banned = torch.tensor([int(top[i]), 0, 1])
    assert Sampler().sample(logits, again, banned=[0, 1, 2]).token_ids == out.token_ids


def test_the_sampled_token_always_has_its_rank():
    """vLLM's rank: the count of logprobs >= the sampled token's (1 for the most likely), also
    for a token outside the top k (TRL sorts a position's entries by rank)."""
    logits = rand_logits(4, seed=21)
    rows = [
        SampleRow(SamplingParams(temperature=0.0, logprobs=0)),
        SampleRow(SamplingParams(temperature=1.0, logprobs=2), seeded(3)),
        SampleRow(SamplingParams(temperature=1.5, logprobs=1), seeded(4)),
        SampleRow(SamplingParams(temperature=0.0)),
    ]
    out = Sampler().sample(logits, rows)
    for i in range(3):
        logp = torch.log_softmax(logits[i], -1)
        assert out.ranks[i] == int((logp >= logp[out.token_ids[i]]).sum())
    assert out.ranks[0] == 1 and out.ranks[3] is None
    plain = Sampler().sample(logits, [SampleRow(SamplingParams(temperature=0.0))] * 4)
    assert plain.ranks is None  # no row asked: no column


def test_processed_logprobs_are_what_the_token_was_drawn_from():
    logits = rand_logits(2, seed=5)
    p = SamplingParams(temperature=0.5, top_k=3, logprobs=4)
    rows = [SampleRow(p, seeded(1)), SampleRow(p.replace(temperature=0.0), None)]
    out = Sampler("processed_logprobs").sample(logits, rows)
    scaled = logits[0] / 0.5
    kept = scaled.topk(3).indices
    masked = torch.full_like(scaled, float("-inf"))
    masked[kept] = scaled[kept]
    expected = torch.log_softmax(masked, -1)
    assert out.logprobs[0] == pytest.approx(expected[out.token_ids[0]].item(), abs=1e-5)
    ranked = out.top_logprobs[0]  # descending
    assert [t for t, _ in ranked[:3]] == kept.tolist()
    assert ranked[3][1] == float("-inf")  # top_k filtered the 4th out
    # A greedy row: no temperature (vLLM's), the model's distribution here.
    greedy = torch.log_softmax(logits[1], -1)
    assert out.logprobs[1] == pytest.approx(greedy[out.token_ids[1]].item(), abs=1e-6)
    # Raw logprobs ignore temperature and top_k.
    raw = Sampler().sample(logits, rows)
    assert raw.token_ids == out.token_ids
    assert raw.logprobs[0] == pytest.approx(
        torch.log_softmax(logits[0], -1)[out.token_ids[0]].item(), abs=1e-6
    )


def test_rank_counts_tokens_tied_with_the_sampled_one():
    """vLLM's rank counts every logprob >= the token's own, so a tie with a likelier-or-equal
    token raises it: of two tied maxima the greedy (first) one has rank 2, not 1."""
    logits = torch.zeros(2, V)
    logits[0, [4, 9]] = 3.0  # tied maxima: greedy takes 4
    logits[1, [2, 6, 8]] = 1.0  # a row of three tied maxima
    p = SamplingParams(temperature=0.0, logprobs=0)
    out = Sampler().sample(logits, [SampleRow(p), SampleRow(p)])
    assert out.token_ids == [4, 2]
    assert out.ranks == [2, 3]


def test_top_k_ties_keep_the_lowest_ids():
    # Among equal logits the lower id ranks first (a stable sort, as argmax): top_k=2 of three
    # tied maxima keeps ids 3 and 9, never 20.
    logits = torch.full((1, V), -30.0)
    logits[0, [3, 9, 20]] = 10.0
    row = SampleRow(SamplingParams(temperature=1.0, top_k=2), seeded(0))
    seen = {Sampler().sample(logits, [row]).token_ids[0] for _ in range(40)}
    assert seen == {3, 9}


def test_top_p_drops_a_token_whose_mass_above_equals_top_p():
    # probs exactly (0.5, 0.25, 0.25): the first token alone covers top_p=0.5, so the others
    # (mass ranked above them: 0.5 >= top_p) go, as in vLLM's top-p mask.
    logits = torch.tensor([[2.0, 1.0, 1.0]]).log()
    row = SampleRow(SamplingParams(temperature=1.0, top_p=0.5), seeded(0))
    seen = {Sampler().sample(logits, [row]).token_ids[0] for _ in range(40)}
    assert seen == {0}


def test_min_p_one_keeps_the_most_likely_tokens():
    # min_p removes tokens strictly below min_p * max (vLLM's): with min_p=1 the maxima stay.
    logits = rand_logits(3, seed=12)
    rows = [SampleRow(SamplingParams(temperature=1.0, min_p=1.0), seeded(i)) for i in range(3)]
    out = Sampler().sample(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_draws_follow_a_skewed_distribution_over_many_tokens():
    # One likely token among many unlikely ones, where a wrong race (e.g. argmax of p * q)
    # would pick it about 75% of the time instead of 50%.
    probs = torch.tensor([0.5] + [0.05] * 10)
    n = 1000
    logits = probs.log().expand(n, 11).contiguous()
    rows = [SampleRow(SamplingParams(temperature=1.0), seeded(i)) for i in range(n)]
    out = torch.tensor(Sampler().sample(logits, rows).token_ids)
    assert abs((out == 0).double().mean().item() - 0.5) < 5 * math.sqrt(0.25 / n)


def test_logprobs_go_to_their_own_rows_among_rows_without():
    logits = rand_logits(4, seed=23)
    rows = [
        SampleRow(SamplingParams(temperature=0.0)),
        SampleRow(SamplingParams(temperature=0.0, logprobs=1)),
        SampleRow(SamplingParams(temperature=1.0), seeded(2)),
        SampleRow(SamplingParams(temperature=1.0, logprobs=0), seeded(3)),
    ]
    out = Sampler().sample(logits, rows)
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert out.ranks[0] is None and out.ranks[2] is None
    for i in (1, 3):
        logp = torch.log_softmax(logits[i], -1)
        tok = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(logp[tok].item(), abs=1e-5)
        assert out.ranks[i] == int((logp >= logp[tok]).sum())


def test_top_k_one_below_the_vocabulary_drops_the_least_likely_token():
    logits = torch.zeros(400, 4)
    logits[:, 3] = -0.01  # the least likely of four near-equal tokens
    rows = [SampleRow(SamplingParams(temperature=1.0, top_k=3), seeded(i)) for i in range(400)]
    assert set(Sampler().sample(logits, rows).token_ids) == {0, 1, 2}


def test_half_precision_logits_give_float32_logprobs():
    logits = rand_logits(2, seed=9).bfloat16()
    p = SamplingParams(temperature=0.0, logprobs=3)
    out = Sampler().sample(logits, [SampleRow(p), SampleRow(p)])
    ref = torch.log_softmax(logits.float(), -1)
    for i in range(2):
        tok = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-6)
        for t, lp in out.top_logprobs[i]:
            assert lp == pytest.approx(ref[i, t].item(), abs=1e-6)


def test_logit_bias_is_added_before_the_repetition_penalty():
    """vLLM V1's order: a biased logit is penalized as a whole, (l + b) / r, not l / r + b."""
    logits = torch.tensor([[1.9, 1.0, 0.0, -5.0]])
    bias = torch.tensor([0.0, 1.5, 0.0, 0.0])  # token 1: (1 + 1.5) / 2 = 1.25 < 1.9
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=4)
    row = SampleRow(p, None, ([1], []), bias=bias)  # token 1 is in the prompt
    out = Sampler("processed_logprobs").sample(logits, [row])
    assert out.token_ids == [0]  # (l / r + b = 2.0 would have picked 1)
    expected = torch.log_softmax(torch.tensor([1.9, 1.25, 0.0, -5.0]), -1)
    assert dict(out.top_logprobs[0]) == {t: expected[t].item() for t in range(4)}
    assert out.finite == [True]


def test_min_p_filters_before_top_p():
    """vLLM's order: temperature, min_p, then top-k/top-p, so top_p's mass is counted after
    min_p's renormalisation: [0.5, 0.3, 0.15, 0.05] with min_p=0.2 (drops 0.05) leaves
    [0.526, 0.316, 0.158], and top_p=0.82 then drops the third (0.842 ranked above it)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    p = SamplingParams(temperature=1.0, min_p=0.2, top_p=0.82, logprobs=4)
    out = Sampler("processed_logprobs").sample(logits, [SampleRow(p, seeded(0))])
    got = dict(out.top_logprobs[0])
    assert {t for t, lp in got.items() if lp > -math.inf} == {0, 1}
    assert got[0] == pytest.approx(math.log(0.625), abs=1e-6)
    assert got[1] == pytest.approx(math.log(0.375), abs=1e-6)


def test_a_tiny_temperature_samples_without_overflow():
    """temperature=1e-38 (raised to vLLM's 1e-2 floor) draws from finite probabilities: the
    argmax here, where before the logits overflowed to inf and NaN picked token 0."""
    logits = rand_logits(3, seed=8)
    rows = [SampleRow(SamplingParams(temperature=1e-38, logprobs=0), seeded(i)) for i in range(3)]
    out = Sampler("processed_logprobs").sample(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert all(math.isfinite(lp) for lp in out.logprobs) and out.finite == [True] * 3
