"""The prefix caching and n-sharing comparisons (``bench offline --shared-prefix-len P --n K``) on
a tiny checkpoint: structure and prompt-token counts, no timings asserted."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from rltserve.bench import prefix
from rltserve.bench.offline import run_offline_bench
from rltserve.cli import build_parser
from rltserve.engine_args import engine_kwargs
from rltserve.sampling import SamplingParams
from rltserve.updates import RequestUpdate as Update


def test_shared_prefix_and_n_compare(ouro_rv1):
    argv = [
        "bench", "offline", "--model", str(ouro_rv1), "--num-prompts", "4", "--input-len", "5",
        "--output-len", "2", "--block-size", "4", "--shared-prefix-len", "16", "--n", "2",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    report = run_offline_bench(args, engine_kwargs(args))["prefix_compare"]
    shared = report["shared_prefix"]
    assert shared["caching_off"]["prompt_tokens_computed"] == 4 * 21
    # The first computes all 21; the others reuse the 16-token prefix (4 full blocks).
    assert shared["caching_on"]["prompt_tokens_computed"] == 21 + 3 * 5
    for run in ("caching_off", "caching_on"):
        assert shared[run]["output_tokens"] == 4 * 2
    n = report["n_sharing"]
    assert (n["n"], n["prompts"]) == (2, 2)
    assert n["independent"]["prompt_tokens_computed"] == 4 * 5
    assert n["grouped"]["prompt_tokens_computed"] == 2 * 5 + 2 * 1  # followers: the last token
    assert n["ratios"]["prompt_tokens_computed_ratio"] == 12 / 20


def test_ratios_are_before_over_after_for_ttft_and_after_over_before_for_throughput():
    before = {"mean_ttft_s": 0.8, "output_tokens_per_s": 50.0, "prompt_tokens_computed": 40}
    after = {"mean_ttft_s": 0.2, "output_tokens_per_s": 100.0, "prompt_tokens_computed": 10}
    assert prefix._ratios(before, after) == {
        "ttft_reduction": 4.0,
        "throughput_gain": 2.0,
        "prompt_tokens_computed_ratio": 0.25,
    }


def test_shared_prefix_prompts_share_the_prefix_and_differ_after_it():
    prompts = prefix.shared_prefix_prompts(3, 6, 4, vocab=1000)
    assert [len(p) for p in prompts] == [10, 10, 10]
    assert prompts[0][:6] == prompts[1][:6] == prompts[2][:6]
    assert len({tuple(p[6:]) for p in prompts}) == 3


class _FakeCore:
    """Steps scripted updates: a prefill step with no token for b1, then one token each."""

    now = 0.0  # the fake clock: the number of steps taken

    def __init__(self, config, model):
        _FakeCore.now = 0.0
        self.script = [
            [Update("b0", [7]), Update("b1", [])],
            [Update("b1", [8]), Update("b0", [9])],
            [Update("b1", [10])],
        ]

    def add_request(self, request_id, prompt, params, group):
        pass

    def has_work(self):
        return bool(self.script)

    def step(self):
        _FakeCore.now += 1
        return self.script.pop(0)

    def stats(self):
        return SimpleNamespace(prefix_cache_hits=6, num_steps=3, num_rows=5)

    def shutdown(self):
        pass


def test_run_timed_times_first_tokens_and_rates_hits_per_prompt_token(monkeypatch):
    monkeypatch.setattr(prefix, "EngineCore", _FakeCore)
    monkeypatch.setattr(prefix.EngineConfig, "from_flat", staticmethod(lambda **kw: None))
    monkeypatch.setattr(prefix.time, "perf_counter", lambda: _FakeCore.now)
    params = [SamplingParams(max_tokens=2)] * 2
    out = prefix.run_timed(None, {}, [[1] * 8, [2] * 8], params)
    # b0's first token comes with step 1, b1's with step 2 (step 1 gave it no token).
    assert out["mean_ttft_s"] == 1.5
    assert out["output_tokens"] == 4 and out["output_tokens_per_s"] == 1.33
    assert out["prompt_tokens"] == 16 and out["prompt_tokens_computed"] == 10
    assert out["prefix_cache_hit_rate"] == 6 / 16
    assert (out["steps"], out["rows"]) == (3, 5)


def test_n_sharing_samples_floor_prompts_over_n_prompts_n_times_with_distinct_seeds(monkeypatch):
    calls = []

    def fake_run_timed(model, kw, prompts, params, groups, desc, show):
        calls.append((prompts, params, groups))
        return {"mean_ttft_s": 1.0, "output_tokens_per_s": 1.0, "prompt_tokens_computed": 1}

    monkeypatch.setattr(prefix, "run_timed", fake_run_timed)
    model = SimpleNamespace(spec=SimpleNamespace(vocab_size=1000))
    args = argparse.Namespace(
        num_prompts=5, n=2, input_len=4, output_len=3, exit_threshold=0.5, shared_prefix_len=0
    )
    report = prefix.run_prefix_compare(model, {}, args)
    assert report["n_sharing"]["prompts"] == 2  # 5 // 2: never more requests than asked for
    (alone, alone_params, no_groups), (grouped, params, groups) = calls
    assert alone == grouped and len(grouped) == 4 and no_groups is None
    assert grouped[0] == grouped[1] != grouped[2] == grouped[3]
    assert groups == ["g0", "g0", "g1", "g1"]
    assert alone_params == params
    assert all(p.temperature == 1.0 and p.max_tokens == 3 for p in params)
    seeds = [p.seed for p in params]
    assert len(set(seeds)) == 4 and seeds[1] == seeds[0] + 1 and seeds[3] == seeds[2] + 1
