"""``min_tokens`` (vLLM's rule): EOS (unless ignored) and ``stop_token_ids`` are not sampled
until ``min_tokens`` tokens exist, so a request ends on one no earlier than token
``min_tokens + 1``. The oracle bans them the same way; every engine mode (chunked prefill,
async scheduling with delayed exit, token pipelining, preemption in both modes) gives its
tokens and exit depths. Seeded sampling never draws a banned id early, and a request whose
banned ids are the whole vocabulary is refused."""

from __future__ import annotations

import random

import pytest
from engine_util import ENGINE_MODES, make_core, oracle_run, run_core, run_mode

from rltserve.sampling import SamplingParams

MIN = 5


def _workload(ref, n: int = 8, seed: int = 3):
    """Prompts, and per prompt params whose stop ids are tokens its free run samples early
    (so the ban changes what is sampled): its 2nd and 4th tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    params = []
    for i, prompt in enumerate(prompts):
        free = oracle_run(
            ref, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        ).tokens
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=12,
                min_tokens=MIN if i % 4 else 0,
                stop_token_ids=(free[1], free[3]),
                ignore_eos=True,
                exit_threshold=0.5,
            )
        )
    return prompts, params


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_stop_ids_are_banned_before_min_tokens_in_every_mode(ckpts, ouro_ref, mode):
    prompts, params = _workload(ouro_ref)
    kw = ENGINE_MODES[mode]
    core, run = run_mode(ckpts["ouro"], prompts, params, **kw)
    exit_mode = kw.get("exit_mode", "gate")
    banned_early = 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        want = oracle_run(ouro_ref, prompt, p, exit_mode=exit_mode, kv_policy="last_exited")
        rid = f"r{i}"
        assert run.tokens[rid] == want.tokens, f"request {i}"
        assert run.depths[rid] == want.exit_depths, f"request {i}"
        head = run.tokens[rid][: p.min_tokens]
        assert not set(head) & set(p.stop_token_ids), f"request {i}"
        if p.min_tokens:
            unbanned = p.replace(min_tokens=0, stop_token_ids=())
            free = oracle_run(
                ouro_ref, prompt, unbanned, exit_mode=exit_mode, kv_policy="last_exited"
            )
            banned_early += bool(set(free.tokens[: p.min_tokens]) & set(p.stop_token_ids))
        if run.finish[rid] == "stop":
            assert len(run.tokens[rid]) > p.min_tokens
    assert banned_early >= 3  # the ban changed what these requests sampled
    assert "stop" in run.finish.values()
    if "preemption_mode" in kw:
        assert core.stats().num_preemptions > 0
    core.kv.check_no_leaks()


def test_seeded_sampling_never_draws_a_banned_id_early(ckpts):
    core = make_core(ckpts["ouro"])
    stops = tuple(range(0, 384, 2))  # half the ids a prompt uses
    params = [
        SamplingParams(max_tokens=10, min_tokens=8, stop_token_ids=stops, temperature=1.5, seed=s)
        for s in range(6)
    ]
    run = run_core(core, [[5, 6, 7]] * 6, params)
    again = run_core(make_core(ckpts["ouro"]), [[5, 6, 7]] * 6, params)
    assert run.tokens == again.tokens  # seeded: the ban does not disturb reproducibility
    for rid, tokens in run.tokens.items():
        assert len(tokens) >= 8 and not set(tokens[:8]) & set(stops), rid


def test_banning_every_token_is_refused(ckpts):
    core = make_core(ckpts["ouro"])
    vocab = core.spec.vocab_size
    every = SamplingParams(
        temperature=0.0, max_tokens=4, min_tokens=2, stop_token_ids=tuple(range(vocab))
    )
    with pytest.raises(ValueError, match="min_tokens=2: EOS and stop_token_ids are every token"):
        core.make_request(None, [5, 6], every)
    # Without min_tokens it is a request that stops at its first token.
    run = run_core(core, [[5, 6]], [every.replace(min_tokens=0)])
    assert len(run.tokens["r0"]) == 1 and run.finish["r0"] == "stop"


def test_the_last_id_of_the_vocabulary_is_banned_too(ckpts):
    """The ban covers every id up to the vocabulary's last: a stop id of ``vocab_size - 1``,
    biased to be sampled at once, comes only after ``min_tokens``."""
    core = make_core(ckpts["ouro"])
    last = core.spec.vocab_size - 1
    p = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        min_tokens=3,
        stop_token_ids=(last,),
        ignore_eos=True,
        logit_bias={last: 100.0},
    )
    run = run_core(core, [[5, 6, 7]], [p])
    tokens = run.tokens["r0"]
    assert len(tokens) == 4 and last not in tokens[:3] and tokens[3] == last
    assert run.finish["r0"] == "stop"
