"""Request settings that cannot hold together are rejected with a ValueError naming the field:
min_tokens above max_tokens, trace depths outside the loop bounds or in an engine that does not
replay traces; token pipelining's draft depth defaults to one that fits the model."""

from __future__ import annotations

import re

import pytest
from builders import build_nanbeige_tiny
from engine_util import make_core, run_core

from rltserve.caller_values import outside_vocab
from rltserve.generation_config import generation_config_defaults
from rltserve.prompt_truncation import truncated_prompt
from rltserve.samples import expand_samples, sample_ids, sample_seed
from rltserve.sampling import EXIT_CRITERIA, SamplingParams


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match=r"min_tokens=5: must be <= max_tokens \(3\)"):
        SamplingParams(temperature=0.0, max_tokens=3, min_tokens=5)
    assert SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3).min_tokens == 3


@pytest.mark.parametrize(
    "kw,message",
    [
        # Below 1 the bound itself is the fault, whatever min_loops is.
        ({"max_loops": 0}, r"max_loops=0: must be >= 1$"),
        ({"max_loops": -3, "min_loops": 2}, r"max_loops=-3: must be >= 1$"),
        ({"max_loops": 1, "min_loops": 2}, r"max_loops=1: must be >= min_loops \(2\)$"),
    ],
)
def test_max_loops_below_one_says_so(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"min_loops": 2, "trace_depths": [2, 1]}, r"depth 1 is below min_loops \(2\)"),
        ({"max_loops": 3, "trace_depths": [3, 4]}, r"depth 4 is above max_loops \(3\)"),
        ({"trace_depths": [1, 0]}, "must be ints >= 1"),
        ({"trace_depths": [True]}, "must be ints >= 1"),
    ],
)
def test_trace_depths_outside_the_loop_bounds_are_rejected(kw, message):
    with pytest.raises(ValueError, match=r"trace_depths=.*" + message):
        SamplingParams(**kw)


def test_trace_depths_are_rejected_outside_trace_mode(ouro_rv1):
    traced = SamplingParams(temperature=0.0, max_tokens=2, exit_threshold=0.5, trace_depths=[4, 4])
    for mode in ("gate", "delayed"):
        core = make_core(ouro_rv1, exit_mode=mode)
        with pytest.raises(ValueError, match=f"only for an engine with exit_mode='trace'.*{mode}"):
            core.add_request("r", [1, 2, 3], traced)
        assert not core.has_work()  # nothing half-added


def test_trace_depths_above_the_models_loops_are_rejected(ouro_rv1):
    core = make_core(ouro_rv1, exit_mode="trace")
    with pytest.raises(ValueError, match="depth 5 is above the request's 4 loops"):
        core.add_request(
            "r", [1, 2], SamplingParams(temperature=0.0, max_tokens=2, trace_depths=[2, 5])
        )
    capped = SamplingParams(temperature=0.0, max_tokens=2, max_loops=2, trace_depths=[1, 2])
    run = run_core(core, [[1, 2]], [capped])
    assert run.depths["r0"] == [1, 2]


def test_trace_depths_honour_min_loops(ouro_rv1):
    core = make_core(ouro_rv1, exit_mode="trace")
    params = SamplingParams(
        temperature=0.0, max_tokens=3, min_loops=2, ignore_eos=True, trace_depths=[2, 3, 4]
    )
    assert run_core(core, [[5, 6, 7]], [params]).depths["r0"] == [2, 3, 4]


def test_draft_loops_default_fits_a_two_loop_model(tmp_path):
    path = build_nanbeige_tiny(tmp_path / "nanbeige")
    prompts = [[3, 4, 5], [9, 8]]
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 2
    piped_core = make_core(path, speculative_tokens=1)
    assert piped_core.config.scheduler.draft_loops == 1
    piped = run_core(piped_core, prompts, params)
    assert piped.tokens == run_core(make_core(path), prompts, params).tokens
    with pytest.raises(ValueError, match="draft_loops=2: must be below the model's 2 loops"):
        make_core(path, speculative_tokens=1, draft_loops=2)


def test_draft_loops_default_stays_two_on_a_four_loop_model(ouro_rv1):
    assert make_core(ouro_rv1, speculative_tokens=1).config.scheduler.draft_loops == 2


def test_seed_range_leaves_room_for_every_sample():
    # Sample j draws with seed + j; torch's generators take seeds in [-2**63, 2**64).
    assert SamplingParams(temperature=0.0, seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(temperature=0.0, seed=-(2**63), n=3).n == 3
    with pytest.raises(ValueError, match=r"seed=18446744073709551615: must be in .*n=2"):
        SamplingParams(temperature=0.0, seed=2**64 - 1, n=2)
    with pytest.raises(ValueError, match="seed="):
        SamplingParams(temperature=0.0, seed=-(2**63) - 1)


def test_only_the_users_seed_of_minus_one_is_no_seed():
    """vLLM checks the seed a user gives for -1 ("no seed") once; sample j of n gets seed + j
    without that check: a derived -1 is 2**64 - 1, the seed torch reads for it."""
    assert SamplingParams(seed=-1).seed is None
    assert [sample_seed(-2, j) for j in range(3)] == [-2, 2**64 - 1, 0]
    samples = expand_samples(SamplingParams(temperature=1.0, seed=-2, n=3))
    assert [p.seed for p in samples] == [-2, 2**64 - 1, 0]
    assert samples[1].clone().seed == 2**64 - 1  # (the submitted copy keeps it)
    assert [p.seed for p in expand_samples(SamplingParams(seed=-1, n=2))] == [None, None]


def test_sample_ids_are_vllms_and_name_the_group():
    assert sample_ids("7", 1) == (["7"], None)
    assert sample_ids("7", 3) == (["0_7", "1_7", "2_7"], "7")


def test_a_sample_derived_at_minus_one_is_the_same_on_every_call(ouro_rv1):
    """seed=-2, n=3: sample 1 draws with seed -1 (that is 2**64 - 1), not with a seed the
    engine picks anew for each call."""
    core = make_core(ouro_rv1)
    samples = expand_samples(SamplingParams(temperature=1.0, max_tokens=6, seed=-2, n=3))
    calls = [run_core(core, [[5, 6, 7]] * 3, samples).tokens for _ in range(2)]
    alone = run_core(core, [[5, 6, 7]], [samples[1].replace(seed=2**64 - 1)]).tokens["r0"]
    core.shutdown()
    assert calls[0] == calls[1] and calls[0]["r1"] == alone
    assert calls[0]["r0"] != calls[0]["r1"] != calls[0]["r2"]  # (three seeds)


def test_clone_is_an_equal_copy_that_can_be_changed():
    p = SamplingParams(n=4, temperature=1.0, seed=3, stop=["x"], logit_bias={5: 1.0})
    q = p.clone()
    assert q == p and q is not p
    assert q.replace(n=2).n == 2 and p.n == 4


def test_fields_are_keyword_only():
    """vLLM's first positional field is ``n``; here a positional argument is a TypeError rather
    than silently setting another field."""
    for args, kwargs in [((2,), {}), ((2,), {"thinking_token_budget": 3}), ((1, 0.5), {})]:
        with pytest.raises(TypeError, match="positional argument"):
            SamplingParams(*args, **kwargs)
    p = SamplingParams(n=2, max_tokens=3)
    assert (p.n, p.max_tokens) == (2, 3)
    assert p.replace(n=3).n == 3 and SamplingParams.from_optional(n=None).n == 1


def test_the_engine_refuses_what_its_model_and_mode_cannot_run(ouro_rv1):
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    core = make_core(ouro_rv1)
    with pytest.raises(ValueError, match="^prompt: must contain at least one token$"):
        core.add_request("r", [], greedy)
    traced = make_core(ouro_rv1, exit_mode="trace")
    with pytest.raises(
        ValueError, match="^trace_depths: required when the engine runs exit_mode='trace'$"
    ):
        traced.add_request("r", [1, 2], greedy)
    assert not core.has_work() and not traced.has_work()
    # min_loops may be the loops the request runs at most (the model's 4 here).
    assert run_core(core, [[5, 6]], [greedy.replace(min_loops=4)]).depths["r0"] == [4, 4]


def test_logprob_counts_are_bounded_by_the_engine_and_the_vocabulary(ouro_rv1):
    from rltserve.core.request_checks import check_params

    core = make_core(ouro_rv1, max_logprobs=20)
    vocab = core.spec.vocab_size

    def checked(config, **kw):
        params = SamplingParams(temperature=0.0, max_tokens=1, **kw)
        return check_params([1, 2], params, core.spec, config, 64, False)

    assert checked(core.config, logprobs=20, prompt_logprobs=20).logprobs == 20
    with pytest.raises(ValueError, match=r"^logprobs=21: more than this engine's max_logprobs"):
        checked(core.config, logprobs=21)
    unbounded = make_core(ouro_rv1, max_logprobs=-1).config
    every = checked(unbounded, logprobs=-1, prompt_logprobs=-1)
    assert (every.logprobs, every.prompt_logprobs) == (vocab, vocab)
    with pytest.raises(ValueError, match=f"^prompt_logprobs={vocab + 1}: more than the vocab"):
        checked(unbounded, prompt_logprobs=vocab + 1)


def test_min_tokens_bans_are_refused_only_when_nothing_is_left_to_sample(ouro_rv1):
    core = make_core(ouro_rv1)
    vocab = core.spec.vocab_size
    base = SamplingParams(temperature=0.0, max_tokens=2, min_tokens=1, ignore_eos=True)
    with pytest.raises(ValueError, match="^min_tokens=1: EOS and stop_token_ids are every"):
        core.make_request(None, [1, 2], base.replace(stop_token_ids=list(range(vocab))))
    # As many stop ids as the vocabulary, one outside it (it never comes): id 0 is left.
    core.make_request(None, [1, 2], base.replace(stop_token_ids=[*range(1, vocab), vocab + 7]))
    with pytest.raises(ValueError, match="^allowed_token_ids: every one is EOS or a stop"):
        core.make_request(
            None, [1, 2], base.replace(stop_token_ids=[5, 6], allowed_token_ids=[5, 6])
        )
    core.make_request(None, [1, 2], base.replace(stop_token_ids=[5, 6], allowed_token_ids=[5, 7]))


def test_the_engine_gets_repeated_token_ids_once_in_the_order_first_given():
    p = SamplingParams(stop_token_ids=[7, 3, 7, 9, 3] * 1000, allowed_token_ids=[5, 2, 5, 2, 8])
    sent = p.for_engine(64)
    assert (sent.stop_token_ids, sent.allowed_token_ids) == ([7, 3, 9], [5, 2, 8])
    assert len(p.stop_token_ids) == 5000  # (the caller's params stay as given, as vLLM's)
    assert p.replace(stop_token_ids=[1, 1]).for_engine(64).stop_token_ids == [1]


def test_the_engine_gets_no_stop_id_the_model_cannot_produce():
    p = SamplingParams(stop_token_ids=[70, 3, 64, 63], allowed_token_ids=[99])
    kept = p.for_engine(64)
    assert (kept.stop_token_ids, kept.allowed_token_ids) == ([3, 63], [99])
    assert p.stop_token_ids == [70, 3, 64, 63]  # (a copy: the caller's stay as given)
    assert p.for_engine(71) is p
    assert [n for n, ids in kept.vocab_token_ids() if ids] == ["allowed_token_ids"]


@pytest.mark.parametrize(
    "kw",
    [
        {"top_p": 1e-6},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-6},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"min_tokens": 0, "max_tokens": 1},
        {"min_loops": 2, "max_loops": 2},
        {"exit_threshold": 1e-9},
        {"exit_criterion": "argmax-stability", "exit_threshold": 3.0},
        {"max_thinking_tokens": 1},
        {"max_thinking_tokens": 0},  # (vLLM's 0: no thinking)
        {"logit_bias": {0: -100.0, 1: 100}},
        {"stop_token_ids": [0], "allowed_token_ids": [0]},
        {"truncate_prompt_tokens": 1},
        {"truncate_prompt_tokens": -1},
        {"priority": -3},
        {"logprobs": 0, "prompt_logprobs": -1},
    ],
)
def test_the_edges_of_each_range_are_accepted(kw):
    assert {k: getattr(SamplingParams(**kw), k) for k in kw} == kw


@pytest.mark.parametrize(
    "kw",
    [
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"min_p": -0.01},
        {"min_p": 1.01},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("nan")},
        {"presence_penalty": -2.01},
        {"frequency_penalty": 2.01},
        {"stop": [3]},
        {"stop_token_ids": [-1]},
        {"ignore_eos": 1},
        {"min_tokens": -1},
        {"min_tokens": 4, "max_tokens": 3},
        {"min_loops": 0},
        {"max_loops": 1, "min_loops": 2},
        {"exit_threshold": 0.0},
        {"exit_threshold": float("nan")},
        {"exit_threshold": 2.5, "exit_criterion": "argmax-stability"},
        {"exit_criterion": "entropy"},
        {"kv_policy": "ring:0"},
        {"priority": 1.5},
        {"seed": 1.5},
        {"logprobs": -2},
        {"extra_args": ["k"]},
        {"speculative": 1},
        {"init_state": "ones"},
        {"include_stop_str_in_output": 1},
        {"skip_special_tokens": None},
        {"max_thinking_tokens": -2},
        {"thinking_end_token_ids": []},
        {"thinking_interruption": [-1]},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {1: -100.5}},
        {"logit_bias": {1: 100.5}},
        {"logit_bias": {1: "up"}},
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
    ],
)
def test_a_value_out_of_range_is_refused_naming_its_field(kw):
    field = next(iter(kw))  # (the one refused comes first)
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**kw)


def test_generation_config_sampling_defaults(tmp_path):
    """vLLM's reading of ``generation_config.json``: its sampling keys (``max_new_tokens`` as
    ``max_tokens``), without the keys set to null; a file that is no JSON object, or a value
    SamplingParams refuses, is an error naming the file."""
    config = tmp_path / "generation_config.json"
    assert generation_config_defaults(None) == generation_config_defaults(tmp_path) == {}
    config.write_text(
        '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "max_new_tokens": 64,'
        ' "repetition_penalty": 1.1, "do_sample": true, "eos_token_id": 2, "typical_p": null}'
    )
    assert generation_config_defaults(tmp_path) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "max_tokens": 64,
        "repetition_penalty": 1.1,
    }
    config.write_text('{"temperature": null, "top_k": 50, "max_new_tokens": null}')
    assert generation_config_defaults(tmp_path) == {"top_k": 50}
    for text, message in [
        ("[1, 2]", "must hold a JSON object"),
        ("{", "not readable JSON"),
        ('{"top_p": 0}', "top_p=0: must be in"),
    ]:
        config.write_text(text)
        with pytest.raises(ValueError, match=f"^{re.escape(str(config))}: {message}"):
            generation_config_defaults(tmp_path)


def test_truncation_keeps_up_to_the_context_and_vocab_bounds_are_exclusive():
    ids = list(range(10))
    assert truncated_prompt(ids, None, 8) == ids
    assert truncated_prompt(ids, 8, 8) == ids[-8:]  # (the whole context: the engine judges it)
    assert truncated_prompt(ids[:5], 8, 8) == ids[:5]
    assert truncated_prompt(ids, -1, 8) == ids[-7:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=9: greater than"):
        truncated_prompt(ids, 9, 8)
    assert outside_vocab("allowed_token_ids", [0, 511], 512) is None
    assert outside_vocab("allowed_token_ids", [3, 512], 512) == (
        "allowed_token_ids: token id 512 is outside the vocabulary [0, 512)"
    )


def test_a_criterion_set_later_takes_its_own_default_threshold():
    """SamplingParams are mutable (vLLM's): a criterion set on params built without a
    threshold takes that criterion's default (``EXIT_CRITERIA``), as the constructor would
    give it, in the params and in the copy a request runs (``clone``); it kept kl's or 1.0, so
    argmax-stability exited after one stable loop instead of five. A threshold given, or set
    by hand, is kept."""
    sweep = SamplingParams(temperature=0.0)
    assert sweep.exit_threshold == 1.0 and not sweep.adaptive_exit  # (a fixed depth)
    for name, default in EXIT_CRITERIA.items():
        sweep.exit_criterion = name
        assert (sweep.exit_threshold, sweep.clone().exit_threshold) == (default, default), name
    sweep.exit_criterion = None
    assert sweep.exit_threshold == 1.0 and not sweep.adaptive_exit
    # "none" never exits early, whatever its threshold
    assert not SamplingParams(exit_criterion="none", exit_threshold=0.5).adaptive_exit
    copied = SamplingParams(exit_criterion="kl").clone()
    copied.exit_criterion = "latent-diff"
    assert copied.exit_threshold == 0.03
    assert (
        SamplingParams(exit_criterion="kl").replace(exit_criterion="minp-kl").exit_threshold == 1e-6
    )
    given = SamplingParams(exit_threshold=0.5)
    given.exit_criterion = "entropy-diff"
    assert given.clone().exit_threshold == 0.5
    by_hand = SamplingParams()
    by_hand.exit_threshold = 1.0
    by_hand.exit_criterion = "kl"
    assert by_hand.clone().exit_threshold == 1.0
