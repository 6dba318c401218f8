"""Seeds to generators (``rltserve/seeds.py``): every seed in [0, 2**32) draws the stream
``manual_seed`` gives it, and seeds that differ modulo 2**64 draw different streams on the CPU,
whose mt19937 reads only a seed's low 32 bits: the sampler's and Huginn's initial states (the
oracle's too)."""

from __future__ import annotations

import numpy as np
import torch
from engine_util import make_core, oracle_run, run_core

from rltserve.models.base import noise_generator, noise_seed
from rltserve.sampling import SamplingParams
from rltserve.seeds import _STATE_WORDS, seeded_generator

SEEDS = (5, 5 + 2**32, 5 + 2**63, 2**64 - 1, 7 * 2**32 + 5, 2**32, 5 * 2**32 + 7)


def draws(gen: torch.Generator) -> list[float]:
    return torch.rand(4, generator=gen).tolist()


def test_torchs_cpu_state_is_laid_out_as_read():
    """mt19937's word 0 is the seed's low 32 bits, word 1 ``1812433253 * (x ^ x >> 30) + 1``."""
    for seed in (5, 2**32 - 1, 5 + 2**32):
        state = torch.Generator().manual_seed(seed).get_state()
        assert state.numel() == 5056
        words = state.numpy()[_STATE_WORDS].view(np.uint64)
        x = seed % 2**32
        assert (int(words[0]), int(words[1])) == (x, (1812433253 * (x ^ x >> 30) + 1) % 2**32)


def test_a_seed_below_2_32_draws_what_manual_seed_gives():
    for seed in (0, 5, 2**31, 2**32 - 1):
        want = draws(torch.Generator().manual_seed(seed))
        assert draws(seeded_generator(seed)) == want, seed
        assert draws(noise_generator(seed, 3)) == draws(
            torch.Generator().manual_seed(noise_seed(seed, 3))
        )


def test_seeds_apart_by_multiples_of_2_32_draw_different_streams():
    plain = [draws(torch.Generator().manual_seed(s)) for s in (5, 5 + 2**32)]
    assert plain[0] == plain[1]  # (what manual_seed alone gives on the CPU)
    streams = {tuple(draws(seeded_generator(s))) for s in (*SEEDS, 7)}
    assert len(streams) == len(SEEDS) + 1
    noises = {tuple(draws(noise_generator(s, 0))) for s in (*SEEDS, 7)}
    assert len(noises) == len(SEEDS) + 1
    # (torch reads seeds modulo 2**64: -1 is 2**64 - 1)
    assert draws(seeded_generator(-1)) == draws(seeded_generator(2**64 - 1))
    assert draws(noise_generator(-1, 2)) == draws(noise_generator(2**64 - 1, 2))


def test_a_generator_continues_as_any_does():
    """A mixed state is a valid mt19937 state: draws past the first 624 words (a regeneration)
    go on, and a generator copied by state draws the same."""
    gen = seeded_generator(5 + 2**32)
    torch.rand(1000, generator=gen)
    copy = torch.Generator()
    copy.set_state(gen.get_state())
    assert draws(gen) == draws(copy)


def test_sampling_with_seeds_apart_by_2_32_differs(ckpts):
    core = make_core(ckpts["ouro"])
    p = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    run = run_core(core, [[5, 6, 7]] * 2, [p.replace(seed=5), p.replace(seed=5 + 2**32)])
    core.shutdown()
    assert run.tokens["r0"] != run.tokens["r1"]


def test_huginn_states_of_seeds_apart_by_2_32_differ_and_equal_the_oracle(ckpts, huginn_ref):
    core = make_core(ckpts["huginn"])
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, init_state="random")
    params = [p.replace(seed=s) for s in (7, 7 + 2**32, 2**64 - 1)]
    run = run_core(core, [[5, 6]] * 3, params)
    core.shutdown()
    logits = []
    for i, q in enumerate(params):
        want = oracle_run(huginn_ref, [5, 6], q)
        assert (run.tokens[f"r{i}"], run.depths[f"r{i}"]) == (want.tokens, want.exit_depths)
        logits.append(want.logits[0])
    assert not torch.equal(logits[0], logits[1]) and not torch.equal(logits[1], logits[2])
