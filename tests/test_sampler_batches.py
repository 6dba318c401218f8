"""Batched sampling against per-row references: the penalties of many rows with long histories,
and seeded rows' noise drawn in place from each request's own generator."""

import random
from collections import Counter

import pytest
import torch

from rltserve.core.sampler import Sampler, SampleRow, SeededGenerator, _apply_penalties
from rltserve.sampling import SamplingParams

V = 64


def _penalized_reference(logits: torch.Tensor, prompt: list[int], output: list[int], p):
    """One row's penalties, token by token: repetition over prompt + output, presence and
    frequency over the output."""
    row = logits.clone()
    counts = Counter(output)
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t, c in counts.items():
        row[t] = row[t] - p.frequency_penalty * c - p.presence_penalty
    return row


def test_penalties_of_a_batch_match_each_row_alone_as_outputs_grow():
    rnd = random.Random(3)
    kinds = [
        SamplingParams(temperature=1.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0.7, repetition_penalty=0.8, frequency_penalty=-0.5),
    ]
    histories = [
        ([rnd.randrange(V) for _ in range(rnd.randrange(1, 3 * V))], []) for _ in range(12)
    ]
    rows = [SampleRow(kinds[j % 3], None, histories[j]) for j in range(12)]
    for step in range(5):  # the same rows each step, their outputs growing in place
        logits = torch.randn(12, V, generator=torch.Generator().manual_seed(step)) * 3
        got = _apply_penalties(logits, rows)
        for j, (prompt, output) in enumerate(histories):
            want = _penalized_reference(logits[j], prompt, output, kinds[j % 3])
            torch.testing.assert_close(got[j], want, rtol=0, atol=1e-6)
        for _, output in histories:
            output += [rnd.randrange(V) for _ in range(rnd.randrange(0, 4))]
    assert sum(map(len, (o for _, o in histories))) > 12  # the outputs did grow


def test_a_row_without_output_is_penalized_over_its_prompt():
    logits = torch.full((2, V), 2.0)
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    got = _apply_penalties(logits, [SampleRow(p, None, ([3, 3, 5], [])), SampleRow(p)])
    assert got[0, 3] == got[0, 5] == 1.0 and got[0, 4] == 2.0
    assert torch.equal(got[1], logits[1])  # no history: nothing penalized


@pytest.mark.parametrize("width", [V, 4099])
def test_seeded_rows_draw_their_own_generators_stream(width):
    """Each seeded row's token is the argmax of probs / Exp(1) noise drawn from its request's
    generator alone (row after row of a batch, each draw one full row), whatever the batch."""
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(1)) * 2
    params = [SamplingParams(temperature=t) for t in (1.0, 0.6, 1.0, 1.4, 0.9, 1.0)]
    for step in range(3):
        rows = [SampleRow(p, SeededGenerator(100 + j, "cpu")) for j, p in enumerate(params)]
        for row in rows:  # each generator as a resumed request's: ``step`` draws made
            for _ in range(step):
                row.generator.noise(width)
        out = Sampler().sample(logits, rows)
        for j, p in enumerate(params):
            own = SeededGenerator(100 + j, "cpu")
            noise = [own.noise(width) for _ in range(step + 1)][-1]
            probs = (logits[j] / p.temperature).softmax(-1)
            assert out.token_ids[j] == int((probs / noise).argmax())
            assert rows[j].generator.draws == step + 1
