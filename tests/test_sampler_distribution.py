"""The sampler draws from exactly the distribution its processed logprobs report: GRPO-style
importance ratios and KL terms rest on it. Each case draws many tokens from one logits row and
compares their frequencies with the target computed here in float64, independently of the
sampler, from vLLM's documented semantics: allowed ids, logit_bias and min_tokens bans, then
penalties (repetition over prompt and output, presence and frequency over the output), then
temperature, min_p, top_k, top_p. Most draws share one batched draw of noise (rows without a
generator), which makes enough of them cheap; the seeded ones go through the per-request
generators the engine uses.

A chi-squared statistic with the draws' count makes an error of 2% total variation stand out
far above the threshold (``test_the_check_sees_a_two_percent_error`` holds it to that), while
the exact target sits far below it; every seed is fixed, so the outcome is too."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rltserve.core.sampler import Sampler, SampleRow, SeededGenerator
from rltserve.sampling import SamplingParams

V = 16
SEEDED = 2000  # draws from per-request generators
SHARED = 30000  # draws from one batched draw of the global RNG (forked: seeded here)
PROMPT = [1, 3, 3, 9]
OUTPUT = [3, 5, 5, 5, 12]
# The chi-squared statistic's distance from its mean in standard deviations: exact draws stay
# within about 3 (fixed seeds: the same value on every run), a 2% error lands past 10.
LIMIT = 5.0


def model_logits() -> np.ndarray:
    """A row with positive and negative logits (the repetition penalty divides one and
    multiplies the other) and a spread wide enough for the filters to cut into it."""
    return (torch.randn(V, generator=torch.Generator().manual_seed(2024)) * 1.5).double().numpy()


def target(
    logits: np.ndarray, p: SamplingParams, bias: np.ndarray | None, banned: tuple[int, ...]
) -> np.ndarray:
    x = logits.copy()
    if bias is not None:
        x = x + bias
    x[list(banned)] = -np.inf
    for t in set(PROMPT) | set(OUTPUT):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(OUTPUT, minlength=V)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    x = x / p.temperature
    probs = _softmax(x)
    x[probs < p.min_p * probs.max()] = -np.inf
    order = np.argsort(-x, kind="stable")
    if 0 < p.top_k < V:
        x[order[p.top_k :]] = -np.inf
    if p.top_p < 1.0:
        probs = _softmax(x)[order]
        x[order[np.cumsum(probs) - probs >= p.top_p]] = -np.inf  # the mass above reaches top_p
    return _softmax(x)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def deviation(counts: np.ndarray, probs: np.ndarray) -> float:
    """(chi2 - df) / sqrt(2 df) over the tokens expected at least 5 times, the rest pooled; inf
    when a token the target excludes was drawn."""
    n = counts.sum()
    if counts[probs == 0].any():
        return math.inf
    expected = probs * n
    big = expected >= 5
    exp = np.append(expected[big], expected[~big].sum())
    obs = np.append(counts[big], counts[~big].sum())
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = keep.sum() - 1
    return (chi2 - df) / math.sqrt(2 * df) if df else 0.0


def draw(p: SamplingParams, bias: torch.Tensor | None, banned: tuple[int, ...], seed: int):
    n = SEEDED + SHARED
    logits = torch.from_numpy(model_logits()).float().expand(n, V).contiguous()
    history = (PROMPT, list(OUTPUT))
    ban = torch.tensor(banned, dtype=torch.int64) if banned else None
    gens = [SeededGenerator(seed + i, "cpu") for i in range(SEEDED)] + [None] * SHARED
    rows = [SampleRow(p, g, history, banned=ban, bias=bias) for g in gens]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = Sampler("processed_logprobs").sample(logits, rows, range(n) if banned else ())
    return np.array(out.token_ids), np.array(out.logprobs)


ALLOWED = [0, 2, 3, 5, 7, 8, 11, 12, 14]
CASES = {
    "t0.3": (dict(temperature=0.3), None, ()),
    "t1": (dict(temperature=1.0), None, ()),
    "t1.7": (dict(temperature=1.7), None, ()),
    "top_k": (dict(temperature=1.0, top_k=4), None, ()),
    "top_p": (dict(temperature=1.0, top_p=0.7), None, ()),
    "min_p": (dict(temperature=1.0, min_p=0.1), None, ()),
    "all_filters": (dict(temperature=1.7, min_p=0.02, top_k=9, top_p=0.85), None, ()),
    "repetition": (dict(temperature=1.0, repetition_penalty=1.8), None, ()),
    "repetition_below_1": (dict(temperature=1.3, repetition_penalty=0.6), None, ()),
    "presence_frequency": (
        dict(temperature=1.0, presence_penalty=1.2, frequency_penalty=-0.7),
        None,
        (),
    ),
    "bias_allowed_bans_penalties_filters": (
        dict(temperature=0.8, repetition_penalty=1.4, frequency_penalty=0.5, top_p=0.95),
        {3: 2.0, 7: -1.5, 12: 1.0},
        (0, 5),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_processed_distribution(case):
    kwargs, bias_ids, banned = CASES[case]
    p = SamplingParams(**kwargs, logprobs=0)
    bias = None
    if bias_ids is not None:
        bias = torch.full((V,), float("-inf"))  # allowed ids: -inf elsewhere
        bias[ALLOWED] = 0.0
        for t, b in bias_ids.items():
            bias[t] += b
    tokens, logprobs = draw(p, bias, banned, seed=1000 * len(case))
    probs = target(model_logits(), p, None if bias is None else bias.double().numpy(), banned)
    assert deviation(np.bincount(tokens, minlength=V), probs) < LIMIT
    # The logprob each draw reports is the log of the probability it was drawn with.
    np.testing.assert_allclose(logprobs, np.log(probs[tokens]), atol=2e-5)


def test_the_check_sees_a_two_percent_error():
    """Moving 2% of the mass between two likely tokens (total variation 0.02) fails the check
    by a wide margin: the exact tests above have the power they claim."""
    p = SamplingParams(temperature=1.0, logprobs=0)
    tokens, _ = draw(p, None, (), seed=7)
    probs = target(model_logits(), p, None, ())
    first, second = np.argsort(-probs)[:2]
    wrong = probs.copy()
    wrong[first] -= 0.02
    wrong[second] += 0.02
    counts = np.bincount(tokens, minlength=V)
    assert deviation(counts, probs) < LIMIT
    assert deviation(counts, wrong) > 2 * LIMIT
