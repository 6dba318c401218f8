"""The offline benchmark's comparisons, on a tiny checkpoint (structure and consistency; no
timings are asserted)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from engine_util import oracle_run

from rltserve.bench.flops import exit_criterion_run, flop_bound, flops_per_token, run_flop_bound
from rltserve.bench.offline import _params, run_offline_bench
from rltserve.cli import build_parser
from rltserve.engine_args import engine_kwargs
from rltserve.models import load_model
from rltserve.sampling import SamplingParams


def bench(*argv: str) -> dict:
    args = build_parser().parse_args(["bench", "offline", *argv])
    return run_offline_bench(args, engine_kwargs(args))


def test_graphs_compare_on_cpu_runs_the_eager_cells(ouro_rv1, ouro_ref):
    report = bench(
        "--model", str(ouro_rv1), "--input-len", "6", "--output-len", "3",
        "--exit-threshold", "0.5", "--cuda-graphs", "--compare", "--concurrency-list", "1,3",
    )  # fmt: skip
    cmp = report["graphs_compare"]
    assert cmp["modes"] == ["eager"] and "CUDA device" in cmp["note"]
    assert cmp["exit_thresholds"] == [0.5, 1.0]
    for concurrency, num_prompts in (("1", 4), ("3", 6)):
        row = cmp[concurrency]
        adaptive, full = row["eager_q0.5"], row["eager_q1.0"]
        assert adaptive["output_tokens"] == full["output_tokens"] == 3 * num_prompts
        assert full["mean_exit_depth"] == 4.0
        # The bench's workload (seeded by the concurrency) through the oracle: the adaptive
        # cell's mean exit depth is a value the bench could get wrong.
        rng = random.Random(int(concurrency))
        prompts = [[rng.randrange(384) for _ in range(6)] for _ in range(num_prompts)]
        p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, exit_threshold=0.5)
        depths = [
            d
            for q in prompts
            for d in oracle_run(ouro_ref, q, p, kv_policy="last_exited").exit_depths
        ]
        assert adaptive["mean_exit_depth"] == round(sum(depths) / len(depths), 3)
        assert adaptive["mean_exit_depth"] < 4.0
        assert row["eager_vs_full_depth"] > 0
        assert "graph_steps" not in adaptive  # no graphs were built


def test_max_loops_sets_the_depth_huginn_runs_at(huginn_rv1):
    report = bench(
        "--model", str(huginn_rv1), "--input-len", "4", "--output-len", "3",
        "--num-prompts", "2", "--max-loops", "3",
    )  # fmt: skip
    assert report["max_loops"] == 3 and report["refill"]["mean_exit_depth"] == 3.0
    # Full depth is --max-loops (not the model's 4): a full-depth run has no FLOPs to save.
    assert report["flop_bound_decode"] == pytest.approx(1.0)
    assert report["flop_bound_workload"] == pytest.approx(1.0)


def test_exit_criterion_is_compared_with_full_depth(huginn_rv1):
    report = bench(
        "--model", str(huginn_rv1), "--input-len", "4", "--output-len", "4", "--num-prompts",
        "3", "--exit-criterion", "entropy-diff", "--exit-threshold", "0.6", "--compare",
    )  # fmt: skip
    assert (report["exit_criterion"], report["exit_threshold"]) == ("entropy-diff", 0.6)
    assert report["full_depth"]["mean_exit_depth"] == 4.0
    assert report["refill"]["mean_exit_depth"] < 4.0
    assert report["refill"]["output_tokens"] == report["full_depth"]["output_tokens"] == 12


def test_disaggregate_compares_one_stage_with_two(tiny):
    report = bench(
        "--model", str(tiny), "--disaggregate", "--block-size", "4", "--input-len", "12",
        "--output-len", "3", "--num-prompts", "3",
    )  # fmt: skip
    cmp = report["pd_compare"]
    for arm in ("one_stage", "disaggregated"):
        assert cmp[arm]["steps"] > 0 and cmp[arm]["ttft_mean_ms"] > 0
        assert cmp[arm]["itl_mean_ms"] > 0
    assert cmp["disaggregated_vs_one_stage"] > 0


def test_flop_bounds_on_round_numbers():
    # F0 10, Fr 5, 4 loops, exits at 2 on average; 3 prompt tokens (every loop), 2 out.
    bounds = flop_bound(10.0, 5.0, 4, 2.0, 3, 2)
    assert bounds["flop_bound_decode"] == pytest.approx((10 + 4 * 5) / (10 + 2 * 5))
    full, adaptive = 3 * 4 * 5 + 2 * (10 + 4 * 5), 3 * 4 * 5 + 2 * (10 + 2 * 5)
    assert bounds["flop_bound_workload"] == pytest.approx(full / adaptive)


def test_the_bound_is_one_where_every_loop_runs_and_none_where_the_head_runs_per_loop():
    """kv_policy full runs every token to the full depth: nothing to save (1.0). A criterion
    that runs the coda and head at every loop has no bound (None) and says why; the gate,
    latent-diff and a fixed depth keep the formula."""
    args = (10.0, 5.0, 4, 2.0, 3, 2)
    formula = flop_bound(*args)
    assert run_flop_bound(*args, "last_exited", None) == formula
    assert run_flop_bound(*args, "last_exited", "latent-diff") == formula
    full = run_flop_bound(*args, "full", None)
    assert (full["flop_bound_decode"], full["flop_bound_workload"]) == (1.0, 1.0)
    assert full["flop_bound_note"].startswith("kv_policy full: every token runs every loop")
    for criterion in ("kl", "minp-kl", "entropy-diff", "argmax-stability"):
        for policy in ("last_exited", "full"):
            none = run_flop_bound(*args, policy, criterion)
            assert (none["flop_bound_decode"], none["flop_bound_workload"]) == (None, None)
            assert none["flop_bound_note"].startswith(f"exit_criterion {criterion} runs the coda")
    # The criterion a request runs: kl for an adaptive threshold alone, none on a gated model.
    assert exit_criterion_run(None, 0.5, has_gate=False) == "kl"
    assert exit_criterion_run(None, 1.0, has_gate=False) is None
    assert exit_criterion_run("argmax-stability", 5, has_gate=False) == "argmax-stability"
    assert exit_criterion_run(None, 0.5, has_gate=True) is None


def test_the_report_bound_follows_the_kv_policy_and_the_criterion(ouro_rv1, huginn_rv1):
    report = bench(
        "--model", str(ouro_rv1), "--num-prompts", "3", "--input-len", "4", "--output-len", "3",
        "--exit-threshold", "0.5", "--kv-policy", "full", "--compare",
    )  # fmt: skip
    assert report["refill"]["mean_exit_depth"] < 4.0  # (exits early, yet loops on)
    assert (report["flop_bound_decode"], report["flop_bound_workload"]) == (1.0, 1.0)
    assert "kv_policy full" in report["flop_bound_note"]
    ratios = report["ratios"]
    assert ratios["refill_speedup_vs_flop_bound"] == round(ratios["refill_vs_full_depth"], 3)
    report = bench(
        "--model", str(huginn_rv1), "--num-prompts", "2", "--input-len", "4", "--output-len",
        "3", "--exit-threshold", "0.5", "--compare",
    )  # fmt: skip
    assert (report["flop_bound_decode"], report["flop_bound_workload"]) == (None, None)
    assert report["flop_bound_note"].startswith("exit_criterion kl runs the coda")
    assert report["ratios"]["refill_speedup_vs_flop_bound"] is None


LOOP_PARTS = ("transformer.adapter.", "transformer.core_block.")  # Huginn's looped weights


def test_flops_per_token_count_the_loop_apart_and_a_tied_head_once(ouro_rv1, huginn_rv1):
    ouro = load_model(str(ouro_rv1))
    sizes = {name: p.numel() for name, p in ouro.named_parameters()}
    head, embed = sizes["lm_head.weight"], sizes["model.embed_tokens.weight"]
    # Untied: the embedding is a lookup; outside the loop only the head computes.
    loop = sum(sizes.values()) - head - embed
    assert flops_per_token(ouro) == (2.0 * head, 2.0 * loop)
    huginn = load_model(str(huginn_rv1))
    sizes = {name: p.numel() for name, p in huginn.named_parameters()}
    loop = sum(n for name, n in sizes.items() if name.startswith(LOOP_PARTS))
    assert loop and "lm_head.weight" not in sizes  # (tied: the embedding is the head)
    assert flops_per_token(huginn) == (2.0 * (sum(sizes.values()) - loop), 2.0 * loop)


def test_compare_runs_every_arm_on_one_workload(ouro_rv1, ouro_ref):
    report = bench(
        "--model", str(ouro_rv1), "--num-prompts", "9", "--input-len", "4", "--output-len", "3",
        "--concurrency", "2", "--exit-threshold", "0.5", "--compare",
    )  # fmt: skip
    refill, full = report["refill"], report["full_depth"]
    for arm in ("refill", "no_refill", "full_depth"):
        assert report[arm]["output_tokens"] == 9 * 3, arm
        assert report[arm]["step_overhead"] >= 1  # model calls are part of the wall time
        seconds = report[arm]["seconds"]  # (rounded: the rates are of the unrounded time)
        assert abs(report[arm]["requests_per_s"] * seconds - 9) < 0.01 * 9
        assert abs(report[arm]["total_tokens_per_s"] * seconds - 9 * 7) < 0.01 * 63
    assert report["no_refill"]["mean_exit_depth"] == refill["mean_exit_depth"] < 4.0
    # The workload (seed 0) through the oracle: the same exits.
    rng = random.Random(0)
    prompts = [[rng.randrange(384) for _ in range(4)] for _ in range(9)]
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, exit_threshold=0.5)
    depths = [
        d for q in prompts for d in oracle_run(ouro_ref, q, p, kv_policy="last_exited").exit_depths
    ]
    assert refill["mean_exit_depth"] == round(sum(depths) / len(depths), 3)
    # A finished request's slot waits for its whole batch without refill: more steps.
    assert report["no_refill"]["steps"] > refill["steps"]
    # Full depth: every prompt and output token but the last runs all 4 loops.
    assert full["mean_exit_depth"] == 4.0
    assert full["mean_rows_per_step"] == round(9 * (4 + 3 - 1) * 4 / full["steps"], 2)
    assert report["naive"]["output_tokens"] == 8 * 3  # (the naive loop: the first 8 prompts)
    rate = {arm: report[arm]["output_tokens_per_s"] for arm in ("no_refill", "full_depth", "naive")}
    ratios = report["ratios"]
    for arm in rate:
        assert ratios[f"refill_vs_{arm}"] == round(refill["output_tokens_per_s"] / rate[arm], 3)
    f0, fr = flops_per_token(load_model(str(ouro_rv1)))
    bounds = flop_bound(f0, fr, 4, refill["mean_exit_depth"], 4, 3)
    assert report["flop_bound_workload"] == bounds["flop_bound_workload"]
    assert report["flop_bound_decode"] == bounds["flop_bound_decode"]
    speedup = ratios["refill_vs_full_depth"] / bounds["flop_bound_workload"]
    assert ratios["refill_speedup_vs_flop_bound"] == round(speedup, 3)


def test_pipelining_compare_against_block_mode(ouro_rv1, monkeypatch):
    from rltserve.core.engine import EngineCore

    stats, real = [], EngineCore.stats

    def spy(self):
        stats.append(real(self))
        return stats[-1]

    monkeypatch.setattr(EngineCore, "stats", spy)
    report = bench(
        "--model", str(ouro_rv1), "--input-len", "4", "--output-len", "3",
        "--speculative-tokens", "2", "--draft-loops", "3", "--compare",
    )  # fmt: skip
    cmp = report["pipelining_compare"]
    assert (cmp["speculative_tokens"], cmp["draft_loops"]) == (2, 3)
    # (its own concurrencies, a prompt per request: the header leaves out what it did not use)
    assert "num_prompts" not in report and "concurrency" not in report
    assert (report["input_len"], report["output_len"]) == (4, 3)
    for concurrency, piped_stats in (("1", stats[1]), ("8", stats[3])):
        block, piped = cmp[concurrency]["block"], cmp[concurrency]["pipelined"]
        assert block["output_tokens"] == piped["output_tokens"] == 3 * int(concurrency)
        assert "draft_loops" not in block and "draft_acceptance" not in block
        assert piped["draft_loops"] == 3 and piped_stats.drafts_checked > 0
        kept = 1 - piped_stats.drafts_rejected / piped_stats.drafts_checked
        assert piped["draft_acceptance"] == round(kept, 3)
        speedup = piped["output_tokens_per_s"] / block["output_tokens_per_s"]
        assert cmp[concurrency]["speedup"] == round(speedup, 3)


def test_wavefront_compare_counts_the_steps_to_the_first_token(ouro_rv1, monkeypatch):
    import rltserve.bench.prefill as prefill

    calls, real = [], prefill.measure_ttft

    def spy(model, engine_kw, prompt, background, warm_steps):
        keys = ("prefill_chunk_size", "wavefront_prefill", "max_num_seqs")
        calls.append((len(prompt), len(background), warm_steps, *(engine_kw[k] for k in keys)))
        return real(model, engine_kw, prompt, background, warm_steps)

    monkeypatch.setattr(prefill, "measure_ttft", spy)
    report = bench(
        "--model", str(ouro_rv1), "--wavefront-prefill", "--compare", "--chunk-sizes", "4,8",
        "--concurrency", "4",
    )  # fmt: skip
    cmp = report["wcpb_compare"]
    assert (cmp["num_chunks"], cmp["decode_load"]) == (16, 8)
    unused = ("num_prompts", "input_len", "output_len", "concurrency")
    assert not any(key in report for key in unused)
    for chunk in (4, 8):
        for load in ("alone", "under_decode_load"):
            cell = cmp[str(chunk)][load]
            # 16 chunks through 4 loops: one after another 16 * 4 steps, as a wavefront 16 + 3.
            assert (cell["chunked"]["steps"], cell["wavefront"]["steps"]) == (64, 19)
            ratio = cell["chunked"]["ttft_s"] / cell["wavefront"]["ttft_s"]
            assert cell["ttft_ratio"] == round(ratio, 3)
    assert calls == [
        (16 * chunk, load, 8, chunk, wave, 9)
        for chunk in (4, 8)
        for load in (0, 8)
        for wave in (False, True)
    ]


def test_each_request_runs_output_len_tokens_at_the_exit_flags():
    args = build_parser().parse_args(
        ["bench", "offline", "--output-len", "5", "--exit-threshold", "0.7", "--max-loops", "3"]
    )
    p = _params(args)
    assert (p.temperature, p.max_tokens, p.ignore_eos) == (0.0, 5, True)
    assert (p.exit_threshold, p.exit_criterion, p.max_loops) == (0.7, None, 3)


def test_graphs_compare_at_full_depth_runs_each_cell_once(ouro_rv1):
    report = bench(
        "--model", str(ouro_rv1), "--input-len", "4", "--output-len", "2", "--cuda-graphs",
        "--compare", "--concurrency-list", "1",
    )  # fmt: skip
    cmp = report["graphs_compare"]
    assert cmp["exit_thresholds"] == [1.0]
    assert set(cmp["1"]) == {"eager_q1.0"}  # (no ratio of full depth to itself)


def test_the_full_depth_arm_drops_the_exit_criterion(huginn_rv1, monkeypatch):
    import rltserve.bench.offline as offline

    arms, real = {}, offline.run_engine

    def spy(model, engine_kw, prompts, params, desc="engine", show=False):
        arms[desc] = params
        return real(model, engine_kw, prompts, params, desc, show)

    monkeypatch.setattr(offline, "run_engine", spy)
    bench(
        "--model", str(huginn_rv1), "--input-len", "4", "--output-len", "2", "--num-prompts",
        "2", "--exit-criterion", "entropy-diff", "--compare",
    )  # fmt: skip
    assert arms["refill"].adaptive_exit and arms["no_refill"].adaptive_exit
    full = arms["full depth"]
    assert (full.exit_threshold, full.exit_criterion, full.adaptive_exit) == (1.0, None, False)


def test_the_wavefront_probe_arrives_while_its_load_decodes(ouro_rv1, monkeypatch):
    from rltserve.bench.prefill import measure_ttft
    from rltserve.core.engine import EngineCore

    seen, real = [], EngineCore.add_request

    def spy(self, request_id, prompt, params, *args):
        if request_id == "probe":  # how many of the load had produced a token by then
            seen.append(sum(bool(r.output_token_ids) for r in self.scheduler.running))
        return real(self, request_id, prompt, params, *args)

    monkeypatch.setattr(EngineCore, "add_request", spy)
    kw = engine_kwargs(build_parser().parse_args(["bench", "offline", "--model", str(ouro_rv1)]))
    load = [[1, 2, 3], [4, 5, 6]]
    assert measure_ttft(load_model(str(ouro_rv1)), kw, [7] * 8, load, 8)["steps"] == 4
    assert measure_ttft(load_model(str(ouro_rv1)), kw, [7] * 8, [], 8)["steps"] == 4
    assert seen == [2, 0]


def test_wavefront_compare_budgets_four_chunks_and_the_load(monkeypatch):
    import rltserve.bench.prefill as prefill

    budgets = []

    def measure(model, engine_kw, prompt, background, warm_steps):
        budgets.append(engine_kw["max_num_batched_tokens"])
        return {"ttft_s": 0.1 if engine_kw["wavefront_prefill"] else 0.3, "steps": 1}

    monkeypatch.setattr(prefill, "measure_ttft", measure)
    model = SimpleNamespace(spec=SimpleNamespace(vocab_size=50))
    kw = {"max_num_batched_tokens": 40, "max_num_seqs": 4}
    out = prefill.run_wcpb_compare(model, kw, [4, 16], num_chunks=2, decode_load=3)
    assert budgets == [40] * 4 + [16 * 4 + 3] * 4  # (never below the engine's own)
    assert out["16"]["under_decode_load"]["ttft_ratio"] == 3.0


class _Clock:
    """The offline bench module's ``time``: the fake stage moves ``now``."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _FakeStage:
    """A stage client that answers each request at once, on the caller's thread: token updates
    at the times ``arrivals`` gives (the last one finishes it); its counters grow by one step,
    50 ms busy and 40 ms in the model per request."""

    def __init__(self, clock: _Clock, arrivals: dict[str, list[float]]) -> None:
        self.clock, self.arrivals = clock, arrivals
        self.stats = SimpleNamespace(num_steps=10, busy_seconds=1.0, model_seconds=1.0)

    def wait_ready(self, timeout: float) -> None:
        return None

    def add_request(self, request_id, prompt, params, sink) -> None:
        from rltserve.updates import FinishReason, RequestUpdate

        times = self.arrivals[request_id]
        for k, at in enumerate(times):
            self.clock.now = at
            last = k + 1 == len(times)
            sink(
                RequestUpdate(request_id, [7], finish_reason=FinishReason.LENGTH if last else None)
            )
        s = self.stats
        self.stats = SimpleNamespace(
            num_steps=s.num_steps + 1,
            busy_seconds=s.busy_seconds + 0.05,
            model_seconds=s.model_seconds + 0.04,
        )

    def close(self) -> None:
        return None


def test_stage_run_times_first_tokens_and_mean_gaps(tiny, monkeypatch):
    import rltserve.bench.offline as offline

    clock = _Clock()
    stage = _FakeStage(clock, {"s0": [0.1, 0.2, 0.4], "s1": [0.5, 0.6], "s2": [0.8]})
    monkeypatch.setattr(offline, "time", clock)
    monkeypatch.setattr("rltserve.core.pd.stage_client", lambda config: stage)
    kw = engine_kwargs(build_parser().parse_args(["bench", "offline", "--model", str(tiny)]))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = offline.run_stage(kw, [[1, 2]] * 3, params)
    assert out["seconds"] == 0.8 and out["output_tokens_per_s"] == round(9 / 0.8, 2)
    assert out["ttft_mean_ms"] == round(1e3 * (0.1 + 0.5 + 0.8) / 3, 1)
    # Each request's mean gap, (last - first) / (tokens - 1); one token has none.
    assert out["itl_mean_ms"] == round(1e3 * (0.15 + 0.1) / 2, 2)
    # The counters' growth during the run: 3 steps, 150 ms busy, 120 ms in the model.
    assert out["steps"] == 3 and out["ms_per_step"] == round(800 / 3, 2)
    assert out["executor_busy"] == pytest.approx(0.15 / 0.8, abs=1e-3)
    assert out["executor_model"] == pytest.approx(0.12 / 0.8, abs=1e-3)


def _stub_stage_runs(monkeypatch) -> list[dict]:
    """``run_stage`` recorded and answered at once: 100 tokens/s async or disaggregated, 50
    otherwise."""
    import rltserve.bench.offline as offline

    runs = []

    def run_stage(engine_kw, prompts, params, desc="stage", show=False):
        runs.append({**engine_kw, "num_prompts": len(prompts)})
        fast = engine_kw["async_scheduling"] or engine_kw["disaggregate"]
        return {"output_tokens_per_s": 100.0 if fast else 50.0}

    monkeypatch.setattr(offline, "run_stage", run_stage)
    return runs


def test_async_compare_runs_sync_then_async_at_each_concurrency(ouro_rv1, monkeypatch):
    runs = _stub_stage_runs(monkeypatch)
    report = bench(
        "--model", str(ouro_rv1), "--async-scheduling", "--compare", "--num-prompts", "3",
        "--concurrency-list", "2,5",
    )  # fmt: skip
    cmp = report["async_compare"]
    assert cmp["2"]["async_vs_sync"] == cmp["5"]["async_vs_sync"] == 2.0
    assert "concurrency" not in report and report["num_prompts"] == 3
    # Every concurrency is filled; async needs exits decided a loop ahead.
    assert [(r["max_num_seqs"], r["async_scheduling"], r["num_prompts"]) for r in runs] == [
        (2, False, 3), (2, True, 3), (5, False, 5), (5, True, 5),
    ]  # fmt: skip
    assert report["exit_mode"] == "delayed"
    assert {r["exit_mode"] for r in runs} == {"delayed"}


def test_pd_compare_gives_the_pd_settings_to_the_disaggregated_arm_only(ouro_rv1, monkeypatch):
    runs = _stub_stage_runs(monkeypatch)
    report = bench(
        "--model", str(ouro_rv1), "--disaggregate", "--prefill-device", "cpu",
        "--kv-transfer-gb", "0.5", "--num-prompts", "2",
    )  # fmt: skip
    assert report["pd_compare"]["disaggregated_vs_one_stage"] == 2.0
    assert [(r["disaggregate"], r["prefill_device"], r["kv_transfer_gb"]) for r in runs] == [
        (False, None, None), (True, "cpu", 0.5),
    ]  # fmt: skip
